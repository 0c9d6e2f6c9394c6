"""The base model seen as tokens -> (hidden, logits)."""

import mlx.core as mx
import numpy as np
import pytest

from conftest import HIDDEN, tiny_model
from redrafter_mlx.engine.base_model import BaseModel


@pytest.mark.parametrize("kind, quantize", [("llama", False), ("llama", True), ("qwen2", False)])
def test_head_rows_give_the_logits_of_those_tokens(kind, quantize):
    base = BaseModel(tiny_model(kind, seed=1, quantize=quantize))
    hidden = mx.random.normal((3, HIDDEN), key=mx.random.key(2))
    ids = mx.array([5, 17, 200])
    np.testing.assert_allclose(np.array(hidden @ base.head_rows(ids).T), np.array(base.head(hidden)[:, ids]), atol=1e-5)
