"""Hybrid models (Gated DeltaNet, Mamba2 and short-convolution layers beside
attention) and mixtures of experts: greedy parity with mlx-lm's own loop
while drafting, alone and in batches, with rows joining; chains for the
hybrids; unsupported layers are one clear error; the command line runs
them from mlx-lm folders."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

from conftest import (
    EXPERTS,
    HYBRIDS,
    OracleDrafter,
    mlx_lm_greedy,
    run,
    run_cli,
    save_word_tokenizer,
    tiny_drafter,
    tiny_model,
)
from redrafter_mlx.drafting import tree as tree_module
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.engine import calibrate
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.decoder import Decoder
from redrafter_mlx.engine.recurrent import RecurrentCache
from redrafter_mlx.engine.types import ReDrafter
from redrafter_mlx.errors import UserError

NUM_TOKENS = 64
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 18], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module", params=HYBRIDS + EXPERTS)
def hybrid(request):
    """(base, mlx-lm's greedy continuation of each prompt)."""
    model = tiny_model(request.param, seed=1)
    return BaseModel(model), [mlx_lm_greedy(model, p, NUM_TOKENS) for p in PROMPTS]


def oracle(base, references, corrupt=4):
    return OracleDrafter(base, [p + r for p, r in zip(PROMPTS, references)], corrupt=corrupt)


@pytest.mark.parametrize("nodes", [4, 16])
def test_greedy_parity_with_a_partly_right_drafter_and_lookup(hybrid, nodes):
    """Drafts right to a varying depth: every length of accepted prefix
    is committed, wholly accepted chains included."""
    base, references = hybrid
    (tokens,), accepted = run(
        ReDrafter(base, oracle(base, references)),
        PROMPTS[:1],
        max_tokens=NUM_TOKENS,
        max_nodes=nodes,
        beam_width=4,
        beam_length=5,
    )
    assert tokens == references[0]
    assert len(set(accepted)) >= 3 and max(accepted) >= 3


def test_plain_decoding_through_the_engine(hybrid):
    base, references = hybrid
    tokens, _ = run(ReDrafter(base, None), PROMPTS, max_tokens=NUM_TOKENS, max_nodes=0)
    assert tokens == references


@pytest.mark.parametrize("shape", [(1, 2), (4, 4), (8, 5)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_greedy_parity_with_a_random_drafter_and_wide_trees(hybrid, shape):
    base, references = hybrid
    (tokens,), _ = run(
        ReDrafter(base, tiny_drafter(seed=3)),
        PROMPTS[:1],
        max_tokens=NUM_TOKENS,
        max_nodes=24,
        beam_width=shape[0],
        beam_length=shape[1],
    )
    assert tokens == references[0]


def test_a_batch_of_prompts_of_different_lengths(hybrid):
    base, references = hybrid
    tokens, _ = run(ReDrafter(base, oracle(base, references)), PROMPTS, max_tokens=NUM_TOKENS, max_nodes=8)
    assert tokens == references


def test_a_row_joining_a_running_batch_and_one_leaving(hybrid):
    base, references = hybrid
    decoder = Decoder(ReDrafter(base, oracle(base, references)), DraftSettings(max_nodes=8), cost_batch_sizes=(1, 2, 4))
    tokens = {}

    def record(outputs):
        for out in outputs:
            tokens[out.row] = tokens.get(out.row, []) + out.tokens

    record(decoder.join(PROMPTS[:1], NUM_TOKENS))
    for _ in range(3):
        record(decoder.step())
    record(decoder.join(PROMPTS[1:], NUM_TOKENS, ids=[1, 2]))
    record(decoder.step())
    decoder.leave([1])
    while decoder.rows:
        record(decoder.step())
    assert tokens[0] == references[0] and tokens[2] == references[2]
    assert tokens[1] == references[1][: len(tokens[1])]


def test_hybrids_verify_chains_and_experts_trees(hybrid, monkeypatch):
    base, references = hybrid
    packed = []
    pack = tree_module.pack
    monkeypatch.setattr("redrafter_mlx.engine.decoder.pack", lambda rows: packed.append(rows) or pack(rows))
    run(ReDrafter(base, tiny_drafter(seed=3)), PROMPTS[:1], max_tokens=16, max_nodes=12, beam_width=4, beam_length=4)
    chains = all(row.parents == list(range(-1, row.num_nodes - 1)) for rows in packed for row in rows)
    assert chains == base.recurrent and base.recurrent == (type(base.model).__module__.split(".")[-1] in HYBRIDS)


def test_the_cost_curve_of_a_hybrid_is_measured_with_its_commit(hybrid, monkeypatch):
    base, _ = hybrid
    commits = []
    original = RecurrentCache.commit_path
    monkeypatch.setattr(
        RecurrentCache, "commit_path", lambda self, *args: commits.append(args) or original(self, *args)
    )
    curve = calibrate.measure(ReDrafter(base, None), 2, repeats=1, sizes=(1, 4))
    assert curve.sizes == [1, 4] and all(s > 0 for s in curve.seconds)
    assert bool(commits) == base.recurrent


def test_most_likely_path():
    drafts = [
        tree_module.Draft([1, 2, 3], [("a", 1)] * 3, [0.9, 0.5, 0.9], [1] * 3),
        tree_module.Draft([1, 4], [("a", 1)] * 2, [0.9, 0.8], [1] * 2),
        tree_module.Draft([5], [("a", 1)], [0.3], [1]),
    ]
    path = tree_module.most_likely_path(tree_module.candidate_tree(0, drafts))
    assert path.tokens == [0, 1, 4] and path.parents == [-1, 0, 1] and path.depths == [0, 1, 2]
    assert np.allclose(path.probs, [1.0, 0.9, 0.72])


class CacheListModel(llama.Model):
    """A model whose layers each keep a CacheList, as falcon_h1's do."""

    def make_cache(self):
        return [CacheList(ArraysCache(size=2), KVCache()) for _ in self.layers]


def test_a_layer_the_engine_cannot_verify_with_is_one_clear_error():
    model = tiny_model("llama")
    model.__class__ = CacheListModel
    with pytest.raises(UserError, match="layer 0 keeps a CacheList"):
        BaseModel(model)


@pytest.mark.parametrize("kind", ["nemotron_h", "qwen3_next"])
def test_generate_runs_a_hybrid_from_an_mlx_lm_folder(kind, tmp_path):
    """Plain decoding through the project, and drafting by lookup, both
    equal to mlx-lm's greedy output."""
    from mlx_lm.utils import load, save_config, save_model

    model = tiny_model(kind, seed=2)
    save_model(tmp_path, model)
    save_config({k: v for k, v in vars(model.args).items() if v is not None}, tmp_path / "config.json")
    save_word_tokenizer(tmp_path, 256)
    loaded, tokenizer = load(str(tmp_path))
    prompt = "w5 w6 w7 w5 w6 w7 w5 w6"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    expected = []
    for token in mlx_lm_greedy(loaded, ids, 24):
        if token in tokenizer.eos_token_ids:
            break
        expected.append(token)
    for options in (["--max-nodes", 0], ["--max-nodes", 8]):
        result = run_cli(
            "generate",
            "--model",
            tmp_path,
            "--drafter",
            "none",
            "--prompt",
            prompt,
            "--ignore-chat-template",
            "--max-tokens",
            24,
            "--json",
            *options,
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["tokens"] == expected, options


def test_a_hybrids_state_after_steps_equals_plain_decoding():
    """After drafting steps, each recurrent layer's state equals what plain
    decoding of the same tokens leaves."""
    model = tiny_model("qwen3_next", seed=1)
    base = BaseModel(model)
    references = [mlx_lm_greedy(model, p, NUM_TOKENS) for p in PROMPTS]
    decoder = Decoder(ReDrafter(base, oracle(base, references)), DraftSettings(max_nodes=8), cost_batch_sizes=(1,))
    decoder.join(PROMPTS[:1], NUM_TOKENS)
    for _ in range(6):
        decoder.step()
    tokens, _, _ = decoder.prompt_cache(0)
    plain = model.make_cache()
    model(mx.array([tokens]), cache=plain)
    for ours, theirs in zip(decoder.cache, plain):
        if hasattr(ours, "recorded"):
            for a, b in zip(ours.cache, theirs.cache):
                assert np.allclose(np.array(a), np.array(b), atol=1e-4)
