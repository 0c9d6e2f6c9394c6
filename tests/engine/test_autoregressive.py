"""The batched autoregressive loop: parity with mlx-lm, with rows leaving
and waiting prompts joining the batch."""

import mlx.core as mx
import numpy as np
import pytest

from conftest import mlx_lm_greedy, tiny_model
from redrafter_mlx.engine.autoregressive import autoregressive_steps
from redrafter_mlx.engine.base_model import BaseModel


def expected(reference, eos):
    for i, token in enumerate(reference):
        if token in eos:
            return reference[:i]
    return reference


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen3_next", "nemotron_h"])
@pytest.mark.parametrize("max_batch", [None, 1, 4, 5])
def test_batched_greedy_equals_mlx_lm_per_prompt(kind, max_batch, monkeypatch):
    base = BaseModel(tiny_model(kind, seed=1))
    layouts = []
    make_cache = BaseModel.make_cache
    monkeypatch.setattr(BaseModel, "make_cache", lambda self, pad: layouts.append(make_cache(self, pad)) or layouts[-1])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=rng.integers(1, 30)).tolist() for _ in range(11)]
    references = [mlx_lm_greedy(base.model, p, 30) for p in prompts]
    eos = [references[0][5], references[3][2]]
    outputs, hidden = [[] for _ in prompts], [[] for _ in prompts]
    for step in autoregressive_steps(
        base, prompts, max_tokens=30, max_batch=max_batch, eos_token_ids=eos, with_hidden=True
    ):
        assert max_batch is None or len(step) <= max_batch
        for out in step:
            outputs[out.row] += out.tokens
            hidden[out.row].append(out.hidden)
    assert outputs == [expected(r, eos) for r in references]
    # Padding shared by all rows is dropped as rows leave: the batch never
    # grows longer than its longest prompt plus max_tokens.
    assert layouts[0][0].start <= max(len(p) for p in prompts) + 30
    assert len({len(o) for o in outputs}) > 2  # rows really finish at different times
    # The hidden state each token was chosen from is the model's own.
    row = 2
    direct = base.backbone(mx.array([prompts[row] + outputs[row]]))[0]
    saved = np.concatenate(hidden[row])
    start = len(prompts[row]) - 1
    np.testing.assert_allclose(saved, np.array(direct[start : start + len(outputs[row])]), atol=1e-2, rtol=1e-2)
