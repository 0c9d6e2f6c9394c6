"""The node budget and the on-line acceptance statistics."""

import pytest

from redrafter_mlx.drafting.budget import AcceptanceStats, best_node_count
from redrafter_mlx.drafting.cost import CostCurve
from redrafter_mlx.drafting.tree import Draft, candidate_tree


def flat(n):
    return 1.0


def test_a_free_verification_keeps_every_node_that_can_be_accepted():
    k, rate = best_node_count([[0.9, 0.5, 0.1]], flat, 10)
    assert k == 3 and rate == pytest.approx(2.5)


def test_a_steep_curve_keeps_only_the_nodes_worth_their_cost():
    curve = CostCurve([1, 2, 4, 8], [1.0, 1.5, 3.0, 6.0])
    # 1 node: (1 + 0.9) / cost(2) = 1.27 beats 1 / 1 and (1 + 0.9 + 0.5) / cost(3) = 2.4 / 2.25.
    assert best_node_count([[0.9, 0.5, 0.1]], curve, 10)[0] == 1
    flatter = CostCurve([1, 2, 4, 8], [1.0, 1.2, 1.4, 6.0])
    assert best_node_count([[0.9, 0.8, 0.1]], flatter, 10)[0] == 2  # 2.7 / 1.3 > 2.8 / 1.4 > 1.9 / 1.2
    assert best_node_count([[0.2, 0.1]], curve, 10)[0] == 0  # plain decoding
    assert (
        best_node_count([[0.9, 0.5, 0.1]], curve, 10, extra_seconds=100.0)[0] == 3
    )  # a costly step wants more per step


def test_the_budget_is_shared_by_the_rows_of_a_batch():
    curve = CostCurve([1, 2], [1.0, 1.4])
    assert best_node_count([[0.5], [0.5]], curve, 4)[0] == 1  # 3 / 1.4 > 2 / 1
    assert best_node_count([[0.3], [0.0]], curve, 4)[0] == 0  # 2.3 / 1.4 < 2


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve([1, 2, 4], [1.0, 2.0, 3.0])
    assert curve(3) == pytest.approx(2.5)
    assert curve(6) == pytest.approx(4.0)
    assert curve.relative() == [1.0, 2.0, 3.0]


def test_statistics_calibrate_predictions_by_what_was_accepted():
    stats = AcceptanceStats()
    assert stats.estimate(("rnn", 1), 0.8) == pytest.approx(0.8)  # prior: trust the drafter
    assert stats.estimate(("lookup2", 1), 1.0) == pytest.approx(0.5)
    for accepted in [True, False, False, False] * 5:
        stats.observe(("rnn", 1), 0.8, accepted)
    assert stats.estimate(("rnn", 1), 0.8) == pytest.approx(0.8 * (2 + 5) / (2 + 16))


def test_earlier_statistics_become_a_prior_of_bounded_weight():
    earlier = AcceptanceStats()
    for accepted in [True, False, False, False] * 25:
        earlier.observe(("rnn", 1), 0.8, accepted)
    stats = earlier.as_prior(4.0)
    ratio = (2 + 25) / (2 + 80)  # the earlier ratio, its own prior included
    assert stats.estimate(("rnn", 1), 0.8) == pytest.approx(0.8 * ratio)
    assert stats.estimate(("rnn", 2), 0.8) == pytest.approx(0.8)  # not seen before: the default prior
    for _ in range(4):
        stats.observe(("rnn", 1), 1.0, True)
    # 4 of predicted mass weigh as much as all 80 earlier ones.
    assert stats.estimate(("rnn", 1), 0.5) == pytest.approx(0.5 * (ratio * 4 + 4) / (4 + 4))
    assert earlier.predicted[("rnn", 1)] == pytest.approx(80)  # the earlier statistics are left as they were


def test_a_copy_at_a_depth_not_seen_yet_starts_from_the_deepest_depth_seen():
    """A lookup right at depths 1 and 2 is expected right as often deeper,
    not at the default prior's half a node (a long copy would otherwise be
    verified a node deeper every few steps only). The kind of row, the
    matched length and the RNN each keep their own."""
    stats = AcceptanceStats()
    for depth in (1, 2):
        for _ in range(8):
            stats.observe(("lookup3", depth, "greedy"), 1.0, True)
    first = (0.5 * 2 + 8) / (2 + 8)  # the default prior, then 8 of 8
    seen = (first * 2 + 8) / (2 + 8)  # depth 2's prior was depth 1's ratio
    assert stats.estimate(("lookup3", 1, "greedy"), 1.0) == pytest.approx(first)
    assert stats.estimate(("lookup3", 2, "greedy"), 1.0) == pytest.approx(seen)
    assert stats.estimate(("lookup3", 5, "greedy"), 1.0) == pytest.approx(seen)
    stats.observe(("lookup3", 5, "greedy"), 1.0, False)  # its own observations then count, from that prior
    assert stats.estimate(("lookup3", 5, "greedy"), 1.0) == pytest.approx(seen * 2 / 3)
    assert stats.estimate(("lookup3", 4, "sampled"), 1.0) == pytest.approx(0.5)
    assert stats.estimate(("lookup2", 3, "greedy"), 1.0) == pytest.approx(0.5)
    for _ in range(8):
        stats.observe(("rnn", 1, "greedy"), 0.8, False)
    assert stats.estimate(("rnn", 2, "greedy"), 0.8) == pytest.approx(0.8)


def test_a_step_observes_the_children_of_accepted_nodes_only():
    stats = AcceptanceStats()
    tree = candidate_tree(
        1,
        [
            Draft([2, 3], [("rnn", 1), ("rnn", 2)], [0.5, 0.5], [0.5, 0.5]),
            Draft([4, 5], [("lookup1", 1), ("lookup1", 2)], [0.5, 0.5], [1.0, 1.0]),
        ],
    )
    # nodes: 0 root, 1 "2", 2 "3", 3 "4", 4 "5"; accepted path root -> "2".
    stats.observe_step([tree], [[0, 1, 2]], [1])
    assert stats.accepted[("rnn", 1)] == 1 and stats.predicted[("rnn", 1)] == 0.5
    assert stats.accepted[("rnn", 2)] == 0 and stats.predicted[("rnn", 2)] == 0.5
    assert stats.accepted[("lookup1", 1)] == 0 and stats.predicted[("lookup1", 1)] == 1.0
    assert ("lookup1", 2) not in stats.predicted  # its parent was rejected


def test_a_node_several_sources_proposed_is_observed_under_the_best_of_their_keys():
    """Agreeing sources make a node likelier than either alone; observed
    under both keys, those nodes would lift the ratio the weaker source's
    lone nodes are judged by. The node counts for the key whose estimate
    made it, the highest."""
    stats = AcceptanceStats()
    agreeing = candidate_tree(
        1, [Draft([2], [("datastore1", 1)], [0.3], [0.3]), Draft([2], [("lookup1", 1)], [0.5], [1.0])]
    )
    for _ in range(10):
        stats.observe_step([agreeing], [[0, 1]], [1])
    assert stats.predicted[("datastore1", 1)] == 0  # lookup's estimate (0.5) beat the datastore's (0.3 * 0.8)
    assert stats.accepted[("lookup1", 1)] == 10 and stats.predicted[("lookup1", 1)] == 10.0
    alone = candidate_tree(1, [Draft([2], [("datastore1", 1)], [0.3], [0.3])])
    stats.observe_step([alone], [[0]], [0])
    assert stats.accepted[("datastore1", 1)] == 0 and stats.predicted[("datastore1", 1)] == 0.3
