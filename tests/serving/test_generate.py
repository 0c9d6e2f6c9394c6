"""mlx-lm's generation API, decoded by ReDrafter: a program written for
mlx-lm runs unchanged but for its import, greedy output is mlx-lm's token
for token, and sampled output has plain sampling's distribution."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from conftest import ROOT, assert_same_distribution, processed_probs
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.errors import UserError
from redrafter_mlx.loading.loader import load
from redrafter_mlx.serving.generate import batch_generate, stream_generate

# A program written against mlx-lm's API; IMPORT is its only line that changes.
PROGRAM = """
import json, sys
IMPORT
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

model, tokenizer = load(sys.argv[1])
out = {}
out["generate"] = generate(model, tokenizer, "w5 w9 w5 w9", max_tokens=24)
out["verbose"] = generate(model, tokenizer, prompt=[4, 5, 6], max_tokens=8, verbose=False)

cache = make_prompt_cache(model)
turns = []
for prompt in (tokenizer.encode("w3 w4 w5 w3 w4"), [7, 8, 9, 7, 8]):
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=20, prompt_cache=cache,
                                     sampler=make_sampler(temp=0.0), logits_processors=make_logits_processors(repetition_penalty=1.1)))
    turns.append([[r.text, r.token, r.finish_reason, r.generation_tokens, r.prompt_tokens] for r in responses])
    out.setdefault("from_draft", []).append(sum(r.from_draft for r in responses))
    out.setdefault("logprobs", []).append([r.logprobs.shape == (tokenizer.vocab_size,) if r.logprobs is not None else None for r in responses])
out["turns"] = turns

sampler = make_sampler(temp=0.7, top_p=0.9)
processors = make_logits_processors(repetition_penalty=1.1)
sampled = "".join(r.text for r in stream_generate(model, tokenizer, "w1 w2", max_tokens=6, sampler=sampler, logits_processors=processors))
out["sampled_words"] = all(w.startswith("w") or w.startswith("<") for w in sampled.split())

batch = batch_generate(model, tokenizer, [[4, 5, 6, 4, 5], [9, 3], [11, 12, 11]], max_tokens=[10, 14, 6], return_token_ids=True)
out["batch"] = [batch.texts, batch.token_ids, batch.stats.generation_tokens]
print(json.dumps(out))
"""

IMPORTS = {
    "mlx_lm": "from mlx_lm import batch_generate, generate, load, stream_generate",
    "redrafter_mlx": "from redrafter_mlx import batch_generate, generate, load, stream_generate",
}


def run_program(library: str, model: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM.replace("IMPORT", IMPORTS[library]), model],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_program_written_for_mlx_lm_runs_unchanged_and_its_greedy_text_is_identical(chat_model):
    """The same program, importing mlx-lm and then redrafter_mlx: every
    greedy text, token, finish reason and count is mlx-lm's, and a prompt
    cache carries the first turn into the second. (Whether drafting pays
    here is the machine's measured costs' to decide, so that drafts are
    accepted on these prompts is the next test's, with a fixed tree.)"""
    model = chat_model[0]
    plain, redrafted = run_program("mlx_lm", model), run_program("redrafter_mlx", model)
    for key in ("generate", "verbose", "turns", "batch", "sampled_words"):
        assert redrafted[key] == plain[key], key
    assert sum(plain["from_draft"]) == 0
    assert all(all(flags) for flags in redrafted["logprobs"])


def test_context_lookup_drafts_the_programs_repeating_text(chat_model):
    """The program's first call with a fixed tree instead of the measured
    costs' choice: its answer repeats itself, context lookup's drafts are
    accepted, and the tokens are mlx-lm's."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(chat_model[0])
    expected = [r.token for r in mlx_lm.stream_generate(model, tokenizer, "w5 w9 w5 w9", max_tokens=24)]
    redrafter, wrapped = load(chat_model[0])
    draft = DraftSettings(max_nodes=8)
    responses = list(stream_generate(redrafter, wrapped, "w5 w9 w5 w9", max_tokens=24, draft=draft))
    assert [r.token for r in responses] == expected
    assert any(r.from_draft for r in responses)


def no_repeat(tokens: mx.array, logits: mx.array) -> mx.array:
    """A logits processor that forbids repeating the last token: what it
    does depends on every token of the node's own path."""
    banned = mx.arange(logits.shape[-1]) == tokens[-1]
    return mx.where(banned, -mx.inf, logits)


@pytest.fixture(scope="module")
def pair(chat_model):
    return load(chat_model[0], drafter=chat_model[1])


def test_logits_processors_see_each_nodes_own_path(pair, chat_model):
    """With the RNN's trees verified, a processor that reads the path gives
    mlx-lm's greedy tokens, and drafted tokens were accepted."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(chat_model[0])
    prompt = chat_model[2]
    processors = [no_repeat] + make_logits_processors(repetition_penalty=1.3)
    expected = [
        r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=40, logits_processors=processors)
    ]
    draft = DraftSettings(beam_width=4, beam_length=4, max_nodes=12)
    responses = list(stream_generate(*pair, prompt, max_tokens=40, logits_processors=processors, draft=draft))
    assert [r.token for r in responses] == expected
    assert any(r.from_draft for r in responses)


def test_sampled_tokens_from_an_apps_sampler_have_plain_samplings_distribution(pair, chat_model):
    """4,000 copies of the prompt with mlx-lm's sampler (temperature 0.7,
    top-p 0.9) and repetition penalty, the RNN's 4x3 trees verified: the
    first two tokens follow the distribution plain sampling draws from
    (the processors applied to each prefix, then the sampler's filters)."""
    _, _, prompt, _, _ = chat_model
    base = pair[0].base.model
    penalty = make_logits_processors(repetition_penalty=1.1)[0]
    settings = dict(temp=0.7, top_p=0.9)

    def probs(prefix):
        logits = penalty(mx.array(prefix), base(mx.array([prefix]))[:, -1])
        return processed_probs(logits[0], settings)

    p1 = probs(prompt)
    joint = np.zeros((len(p1), len(p1)))
    for a in np.nonzero(p1)[0]:
        joint[a] = p1[a] * probs(prompt + [int(a)])
    draft = DraftSettings(beam_width=4, beam_length=3, max_nodes=8)
    mx.random.seed(3)
    result = batch_generate(
        *pair,
        [prompt] * 4000,
        max_tokens=2,
        return_token_ids=True,
        completion_batch_size=500,
        draft=draft,
        sampler=make_sampler(temp=0.7, top_p=0.9),
        logits_processors=[penalty],
    )
    counts = np.zeros_like(joint, dtype=int)
    for tokens in result.token_ids:
        counts[tokens[0], tokens[1]] += 1
    assert_same_distribution(counts, joint)
    sampler = make_sampler(temp=0.7, top_p=0.9)
    drafted = [
        r.from_draft
        for _ in range(40)
        for r in stream_generate(*pair, prompt, max_tokens=2, draft=draft, sampler=sampler)
    ]
    assert any(drafted)


@pytest.mark.parametrize(
    "argument, message",
    [
        (dict(kv_bits=4), "kv_bits is not supported"),
        (dict(max_kv_size=64), "max_kv_size is not supported"),
        (dict(temperature=0.5), "unknown argument: temperature"),
        (dict(prompt_cache=[None]), "make_prompt_cache(model)"),
    ],
)
def test_what_redrafter_does_not_do_is_one_clear_error(pair, argument, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        next(stream_generate(*pair, [4, 5, 6], max_tokens=4, **argument))
