"""Sampling at temperature > 0 keeps the base model's distribution exactly;
batched generation keeps greedy parity."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from conftest import OracleDrafter, tiny_drafter, tiny_model
from mlx_lm.sample_utils import apply_top_p
from scipy.stats import chisquare

from redrafter_mlx.autoregressive import autoregressive_steps
from redrafter_mlx.base_model import BaseModel
from redrafter_mlx.errors import UserError
from redrafter_mlx.generate import ReDrafter, generate_steps
from redrafter_mlx.sampling import SamplingSettings, make_chooser

VOCAB = 8
PROMPT = [1, 5, 2, 7]
SAMPLES = 4000
SETTINGS = [dict(temp=1.0), dict(temp=0.7), dict(temp=1.0, top_p=0.9)]


class FixedDrafter:
    """A test double that always prefers the same tokens, whatever the
    context: ``preference`` are its logits over the vocabulary."""

    def __init__(self, preference):
        self.logprobs = mx.array(preference, mx.float32) - mx.logsumexp(mx.array(preference, mx.float32))
        self.draft_vocab_size = len(preference)

    def update_state(self, token_embeddings, state):
        return mx.zeros(token_embeddings.shape[:-1] + (1,))

    def log_probs(self, hidden, state):
        return mx.broadcast_to(self.logprobs, state.shape[:-1] + self.logprobs.shape)

    def token_ids(self, draft_indices):
        return draft_indices


@pytest.fixture(scope="module")
def base():
    return BaseModel(tiny_model("llama", seed=11, vocab=VOCAB))


def processed_probs(logits, settings):
    """The distribution a token is sampled from, as mlx-lm defines it."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if settings.get("top_p", 1.0) < 1.0:
        logprobs = apply_top_p(logprobs, settings["top_p"])
    probs = np.array(mx.softmax(logprobs / settings["temp"], axis=-1)).astype(np.float64)
    return probs / probs.sum(axis=-1, keepdims=True)


def exact_distribution(base, settings):
    """P(x1, x2, x3 | PROMPT) of autoregressive sampling, by enumeration;
    also the conditionals, for the simulation of the biased rule."""
    p1 = processed_probs(base.model(mx.array([PROMPT]))[0, -1], settings)
    prefixes1 = mx.array([PROMPT + [a] for a in range(VOCAB)])
    p2 = processed_probs(base.model(prefixes1)[:, -1], settings)  # (V, V)
    prefixes2 = mx.array([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    p3 = processed_probs(base.model(prefixes2)[:, -1], settings).reshape(VOCAB, VOCAB, VOCAB)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint, (p1, p2, p3)


def assert_same_distribution(counts, joint, min_p=1e-3):
    """Chi-square goodness of fit, merging cells expected below 5."""
    total = counts.sum()
    expected = joint.ravel() * total
    observed = counts.ravel().astype(float)
    small = expected < 5
    exp = np.append(expected[~small], expected[small].sum())
    obs = np.append(observed[~small], observed[small].sum())
    p_value = chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    assert p_value > min_p, p_value
    return p_value


def redrafter_counts(base, drafter, settings, shape):
    chooser = make_chooser(SamplingSettings(**settings, row_seeds=list(range(SAMPLES))))
    counts = np.zeros((VOCAB,) * 3, int)
    outputs = [[] for _ in range(SAMPLES)]
    for step in generate_steps(ReDrafter(base, drafter), [PROMPT] * SAMPLES, max_tokens=3, beam_width=shape[0], beam_length=shape[1], choose=chooser):
        for out in step:
            outputs[out.row] += out.tokens
    for tokens in outputs:
        counts[tuple(tokens)] += 1
    return counts


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("shape", [(1, 3), (4, 3)], ids=["1x3", "4x3"])
@pytest.mark.parametrize("drafter_kind", ["likely", "unlikely"])
def test_sampled_tokens_have_the_base_models_distribution(base, settings, shape, drafter_kind):
    joint, _ = exact_distribution(base, settings)
    marginal = joint.sum(axis=(1, 2)) + joint.sum(axis=(0, 2)) + joint.sum(axis=(0, 1))
    preference = np.log(marginal + 1e-9) if drafter_kind == "likely" else -np.log(marginal + 1e-9)
    counts = redrafter_counts(base, FixedDrafter(preference), settings, shape)
    assert_same_distribution(counts, joint)


def biased_reference_counts(conditionals, preference, width, rng):
    """The reference implementations' rule: accept each beam's drafted token
    with probability min(1, p/q), beams independently, keep the longest run,
    then a bonus token from the residual max(0, p - q)."""
    p1, p2, p3 = conditionals
    q = np.exp(preference - np.logaddexp.reduce(preference))
    # Beam search over a context-free drafter: the best `width` pairs.
    pairs = sorted(itertools.product(range(VOCAB), repeat=2), key=lambda ab: -(q[ab[0]] * q[ab[1]]))[:width]

    def residual(p):
        r = np.maximum(p - q, 0)
        return r / r.sum() if r.sum() > 0 else p

    counts = np.zeros((VOCAB,) * 3, int)
    for _ in range(SAMPLES):
        x1 = rng.choice(VOCAB, p=p1)
        best = (-1, None)
        for a, b in pairs:
            run = 0
            if rng.random() < min(1, p2[x1, a] / q[a]):
                run = 1
                if rng.random() < min(1, p3[x1, a, b] / q[b]):
                    run = 2
            if run > best[0]:
                best = (run, (a, b))
        run, (a, b) = best
        if run == 0:
            x2 = rng.choice(VOCAB, p=residual(p2[x1]))
            x3 = rng.choice(VOCAB, p=p3[x1, x2])
        elif run == 1:
            x2, x3 = a, rng.choice(VOCAB, p=residual(p3[x1, a]))
        else:
            x2, x3 = a, b
        counts[x1, x2, x3] += 1
    return counts


def test_the_biased_reference_rule_fails_the_same_test(base):
    settings = dict(temp=1.0)
    joint, conditionals = exact_distribution(base, settings)
    marginal = joint.sum(axis=(1, 2)) + joint.sum(axis=(0, 2)) + joint.sum(axis=(0, 1))
    counts = biased_reference_counts(conditionals, np.log(marginal + 1e-9), 4, np.random.default_rng(0))
    with pytest.raises(AssertionError):
        assert_same_distribution(counts, joint, min_p=1e-6)


@pytest.mark.parametrize("settings", [dict(temp=0.8), dict(temp=1.0, top_k=3), dict(temp=0.9, repetition_penalty=1.5), dict(temp=1.0, min_p=0.1, logit_bias={3: 2.0})])
def test_seeded_sampling_equals_autoregressive_sampling_and_ignores_batching(settings):
    """Noise keyed by (seed, position): ReDrafter and plain decoding draw the
    same tokens, alone or in a batch. Exercises the tree's per-node
    repetition-penalty windows against the plain loop's."""
    base = BaseModel(tiny_model("llama", seed=12))
    prompts = [[5, 17, 42, 99, 3], [9, 8], [100, 101, 102, 1, 2, 3, 4]]
    choose = make_chooser(SamplingSettings(**settings, seed=123))
    plain = [[] for _ in prompts]
    for step in autoregressive_steps(base, prompts, max_tokens=40, choose=choose):
        for out in step:
            plain[out.row] += out.tokens
    drafter = OracleDrafter(base, [p + t for p, t in zip(prompts, plain)], corrupt=4)
    for batch in ([prompts], [[p] for p in prompts]):
        got = []
        for group in batch:
            outputs = [[] for _ in group]
            for step in generate_steps(ReDrafter(base, drafter), group, max_tokens=40, beam_width=3, beam_length=4, choose=choose):
                for out in step:
                    outputs[out.row] += out.tokens
            got += outputs
        assert got == plain


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_batched_greedy_equals_each_prompts_solo_run(batch_size):
    from test_generate import mlx_lm_greedy

    base = BaseModel(tiny_model("qwen2", seed=13))
    rng = np.random.default_rng(batch_size)
    prompts = [rng.integers(0, 256, size=rng.integers(1, 20)).tolist() for _ in range(batch_size)]
    references = [mlx_lm_greedy(base.model, p, 48) for p in prompts]
    for drafter in (tiny_drafter(seed=3), OracleDrafter(base, [p + r for p, r in zip(prompts, references)], corrupt=5)):
        outputs = [[] for _ in prompts]
        for step in generate_steps(ReDrafter(base, drafter), prompts, max_tokens=40, beam_width=4, beam_length=5):
            for out in step:
                outputs[out.row] += out.tokens
        assert outputs == [r[:40] for r in references]


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(temp=-0.1), "temperature"),
        (dict(top_p=0.0), "top-p"),
        (dict(top_p=1.5), "top-p"),
        (dict(top_k=-1), "top-k"),
        (dict(min_p=2.0), "min-p"),
        (dict(repetition_penalty=0.0), "repetition penalty"),
    ],
)
def test_bad_sampling_settings(settings, message):
    with pytest.raises(UserError, match=message):
        SamplingSettings(**settings)
