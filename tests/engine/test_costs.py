"""The cost curve kept true by the steps: per context and kind of step, what
they really cost over what the measured curve says."""

import pytest

from conftest import CPU_CURVE, mlx_lm_greedy, tiny_model
from redrafter_mlx.drafting.cost import CostCurve
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.engine import costs
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.costs import PLAIN, Learned, StepCosts, node_kind, widened
from redrafter_mlx.engine.decoder import Decoder
from redrafter_mlx.engine.types import ReDrafter


def test_a_ratio_not_seen_is_its_contexts_nearest_kinds_then_a_shorter_contexts():
    learned = Learned()
    assert learned.ratio(100, node_kind(4)) == 1.0  # nothing seen
    learned.add(3000, node_kind(8), 3.0)
    learned.add(3000, PLAIN, 1.5)
    assert learned.ratio(3000, node_kind(8)) == pytest.approx(3.0) and learned.ratio(2500, PLAIN) == pytest.approx(
        1.5
    )  # one bucket
    assert learned.ratio(3000, node_kind(16)) == pytest.approx(3.0)  # the nearest kind seen
    assert learned.ratio(3000, node_kind(1)) == pytest.approx(1.5)
    assert learned.ratio(20000, node_kind(8)) == pytest.approx(3.0)  # a longer context: the nearest shorter one's
    assert learned.ratio(1000, node_kind(8)) == 1.0  # a shorter one learns nothing from a longer one
    learned.add(3000, node_kind(8), 1.0)
    assert 1.0 < learned.ratio(3000, node_kind(8)) < 3.0  # a running ratio
    learned.add(3000, node_kind(8), 1000.0)
    assert learned.ratio(3000, node_kind(8)) < 10.0  # a pause of the process is not the machine


def test_one_odd_step_moves_a_price_by_a_bounded_factor_and_steady_steps_reach_theirs():
    learned = Learned()
    learned.add(7000, PLAIN, 1.0)
    learned.add(7000, PLAIN, 0.13)  # a pipelined token whose pass ran while the step before it waited
    assert learned.ratio(7000, PLAIN) > 0.85
    for _ in range(12):  # the machine did get faster
        learned.add(7000, PLAIN, 0.5)
    assert learned.ratio(7000, PLAIN) == pytest.approx(0.5, rel=0.05)


def test_steps_faster_than_the_curve_never_make_a_pass_free():
    curve = CostCurve([1, 2, 4], [0.001, 0.0012, 0.0015], 0.0005, 0.002, 0.001)  # a fixed cost larger than a pass
    learned = Learned()
    learned.add(100, node_kind(2), 0.4)
    faster = costs.corrected(curve, learned, 100)
    assert faster(2) == pytest.approx(0.4 * 0.0012) and all(s > 0 for s in faster.seconds)


def test_steps_correct_the_curve_where_they_run_and_only_there(monkeypatch):
    monkeypatch.setattr(costs, "learning", lambda redrafter: True)
    monkeypatch.setattr(costs, "LEARNED", {})
    redrafter = ReDrafter(BaseModel(tiny_model()), None, identity="learns")
    step_costs = StepCosts(redrafter)
    short, long = step_costs.curve(1, 100), step_costs.curve(1, 5000)
    assert short.seconds == CPU_CURVE.seconds  # nothing learned yet: the measured curve
    for _ in range(10):  # at 5000 tokens, trees of 8 cost twice the curve's; plain tokens as it says
        step_costs.observe(1, 5000, 8, 2 * long(8))
        step_costs.observe_plain(1, 5000, long.plain)
    learned = step_costs.curve(1, 5000)
    assert learned(8) == pytest.approx(2 * long(8), rel=0.05) and learned.plain == pytest.approx(long.plain)
    assert learned(1) == pytest.approx(long(1), rel=0.05)  # its own kind, as the plain step's (the nearest seen)
    assert step_costs.curve(1, 100).seconds == short.seconds  # a short context keeps its curve
    assert StepCosts(redrafter).curve(1, 5000)(8) == pytest.approx(learned(8))  # kept for the process
    # A batch size never measured starts from one row's curve: a pass of B rows as one of B times the nodes.
    four = widened(CPU_CURVE, 4)
    assert four(2) == pytest.approx(CPU_CURVE(8)) and four.draft_seconds == pytest.approx(4 * CPU_CURVE.draft_seconds)


def test_a_decoder_whose_trees_prove_dear_at_its_context_decodes_plainly(monkeypatch):
    """Context lookup would draft the repeats on the measured curve; once
    steps have shown that trees cost ten times what it says at this context
    (and plain tokens what it says), the same prompt decodes plainly, with
    the same tokens."""
    monkeypatch.setattr(costs, "learning", lambda redrafter: True)
    monkeypatch.setattr(costs, "LEARNED", {})
    model = tiny_model()
    redrafter = ReDrafter(BaseModel(model), None, identity="dear-trees")
    prompt = ([5, 6, 7, 8] * 80)[:300]
    curve = CostCurve([1, 2, 4, 8, 16], [1.0, 1.01, 1.02, 1.03, 1.05], plain_seconds=1.0)
    monkeypatch.setattr(costs.calibrate, "cost_curve", lambda *args, **kwargs: curve)
    monkeypatch.setattr(costs.calibrate, "stored_curve", lambda *args, **kwargs: None)

    def run() -> tuple:
        decoder = Decoder(redrafter, DraftSettings())
        monkeypatch.setattr(decoder.costs, "observe", lambda *args, **kwargs: None)  # this run's own clock aside
        monkeypatch.setattr(decoder.costs, "observe_plain", lambda *args, **kwargs: None)
        outputs, tokens, drafted = decoder.join([prompt], 24), [], False
        while outputs:
            tokens += [t for out in outputs for t in out.tokens]
            drafted |= any((out.num_nodes or 1) > 1 for out in outputs)
            outputs = decoder.step()
        return tokens, drafted

    assert run() == (mlx_lm_greedy(model, prompt, 24), True)
    learned = StepCosts(redrafter)
    for _ in range(5):
        learned.observe_plain(1, len(prompt), curve.plain)  # plain tokens cost what the curve says
        for nodes in (2, 4, 8, 16):
            learned.observe(1, len(prompt), nodes, 10 * curve(nodes))
    assert run() == (mlx_lm_greedy(model, prompt, 24), False)


def test_where_trees_are_a_guess_a_small_tree_is_tried_and_what_it_shows_is_used(monkeypatch):
    """Past the measured contexts, a curve that makes every tree look dear
    decodes plainly, and no tree would ever run to show otherwise: one step
    in PROBE_STEPS verifies a small tree; once it showed trees cheap there,
    the run drafts (the steps' seconds here are made up, as that)."""
    from redrafter_mlx.drafting.speculator import PROBE_NODES, PROBE_STEPS

    monkeypatch.setattr(costs, "learning", lambda redrafter: True)
    monkeypatch.setattr(costs, "LEARNED", {})
    model = tiny_model()
    redrafter = ReDrafter(BaseModel(model), None, identity="a-guess")
    prompt = ([5, 6, 7, 8] * 200)[:700]
    dear = CostCurve(
        [1, 2, 4, 8, 16],
        [1.0, 1.01, 1.02, 1.03, 1.05],
        plain_seconds=1.0,
        long_context=512,
        long_sizes=[1, 2, 16],
        long_seconds=[1.0, 3.0, 6.0],
    )
    monkeypatch.setattr(costs.calibrate, "cost_curve", lambda *args, **kwargs: dear)
    monkeypatch.setattr(costs.calibrate, "stored_curve", lambda *args, **kwargs: None)
    decoder = Decoder(redrafter, DraftSettings())
    observe = decoder.costs.observe
    monkeypatch.setattr(
        decoder.costs,
        "observe",
        lambda batch, context, nodes, seconds, searched=False: observe(batch, context, nodes, 1.0 + 0.01 * nodes),
    )
    observe_plain = decoder.costs.observe_plain
    monkeypatch.setattr(
        decoder.costs, "observe_plain", lambda batch, context, seconds: observe_plain(batch, context, 1.0)
    )
    assert decoder.costs.curve(1, 700).guessed
    outputs, tokens, nodes = decoder.join([prompt], 96), [], []
    while outputs:
        tokens += [t for out in outputs for t in out.tokens]
        nodes += [out.num_nodes for out in outputs if out.num_nodes is not None]
        outputs = decoder.step()
    assert tokens == mlx_lm_greedy(model, prompt, 96)
    first = next(i for i, n in enumerate(nodes) if n > 1)
    assert first >= PROBE_STEPS - 2 and nodes[first] <= PROBE_NODES + 1  # plain until the probe, a small tree
    assert sum(n > 1 for n in nodes[first + 1 :]) > 3 and not decoder.costs.curve(1, 700).guessed  # then it drafts
