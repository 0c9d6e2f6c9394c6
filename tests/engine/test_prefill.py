"""Prefill in chunks: on the CPU a chunk shrinks as the context grows, so
that attention's scores stay bounded, and the prompt's keys, values and
first logits are those of a prefill in mlx-lm's chunks."""

import mlx.core as mx
import numpy as np

from conftest import tiny_model
from redrafter_mlx.engine import prefill as prefill_module
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.prefill import MIN_CHUNK, PREFILL_STEP_SIZE, SCORES_BYTES, Prefill, chunk_size


def test_a_chunk_halves_while_its_scores_would_pass_the_bound_and_never_below_the_least():
    assert mx.default_device() == mx.cpu  # where the bound applies (the tests run on the CPU)
    # The default model (9 query heads).
    assert chunk_size(PREFILL_STEP_SIZE, 1, 9, 0) == 512
    assert 9 * 512 * 512 * 4 <= SCORES_BYTES < 9 * 1024 * 1024 * 4
    assert chunk_size(PREFILL_STEP_SIZE, 1, 9, 1_100) == 512
    assert chunk_size(PREFILL_STEP_SIZE, 1, 9, 4_000) == 128
    assert chunk_size(PREFILL_STEP_SIZE, 1, 9, 30_000) == MIN_CHUNK  # bounded below: the scores go over
    assert chunk_size(PREFILL_STEP_SIZE, 4, 9, 1_100) == 128  # rows fed together count
    assert chunk_size(64, 1, 9, 30_000) == 64  # a step below the least is kept
    assert chunk_size(PREFILL_STEP_SIZE, 1, 1, 0) == PREFILL_STEP_SIZE


def test_shrinking_chunks_give_the_same_prompt_state_in_less_memory(monkeypatch):
    base = BaseModel(tiny_model("llama", seed=3))
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, 200, size=1_500)]
    fed = []
    backbone = base.backbone

    def counted(tokens, cache):
        fed.append(tokens.shape[1])
        return backbone(tokens, cache=cache)

    def run(scores_bytes):
        monkeypatch.setattr(prefill_module, "SCORES_BYTES", scores_bytes)
        monkeypatch.setattr(base, "backbone", counted)
        fed.clear()
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        layout, cache, hidden, logits = Prefill(base, [prompt]).finish()
        mx.eval(hidden, logits, [c.state_arrays() for c in cache])
        return list(fed), mx.get_peak_memory() - before, layout, cache, hidden, logits

    chunks, peak, layout, cache, hidden, logits = run(1 << 40)  # no bound: mlx-lm's chunks
    assert chunks == [1_499, 1]  # then the last token alone
    small, small_peak, small_layout, small_cache, small_hidden, small_logits = run(4 * 1_500 * 400 * 4)
    # 4 query heads: 512 while the context is short, then 256, then the rest.
    assert small == [512, 512, 256, 219, 1]
    assert int(small_layout.lengths[0]) == int(layout.lengths[0]) == 1_500
    assert np.allclose(np.array(small_logits), np.array(logits), atol=1e-4)
    assert np.allclose(np.array(small_hidden), np.array(hidden), atol=1e-4)
    for whole, chunked in zip(cache, small_cache):
        assert np.allclose(np.array(chunked.keys[..., :1_500, :]), np.array(whole.keys[..., :1_500, :]), atol=1e-4)
    # One layer's scores in one chunk: 4 x 1,499 x 1,499 float32s (36 MB), against at most 2.4 MB.
    assert small_peak < peak / 3, (small_peak, peak)
