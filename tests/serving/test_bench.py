"""The benchmark's configurations, and its runs: sampled baselines emit
what ReDrafter emits, so the two are timed on the same text."""

import numpy as np
import pytest

from conftest import tiny_redrafter
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.engine.sampling import SamplingSettings, make_chooser
from redrafter_mlx.errors import UserError
from redrafter_mlx.serving.bench import Config, ConfigResult, baseline_run, parse_configs, redrafter_run


def test_sampled_mlx_lm_baseline_emits_the_seeded_redrafter_tokens():
    redrafter = tiny_redrafter(seed=2)
    rng = np.random.default_rng(3)
    config = Config("auto", DraftSettings())
    for seed in range(3):
        prompt = rng.integers(0, 256, size=12).tolist()
        choose = make_chooser(SamplingSettings(temp=1.0, top_p=0.9, seed=seed))
        baseline = baseline_run(redrafter, [prompt], 24, choose, [])  # mlx-lm's loop at batch 1
        ours = redrafter_run(redrafter, [prompt], 24, choose, [], config)
        assert ours.tokens == baseline.tokens and len(baseline.tokens[0]) == 24
    other = baseline_run(redrafter, [prompt], 24, make_chooser(SamplingSettings(temp=1.0, top_p=0.9, seed=99)), [])
    assert other.tokens != baseline.tokens  # the draws depend on the seed: the equality above is not vacuous


def test_a_batch_counts_once_by_the_median_of_its_repeats_and_keeps_its_step_counts():
    counts = {0: [30, 75, 150, 75], 1: [60, 90, 240, 96]}  # steps, step tokens, nodes, tokens over 3 repeats
    result = ConfigResult(
        "auto",
        redrafter_tps=[1.0],
        baseline_tps=[1.0],
        speedups={0: [1.0, 2.0, 3.0], 1: [0.5, 0.6, 10.0]},
        counts=counts,
    )
    summary = result.summary()
    assert summary["speedups"] == [2.0, 0.6]
    assert (summary["speedup_min"], summary["speedup_max"]) == (0.6, 2.0)  # not the single runs' 0.5 and 10
    assert summary["speedup_median"] == 1.3
    assert summary["per_batch"] == [
        {"tokens_per_step": 2.5, "nodes_per_step": 5.0, "tokens": 25.0},
        {"tokens_per_step": 1.5, "nodes_per_step": 4.0, "tokens": 32.0},
    ]
    assert (summary["tokens_per_step"], summary["nodes_per_step"]) == (165 / 90, 390 / 90)


def test_configurations_differ_only_where_their_names_say():
    auto, lookup, rnn, both = parse_configs("auto, lookup, rnn:4x5, both:2x3")
    assert auto.draft == lookup.draft == DraftSettings()  # lookup runs the defaults without a drafter
    assert rnn.draft == DraftSettings(
        4, 5, max_nodes=16, lookup=False, datastore_beams=0, later_vocab=None, partial_beams=False, first_vocab=None
    )
    assert both.draft == DraftSettings(
        2,
        3,
        max_nodes=6,
        lookup=True,
        lookup_length=2,
        datastore_beams=0,
        later_vocab=None,
        partial_beams=False,
        first_vocab=None,
    )
    for retired in ("final", "nostore", "lookuplen:4"):
        with pytest.raises(UserError, match="unknown bench configuration"):
            parse_configs(retired)
