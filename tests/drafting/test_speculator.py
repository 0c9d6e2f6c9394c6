"""What a step verifies: lookup and RNN drafts merged, pruned by cost, and
the RNN turned off where it does not pay."""

import numpy as np
import pytest

from conftest import tiny_drafter
from redrafter_mlx.drafting.budget import AcceptanceStats
from redrafter_mlx.drafting.cost import CostCurve
from redrafter_mlx.drafting.policy import PLAIN_STEPS, RESHAPE_STEPS, WINDOW
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.drafting.speculator import CARRIED_WEIGHT, Beams, Speculator


def beams_for(root, drafted, probs):
    """One row's beams: (1, W, L) tokens and (1, W, L - 1) conditionals."""
    tokens = np.array([[[root] + list(d) for d in drafted]])
    return Beams(tokens, np.full(tokens[:, :, 1:].shape, probs, np.float32))


def tracking(settings, has_drafter, contexts):
    speculator = Speculator(settings, has_drafter)
    for row, context in enumerate(contexts):
        speculator.track(row, context)
    return speculator


def test_rnn_and_lookup_drafts_share_one_tree():
    context = [5, 6, 7, 8, 5, 6]
    speculator = tracking(DraftSettings(beam_width=2, beam_length=4, max_nodes=10, lookup_length=3), True, [context])
    (tree,) = speculator.trees([0], [6], beams_for(6, [[7, 8, 9], [1, 2, 3]], 0.5))
    # lookup proposes 7 8 5 (after the earlier 5 6), sharing "7 8" with the first beam.
    assert sorted(tree.tokens) == sorted([6, 7, 8, 9, 1, 2, 3, 5]) and tree.tokens[:3] == [6, 7, 8]
    assert {k[0] for k, _ in tree.judged[1]} == {"rnn", "lookup2"}


def test_fixed_budget_keeps_the_most_likely_nodes():
    speculator = tracking(DraftSettings(beam_width=2, beam_length=4, max_nodes=2, lookup=False), True, [[1, 2]])
    (tree,) = speculator.trees([0], [2], beams_for(2, [[7, 8, 9], [1, 2, 3]], 0.9))
    assert tree.tokens == [2, 7, 1]  # the two depth-1 nodes beat the deeper ones


def run_steps(speculator, root, beams, cost, accepted, steps=20, searched=None):
    """Steps whose trees all accept ``accepted`` drafted tokens (the first
    nodes after the root, whatever they hold). Returns the modes the steps
    ran in; ``searched`` (a list) is told, per step, whether the RNN's
    beams were there."""
    modes = []
    for _ in range(steps):
        with_rnn = speculator.use_rnn()
        if searched is not None:
            searched.append(with_rnn)
        plan = speculator.plan([0], [root], beams if with_rnn else None, cost=cost)
        modes.append(plan.mode)
        if plan.trees is not None:
            n = min(accepted, plan.trees[0].num_nodes - 1)
            speculator.observe(plan.trees, np.arange(n + 1)[None], np.array([n]))
    return modes


def test_the_rnn_is_turned_off_when_its_search_costs_more_than_it_brings_and_retried():
    """The beams could pay (two drafted tokens accepted in 2.5 s beat one in
    1 s), but the lookup's drafts alone bring as much without the search."""
    flat = CostCurve([1, 32], [1.0, 1.0], draft_seconds=1.5)
    context = [3, 4, 3, 4, 3]
    speculator = tracking(DraftSettings(beam_width=1, beam_length=3), True, [context])
    beams = beams_for(3, [[9, 9]], 0.9)
    assert run_steps(speculator, 3, beams, flat, accepted=2)[-1] == "lookup"
    assert not speculator.rnn.on
    searched = []
    run_steps(speculator, 3, beams, flat, accepted=2, steps=32, searched=searched)
    assert 1 <= searched.count(True) <= 3  # retried now and then

    cheap = CostCurve([1, 32], [1.0, 1.0], draft_seconds=0.0)
    speculator = tracking(DraftSettings(beam_width=1, beam_length=3), True, [[1, 2]])
    run_steps(speculator, 2, beams, cheap, accepted=2)
    assert speculator.rnn.on and speculator.use_rnn()


def test_a_search_that_can_never_pay_is_never_run():
    """A pass so cheap that the search alone costs more than a whole tree
    accepted could bring: the RNN never runs, from the first step on; and
    where no drafting can pay at all, the run is plain throughout."""
    costly = CostCurve([1, 32], [1.0, 1.0], draft_seconds=50.0)
    speculator = tracking(DraftSettings(beam_width=4, beam_length=5), True, [[3, 4, 3, 4, 3]])
    searched = []
    run_steps(speculator, 3, beams_for(3, [[9, 9, 9, 9]] * 4, 0.9), costly, accepted=2, steps=40, searched=searched)
    assert not any(searched[1:]) and not speculator.rnn.usable  # (the first step's beams came with the prefill)
    hopeless = CostCurve([1, 32], [1.0, 1.0], step_seconds=40.0, plain_seconds=1.0)
    speculator = tracking(DraftSettings(), False, [[3, 4, 3, 4, 3] * 10])
    modes = run_steps(speculator, 3, None, hopeless, accepted=16, steps=300)
    assert set(modes) == {"plain"} and speculator.never
    plans = [speculator.plan([0], [3], None, cost=hopeless) for _ in range(3)]
    assert all(p.ahead for p in plans)  # pipelined throughout


def test_the_rnn_is_turned_off_when_its_drafts_are_accepted_less_than_estimated():
    """The drafter claims 0.9 per token and the search is nearly free, so
    the estimates favour it; but nothing it drafts is accepted, while the
    lookup's drafts are: the measured rates turn it off."""
    cost = CostCurve([1, 32], [1.0, 1.0], draft_seconds=0.1)
    context = [3, 4, 3, 4, 3]
    speculator = tracking(DraftSettings(beam_width=1, beam_length=3), True, [context])
    beams = beams_for(3, [[9, 9]], 0.9)
    for _ in range(20):
        plan = speculator.plan([0], [3], beams if speculator.use_rnn() else None, cost=cost)
        if plan.trees is None:
            continue
        (tree,) = plan.trees
        accepted = [i for i, t in enumerate(tree.tokens) if i and t == 4][:1]  # the lookup's 4, never the RNN's 9
        speculator.observe([tree], np.array([[0] + accepted]), np.array([len(accepted)]))
    assert not speculator.rnn.on
    assert speculator.rnn.rate("lookup") > speculator.rnn.rate("rnn")


def test_a_retry_after_a_rest_drafts_with_the_rnn_again():
    """The RNN was turned off, then the cheap drafts stopped being accepted
    too, and the run rests. The plain step that ends the rest searches, and
    the retry verifies the RNN's beams: where the context changed, they may
    be what pays now (its retries are otherwise counted in drafting steps,
    which a resting run does not plan)."""
    cost = CostCurve([1, 32], [1.0, 1.0], draft_seconds=0.1)
    speculator = tracking(DraftSettings(beam_width=1, beam_length=3), True, [[3, 4, 3, 4, 3]])
    beams = beams_for(3, [[9, 9]], 0.9)
    speculator.rnn.on = False
    for _ in range(4 * WINDOW):
        if speculator.backoff.resting:
            break
        run_steps(speculator, 3, None, cost, accepted=0, steps=1)  # the cheap drafts, never accepted
    assert speculator.backoff.resting and not speculator.rnn.on
    searched = []
    rest = speculator.backoff.plain_left
    modes = run_steps(speculator, 3, beams, cost, accepted=2, steps=rest + 1, searched=searched)
    assert modes == ["plain"] * rest + ["rnn"] and searched == [False] * rest + [True]
    assert speculator.rnn.on


@pytest.mark.parametrize("estimates", ["high", "honest"])
def test_a_run_whose_drafts_are_not_accepted_turns_to_plain_decoding_and_retries_less_and_less(estimates):
    """Nothing drafted is accepted: whether the estimates fall or stay high
    (a source whose prior claims certainty), within a window of steps the
    run decodes plainly; it tries drafting again after 16 plain steps, then
    after twice as many each time a retry does not gain."""
    cost = CostCurve([1, 2, 32], [1.0, 1.05, 2.0])
    speculator = tracking(DraftSettings(), False, [[5, 6, 7, 5, 6, 7, 5, 6]])
    if estimates == "high":
        speculator.stats.priors = {("lookup2", d, "greedy"): (1.0, 1e9) for d in range(1, 20)}
    modes, intervals = [], []
    for _ in range(40):
        modes += run_steps(speculator, 6, None, cost, accepted=0, steps=10)
        if not intervals or intervals[-1] != speculator.backoff.interval:
            intervals.append(speculator.backoff.interval)
    first_plain = modes.index("plain")
    assert first_plain <= WINDOW
    assert intervals[:4] == [PLAIN_STEPS, 2 * PLAIN_STEPS, 4 * PLAIN_STEPS, 8 * PLAIN_STEPS]
    assert modes[first_plain:].count("plain") > 0.95 * len(modes[first_plain:])
    plan = speculator.plan([0], [6], None, cost=cost, ahead=True)
    assert plan.mode == "plain" and plan.trees is None


def test_a_run_that_gains_on_average_is_not_turned_plain_by_a_stretch_that_does_not():
    """A step's accepted length varies widely: stretches of a dozen steps
    that accept nothing, between stretches that accept three tokens a step,
    gain 2.5 tokens a step on average, far above plain decoding's one. The
    run keeps drafting through the bad stretches."""
    cost = CostCurve([1, 2, 32], [1.0, 1.05, 2.0])
    speculator = tracking(DraftSettings(), False, [[5, 6, 7, 5, 6, 7, 5, 6]])
    speculator.stats.priors = {("lookup2", d, "greedy"): (1.0, 1e9) for d in range(1, 20)}  # estimates stay put
    modes = []
    for _ in range(4):
        modes += run_steps(speculator, 6, None, cost, accepted=3, steps=12)
        modes += run_steps(speculator, 6, None, cost, accepted=0, steps=12)
    assert "plain" not in modes


def test_a_run_starts_from_what_earlier_runs_accepted():
    """A drafter that claims 0.9 per token and is never right: a first run
    learns it; the next run of the same pair verifies nothing from its first
    step on, where a run without that history still verifies its beams."""
    cost = CostCurve([1, 2, 32], [1.0, 1.5, 3.0])
    beams = beams_for(3, [[9, 9]], 0.9)
    history = AcceptanceStats()
    # A fixed budget, so that every step verifies the beams (with a budget the run soon decodes plainly).
    run_steps(
        Speculator(DraftSettings(beam_width=1, beam_length=3, lookup=False, max_nodes=2), True, history),
        3,
        beams,
        None,
        accepted=0,
    )
    assert history.predicted[("rnn", 1, "greedy")] > 0 and history.accepted[("rnn", 1, "greedy")] == 0

    def first_plan(history):
        speculator = Speculator(DraftSettings(beam_width=1, beam_length=3, lookup=False), True, history)
        return speculator.plan([0], [3], beams, cost=cost)

    assert first_plan(None).trees[0].num_nodes > 1
    assert first_plan(history).mode == "plain"


def test_a_retry_verifies_a_small_tree_where_earlier_runs_make_every_tree_look_dear():
    """Earlier runs of the drafter were never right, so a new prompt's
    budget keeps no node and the run rests. Its retries still verify a
    small tree each: this prompt's drafts are right, and once that is seen
    the run drafts on (an empty retry would learn nothing, and the run
    would stay plain for good)."""
    cost = CostCurve([1, 2, 32], [1.0, 1.5, 3.0])
    beams = beams_for(3, [[9, 9]], 0.9)
    history = AcceptanceStats()
    earlier = Speculator(DraftSettings(beam_width=1, beam_length=3, lookup=False, max_nodes=2), True, history)
    run_steps(earlier, 3, beams, None, accepted=0)
    speculator = tracking(DraftSettings(beam_width=1, beam_length=3, lookup=False), True, [[1, 2, 3]])
    speculator.stats = history.as_prior(CARRIED_WEIGHT)
    modes = run_steps(speculator, 3, beams, cost, accepted=2, steps=6 * PLAIN_STEPS)
    assert modes[:PLAIN_STEPS] == ["plain"] * PLAIN_STEPS
    assert modes[-PLAIN_STEPS:] == ["rnn"] * PLAIN_STEPS


def test_without_a_drafter_only_lookup_drafts():
    speculator = tracking(DraftSettings(max_nodes=4), False, [[1, 2, 3, 1, 2]])
    assert not speculator.use_rnn()
    (tree,) = speculator.trees([0], [2])
    assert tree.tokens == [2, 3, 1, 2]


@pytest.mark.parametrize("lookup_length", [1, 2, 5])
def test_lookup_drafts_its_own_length_whatever_the_beams(lookup_length):
    # After the earlier "1 2", the context went on 3 4 5 6 1 2.
    speculator = tracking(
        DraftSettings(beam_width=1, beam_length=3, max_nodes=10, lookup_length=lookup_length),
        True,
        [[1, 2, 3, 4, 5, 6, 1, 2]],
    )
    (tree,) = speculator.trees([0], [2], beams_for(2, [[9, 9]], 0.5))
    assert tree.tokens == [2, 9, 9] + [3, 4, 5, 6, 1][:lookup_length]
    assert max(tree.depths) == max(2, lookup_length)


def test_later_vocab_applies_only_to_a_sorted_draft_vocabulary():
    drafter = tiny_drafter(draft_vocab=32)
    settings = DraftSettings(beam_width=3, beam_length=4, later_vocab=8)
    assert settings.search_shape(drafter) == (3, 4, None, True, None)  # rows in no known order: all are searched
    drafter.args.sorted_draft_vocab = True
    assert settings.search_shape(drafter) == (3, 4, 8, True, 2048)


def test_the_search_drafts_as_deep_as_the_budget_keeps_its_nodes():
    """After a few searches of the whole length whose trees kept RNN nodes
    at depths 1 and 2 only, searches stop at depth 2 (length 3), but every
    ``RESHAPE_STEPS``-th search runs the whole length again."""
    speculator = tracking(DraftSettings(beam_width=2, beam_length=5, max_nodes=4, lookup=False), True, [[1, 2]])
    beams = beams_for(2, [[7, 8, 9, 10], [11, 12, 13, 14]], 0.9)
    lengths = []
    for _ in range(2 * RESHAPE_STEPS):
        plan = speculator.plan([0], [2], beams)
        lengths.append(plan.search_length)
        assert max(plan.trees[0].depths) <= 2  # 4 nodes: both beams' first two tokens
    assert lengths[:3] == [5] * 3 and set(lengths[3:]) == {3, 5}  # shortened once four full searches are seen
    assert [i for i, n in enumerate(lengths) if n == 5][3:] == [
        i for i in range(3, len(lengths)) if i % RESHAPE_STEPS == 0
    ]


def test_a_prompt_joining_starts_the_backoff_over():
    cost = CostCurve([1, 2, 32], [1.0, 1.05, 2.0])
    speculator = tracking(DraftSettings(), False, [[5, 6, 7, 5, 6, 7, 5, 6]])
    for _ in range(20):
        run_steps(speculator, 6, None, cost, accepted=0, steps=10)
    assert speculator.backoff.interval > 4 * PLAIN_STEPS and speculator.backoff.plain_left
    speculator.track(1, [1, 2, 3])
    assert (
        speculator.backoff.interval == PLAIN_STEPS and speculator.backoff.plain_left == 0 and speculator.mode != "plain"
    )


def test_a_plan_is_made_once_and_trees_change_nothing():
    """``trees`` only looks: the RNN switch (its steps off, its estimate
    of lookup alone) moves when a step is planned, and the plan handed out
    cannot be changed after."""
    import dataclasses

    cost = CostCurve([1, 32], [1.0, 1.0], draft_seconds=1.5)
    speculator = tracking(DraftSettings(beam_width=1, beam_length=3), True, [[3, 4, 3, 4, 3]])
    beams = beams_for(3, [[9, 9]], 0.9)
    speculator.rnn.on = False
    before = (speculator.rnn.steps_off, speculator.rnn.lookup_estimate, speculator.steps)
    speculator.trees([0], [3], beams, cost)
    assert (speculator.rnn.steps_off, speculator.rnn.lookup_estimate, speculator.steps) == before
    plan = speculator.plan([0], [3], beams, cost=cost)
    assert speculator.rnn.steps_off == 1 and speculator.rnn.lookup_estimate is not None and speculator.last is plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.ahead = True


def test_prompts_joining_search_as_the_batch_does():
    """A fresh batch searches the whole beam length when the RNN drafts;
    prompts joining a running batch search as long as its beams, or not at
    all when it has none. Joining starts the back-off over."""
    speculator = Speculator(DraftSettings(beam_width=2, beam_length=5), True)
    first = speculator.plan_join([0], [[1, 2]], [False])
    assert (first.search, first.search_length) == (True, 5) and speculator.contexts == {0: [1, 2]}
    speculator.backoff.plain_left = 3
    joining = speculator.plan_join([1], [[3, 4]], [True], running=True, beams=beams_for(4, [[5, 6]], 0.5))
    assert (joining.search, joining.search_length) == (True, 3) and speculator.kinds[1] == "sampled"
    assert not speculator.backoff.resting
    assert not speculator.plan_join([2], [[5]], [False], running=True, beams=None).search
