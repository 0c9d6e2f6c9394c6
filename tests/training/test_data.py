"""Training data: positions, the hidden-state cache and its batches of
sequences, rows of several folders read as one."""

import mlx.core as mx
import numpy as np
import pytest
from training_setup import synthetic_setup

from conftest import HIDDEN, tiny_model
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.training.data import StackedRows, compute_hidden_cache, length_batches
from redrafter_mlx.training.distill import DataFolder


def test_stacked_rows_gather_like_the_concatenated_array():
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(n, 3)).astype(np.float16) for n in (5, 1, 7)]
    stacked = StackedRows(parts)
    rows = rng.permutation(13)[:9]
    assert len(stacked) == 13
    np.testing.assert_array_equal(stacked[rows], np.concatenate(parts)[rows])


def test_length_batches_cover_every_sequence_once_within_the_budget():
    lengths = np.array([5, 40, 12, 12, 3, 100, 7, 30])
    groups = length_batches(lengths, 36)
    assert sorted(np.concatenate(groups).tolist()) == list(range(8))
    assert [lengths[g].tolist() for g in groups] == [[3, 5, 7], [12, 12], [30], [40], [100]]
    for g in groups:  # longest times size within the budget, or one sequence alone
        assert len(g) == 1 or lengths[g].max() * len(g) <= 36


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return synthetic_setup(tmp_path_factory.mktemp("train") / "data")


def test_hidden_cache_matches_the_base_model(setup):
    """Every sequence, in order (the cache was computed in batches made in
    order of length, which is not the sequences' order)."""
    base, sequences, hidden = setup
    assert (np.diff(sequences.lengths) < 0).any()
    row = 0
    for i in range(len(sequences)):
        sequence, p = sequences.sequence(i), int(sequences.prompt_lengths[i])
        direct = np.array(base.backbone(mx.array([sequence.tolist()]))[0])
        np.testing.assert_allclose(
            hidden[row : row + len(sequence) - p], direct[p - 1 : len(sequence) - 1], atol=2e-2, rtol=1e-2
        )
        row += len(sequence) - p
    assert row == len(hidden)


def test_hidden_states_saved_by_distill_equal_recomputed_ones(tmp_path):
    from redrafter_mlx.engine.sampling import SamplingSettings
    from redrafter_mlx.training.distill import distill, response_stream

    base = BaseModel(tiny_model("llama", seed=6))
    prompts = ["abc", "hello world", "x", "a longer prompt here"]
    folder = DataFolder(str(tmp_path / "d"))
    tokenize = lambda text: [ord(c) % 256 for c in text]
    distill(
        base,
        tokenize,
        prompts,
        folder,
        {},
        response_stream(base, 12, SamplingSettings(), [7]),
        3,
        shard_size=2,
        progress=False,
    )
    assert len(list(folder.path.glob("hidden-*.npy"))) == 2
    sequences = folder.load()
    saved = np.array(compute_hidden_cache(base, folder, sequences, progress=False))
    for f in list(folder.path.glob("hidden*")):
        f.unlink()
    recomputed = np.array(compute_hidden_cache(base, folder, sequences, progress=False))
    assert saved.shape == recomputed.shape == (int((sequences.lengths - sequences.prompt_lengths).sum()), HIDDEN)
    np.testing.assert_allclose(saved, recomputed, atol=1e-2, rtol=1e-2)
