"""Logits processors and filters beyond temperature and top-p/k: presence and
frequency penalties, XTC, a forced opening, and reported log-probabilities,
all exact inside the tree (a node's processors see its own ancestors)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from test_sampling import PROMPT, SAMPLES, VOCAB, FixedDrafter, assert_same_distribution

from conftest import OracleDrafter, tiny_drafter, tiny_model
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.engine.autoregressive import autoregressive_steps
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.decoder import generate_steps
from redrafter_mlx.engine.sampling import SamplingSettings, make_chooser
from redrafter_mlx.engine.types import ReDrafter


def generate(redrafter, prompts, choose, max_tokens, draft):
    outputs, logprobs = [[] for _ in prompts], [[] for _ in prompts]
    for step in generate_steps(redrafter, prompts, max_tokens=max_tokens, draft=draft, choose=choose):
        for out in step:
            outputs[out.row] += out.tokens
            logprobs[out.row] += out.logprobs or []
    return outputs, logprobs


@pytest.mark.parametrize(
    "penalties",
    [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=0.8, frequency_context_size=6),
        dict(presence_penalty=0.7, frequency_penalty=0.5, logit_bias={3: 1.0}),
    ],
)
def test_greedy_penalties_equal_mlx_lms_own_processors(penalties):
    base = BaseModel(tiny_model("llama", seed=31))
    prompt = [5, 17, 42, 99, 3, 250, 7, 18]
    processors = make_logits_processors(**penalties)
    reference = [t for t, _ in generate_step(mx.array(prompt), base.model, max_tokens=40, logits_processors=processors)]
    choose = make_chooser(SamplingSettings(**penalties))
    drafter = OracleDrafter(base, [prompt + reference], corrupt=3)
    for draft in (DraftSettings(max_nodes=0), DraftSettings(beam_width=3, beam_length=4, max_nodes=12)):
        (tokens,), _ = generate(ReDrafter(base, drafter), [prompt], choose, 40, draft)
        assert tokens == reference


def processed(logits: np.ndarray, tokens: list, settings: dict) -> np.ndarray:
    """mlx-lm's next-token distribution at temperature 1 with presence and
    frequency penalties over the last 20 tokens, and XTC (its coin comes up
    with probability xtc_probability), in float64."""
    assert settings["temp"] == 1.0
    logits = logits.astype(np.float64).copy()
    window = tokens[-20:]
    logits[list(set(window))] -= settings.get("presence_penalty", 0.0)
    for t in window:
        logits[t] -= settings.get("frequency_penalty", 0.0)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    p = settings.get("xtc_probability", 0.0)
    if p:
        above = probs > settings["xtc_threshold"]
        cut = probs > (probs[above].min() if above.any() else np.inf)
        kept = np.where(cut, 0.0, probs)
        probs = (1 - p) * probs + p * kept / kept.sum()
    return probs


@pytest.mark.parametrize(
    "settings",
    [
        dict(temp=1.0, presence_penalty=0.8, frequency_penalty=0.4),
        dict(temp=1.0, xtc_probability=0.5, xtc_threshold=0.12),
    ],
    ids=["penalties", "xtc"],
)
def test_sampling_with_penalties_or_xtc_has_the_exact_distribution(settings):
    """4,000 seeded samples of three tokens through 4x3 trees of a drafter
    that likes the likely tokens, against the distribution by enumeration."""
    base = BaseModel(tiny_model("llama", seed=11, vocab=VOCAB))

    def probs(prefix):
        return processed(np.array(base.model(mx.array([PROMPT + prefix]))[0, -1]), PROMPT + prefix, settings)

    p1 = probs([])
    joint = np.zeros((VOCAB,) * 3)
    for a in range(VOCAB):
        p2 = probs([a])
        for b in range(VOCAB):
            joint[a, b] = p1[a] * p2[b] * probs([a, b])
    marginal = joint.sum(axis=(1, 2))
    choose = make_chooser(SamplingSettings(**settings, row_seeds=list(range(SAMPLES))))
    outputs, _ = generate(
        ReDrafter(base, FixedDrafter(np.log(marginal + 1e-9))),
        [PROMPT] * SAMPLES,
        choose,
        3,
        DraftSettings(beam_width=4, beam_length=3, max_nodes=8),
    )
    counts = np.zeros((VOCAB,) * 3, int)
    for tokens in outputs:
        counts[tuple(tokens)] += 1
    assert_same_distribution(counts, joint)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    return logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()


@pytest.mark.parametrize(
    "settings",
    [dict(temp=0.0), dict(temp=0.8, top_p=0.9, seed=3), dict(temp=0.0, presence_penalty=1.0, logit_bias={7: 2.0})],
    ids=["greedy", "sampled", "processed"],
)
@pytest.mark.parametrize(
    "draft",
    [DraftSettings(max_nodes=0), DraftSettings(beam_width=3, beam_length=4, max_nodes=10)],
    ids=["plain", "speculative"],
)
def test_logprobs_are_the_log_softmax_of_the_processed_logits_at_each_emitted_token(settings, draft):
    """Taken from the verification pass: each emitted token's log-probability
    and its top alternatives equal the log-softmax of plain decoding's
    processed logits (after bias and penalties, before temperature and
    filters) at that position."""
    base = BaseModel(tiny_model("llama", seed=41))
    prompts = [[5, 17, 42, 99, 3], [9, 8, 7]]
    choose = make_chooser(SamplingSettings(**settings, logprobs=4))
    outputs, logprobs = generate(ReDrafter(base, tiny_drafter(seed=41)), prompts, choose, 24, draft)
    for prompt, tokens, reported in zip(prompts, outputs, logprobs):
        assert len(reported) == len(tokens) == 24
        sequence = prompt + tokens
        logits = np.array(base.model(mx.array([sequence]))[0, len(prompt) - 1 : -1])
        for i, (token, (logprob, top)) in enumerate(zip(tokens, reported)):
            raw = logits[i].astype(np.float64)
            if "presence_penalty" in settings:
                raw[7] += 2.0
                raw[list(set(sequence[max(0, len(prompt) + i - 20) : len(prompt) + i]))] -= 1.0
            expected = log_softmax(raw)
            assert logprob == pytest.approx(expected[token], abs=1e-4)
            assert [t for t, _ in top] == list(np.argsort(-expected)[:4])
            assert [v for _, v in top] == pytest.approx(np.sort(expected)[::-1][:4], abs=1e-4)


def test_a_forced_opening_is_decoded_first_and_then_greedy_equals_plain_decoding_with_it():
    """tool_choice "required": the answer must open with given tokens (a
    processor keyed by position), with speculation as without."""
    base = BaseModel(tiny_model("llama", seed=51))
    prompt = [5, 17, 42, 99, 3]
    choose = make_chooser(SamplingSettings(forced=(200, 201, 202), forced_at=len(prompt)))
    plain = []
    for step in autoregressive_steps(base, [prompt], max_tokens=30, choose=choose):
        plain += step[0].tokens
    assert plain[:3] == [200, 201, 202]
    (tokens,), _ = generate(
        ReDrafter(base, tiny_drafter(seed=51)),
        [prompt],
        choose,
        30,
        DraftSettings(beam_width=3, beam_length=4, max_nodes=10),
    )
    assert tokens == plain
