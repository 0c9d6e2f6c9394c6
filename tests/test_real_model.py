"""ReDrafter on the real default model: SmolLM2-135M-Instruct, float32."""

import mlx.core as mx
import pytest
from conftest import OracleDrafter
from test_generate import mlx_lm_greedy, run

from redrafter_mlx.base_model import BaseModel
from redrafter_mlx.drafter import Drafter, DrafterArgs
from redrafter_mlx.generate import ReDrafter
from redrafter_mlx.loading import load_base_model

NUM_TOKENS = 64


@pytest.fixture(scope="module")
def smol():
    model, tokenizer = load_base_model(None, dtype="float32")
    base = BaseModel(model)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain what a binary search does."}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return base, ids, mlx_lm_greedy(base.model, ids, NUM_TOKENS + 8)


@pytest.mark.parametrize("shape", [(1, 2), (4, 4), (8, 5)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_greedy_parity_with_random_drafter(smol, shape):
    base, ids, reference = smol
    mx.random.seed(shape[0])
    drafter = Drafter(DrafterArgs(vocab_size=base.vocab_size, hidden_size=base.hidden_size, exit_dim=64))
    (tokens,), _ = run(ReDrafter(base, drafter), [ids], max_tokens=NUM_TOKENS, beam_width=shape[0], beam_length=shape[1])
    assert tokens == reference[:NUM_TOKENS]


def test_greedy_parity_with_partly_right_drafter(smol):
    base, ids, reference = smol
    drafter = OracleDrafter(base, [ids + reference], corrupt=5)
    (tokens,), accepted = run(ReDrafter(base, drafter), [ids], max_tokens=NUM_TOKENS, beam_width=4, beam_length=5)
    assert tokens == reference[:NUM_TOKENS]
    assert len(set(accepted)) > 2


