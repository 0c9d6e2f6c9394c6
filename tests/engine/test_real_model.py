"""ReDrafter on the real default model: SmolLM2-135M-Instruct, float32."""

import mlx.core as mx
import pytest

from conftest import OracleDrafter, mlx_lm_greedy, run
from redrafter_mlx.drafting.drafter import Drafter, DrafterArgs
from redrafter_mlx.engine.autoregressive import autoregressive_steps
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.sampling import SamplingSettings, make_chooser
from redrafter_mlx.engine.types import ReDrafter
from redrafter_mlx.loading.loader import load_base_model

NUM_TOKENS = 64


COPY_REQUEST = "Repeat this sentence exactly, twice: The old lighthouse keeper counted seven ships sailing past the northern cliffs at dawn."


def chat_ids(tokenizer, message):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(prompt, add_special_tokens=False)


@pytest.fixture(scope="module")
def smol_model():
    model, tokenizer = load_base_model(None, dtype="float32")
    return BaseModel(model), tokenizer


@pytest.fixture(scope="module")
def smol(smol_model):
    base, tokenizer = smol_model
    ids = chat_ids(tokenizer, "Explain what a binary search does.")
    return base, ids, mlx_lm_greedy(base.model, ids, NUM_TOKENS + 8)


@pytest.mark.parametrize("shape", [(1, 2), (4, 4), (8, 5)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_greedy_parity_with_random_drafter(smol, shape):
    base, ids, reference = smol
    mx.random.seed(shape[0])
    drafter = Drafter(DrafterArgs(vocab_size=base.vocab_size, hidden_size=base.hidden_size, exit_dim=64))
    (tokens,), _ = run(
        ReDrafter(base, drafter), [ids], max_tokens=NUM_TOKENS, beam_width=shape[0], beam_length=shape[1]
    )
    assert tokens == reference[:NUM_TOKENS]


def test_greedy_parity_with_partly_right_drafter(smol):
    base, ids, reference = smol
    drafter = OracleDrafter(base, [ids + reference], corrupt=5)
    (tokens,), accepted = run(ReDrafter(base, drafter), [ids], max_tokens=NUM_TOKENS, beam_width=4, beam_length=5)
    assert tokens == reference[:NUM_TOKENS]
    assert len(set(accepted)) > 2


@pytest.mark.parametrize("temp", [0.0, 0.5], ids=["greedy", "sampled"])
def test_long_lookup_continuations_keep_the_output(smol_model, temp):
    """Lookup continuations of 12 tokens, every node verified, on an answer
    that copies its prompt: steps accept more than the beams' 4 tokens,
    and the output is plain decoding's (seeded sampling draws the same
    tokens)."""
    base, tokenizer = smol_model
    ids = chat_ids(tokenizer, COPY_REQUEST)
    choose = make_chooser(SamplingSettings(temp=temp, seed=3))
    plain = [
        token
        for step in autoregressive_steps(base, [ids], max_tokens=NUM_TOKENS, choose=choose)
        for out in step
        for token in out.tokens
    ]
    (tokens,), accepted = run(
        ReDrafter(base, None), [ids], max_tokens=NUM_TOKENS, choose=choose, lookup_length=12, max_nodes=12
    )
    assert tokens == plain
    assert max(accepted) > 4
