"""Sampling at temperature > 0 keeps the base model's distribution exactly;
batched generation keeps greedy parity."""

import itertools
import json
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from conftest import (
    CHAT_PROMPT,
    CHAT_SETTINGS,
    OracleDrafter,
    assert_same_distribution,
    processed_probs,
    run_cli,
    tiny_drafter,
    tiny_model,
)
from redrafter_mlx.drafting.cost import CostCurve
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.engine import calibrate
from redrafter_mlx.engine.autoregressive import autoregressive_steps
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.decoder import generate_steps
from redrafter_mlx.engine.sampling import SamplingSettings, gumbel_noise, make_chooser, open_uniform, row_seed
from redrafter_mlx.engine.types import ReDrafter, TokenHistory
from redrafter_mlx.errors import UserError
from redrafter_mlx.loading.loader import load
from redrafter_mlx.serving.api import batch_steps

VOCAB = 8
PROMPT = [1, 5, 2, 7, 1, 5, 2]  # repeats itself, so context lookup proposes drafts
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

    def read_hidden(self, hidden):
        return hidden

    def search_log_probs(self, hidden, state, rows=None):
        return mx.broadcast_to(self.logprobs, state.shape[:-1] + self.logprobs.shape)

    def token_ids(self, draft_indices):
        return draft_indices


@pytest.fixture(scope="module")
def base():
    return BaseModel(tiny_model("llama", seed=11, vocab=VOCAB))


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


def draft_settings(mode, shape):
    """rnn: the RNN's beams, all verified; both: and one lookup continuation,
    all verified; auto: both, pruned by the cost of this machine."""
    if mode == "auto":
        return DraftSettings(*shape)
    draft = DraftSettings.rnn_only(*shape)
    if mode == "both":
        draft.lookup, draft.max_nodes = True, draft.max_nodes + shape[1] - 1
    return draft


def redrafter_counts(base, drafter, settings, shape, mode="rnn"):
    chooser = make_chooser(SamplingSettings(**settings, row_seeds=list(range(SAMPLES))))
    counts = np.zeros((VOCAB,) * 3, int)
    outputs = [[] for _ in range(SAMPLES)]
    for step in generate_steps(
        ReDrafter(base, drafter), [PROMPT] * SAMPLES, max_tokens=3, draft=draft_settings(mode, shape), choose=chooser
    ):
        for out in step:
            outputs[out.row] += out.tokens
    for tokens in outputs:
        counts[tuple(tokens)] += 1
    return counts


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("shape", [(1, 3), (4, 3)], ids=["1x3", "4x3"])
@pytest.mark.parametrize(
    "drafter_kind, mode", [("likely", "rnn"), ("unlikely", "rnn"), ("likely", "auto"), ("like_lookup", "both")]
)
def test_sampled_tokens_have_the_base_models_distribution(base, settings, shape, drafter_kind, mode, monkeypatch):
    """like_lookup: the drafter prefers 1 then 5, which the lookup proposes
    after 7 (PROMPT repeats 7, 1, 5), so RNN and lookup drafts share
    prefixes in the tree. auto prunes by a fixed steep cost curve (measuring
    one at a batch of 4,000 would take longer than the test)."""
    steep = CostCurve([1, 2, 4, 8], [1.0, 1.3, 1.9, 3.5], draft_seconds=0.1)
    monkeypatch.setattr(calibrate, "cost_curve", lambda *args, **kwargs: steep)
    joint, _ = exact_distribution(base, settings)
    marginal = joint.sum(axis=(1, 2)) + joint.sum(axis=(0, 2)) + joint.sum(axis=(0, 1))
    preference = {
        "likely": np.log(marginal + 1e-9),
        "unlikely": -np.log(marginal + 1e-9),
        "like_lookup": np.array([0.0, 3.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0]),
    }[drafter_kind]
    counts = redrafter_counts(base, FixedDrafter(preference), settings, shape, mode)
    assert_same_distribution(counts, joint)


@pytest.mark.parametrize("kind", ["qwen3_next", "nemotron_h"])
def test_sampled_tokens_of_a_hybrid_have_the_base_models_distribution(kind, monkeypatch):
    """A hybrid verifies chains; its recurrent state is set to the accepted
    prefix after each step, which the third token depends on."""
    steep = CostCurve([1, 2, 4, 8], [1.0, 1.3, 1.9, 3.5], draft_seconds=0.1)
    monkeypatch.setattr(calibrate, "cost_curve", lambda *args, **kwargs: steep)
    hybrid = BaseModel(tiny_model(kind, seed=11, vocab=VOCAB))
    settings = dict(temp=1.0)
    joint, _ = exact_distribution(hybrid, settings)
    marginal = joint.sum(axis=(1, 2)) + joint.sum(axis=(0, 2)) + joint.sum(axis=(0, 1))
    counts = redrafter_counts(hybrid, FixedDrafter(np.log(marginal + 1e-9)), settings, (4, 3), "both")
    assert_same_distribution(counts, joint)


def reference_rule_sample(p, beams, q, length, rng):
    """One sample of ``length`` tokens by the reference implementations'
    rule: accept each beam's drafted tokens with probability min(1, p/q),
    beams independently, keep the longest run (the first on ties), then a
    bonus token from the residual max(0, p - q). ``p(prefix)`` is the base
    model's next-token distribution after the prompt and ``prefix``, ``q``
    the drafter's (context-free) distribution, ``beams`` its drafted token
    tuples."""

    def residual(probs):
        r = np.maximum(probs - q, 0)
        return r / r.sum() if r.sum() > 0 else probs

    out = [rng.choice(len(q), p=p(()))]
    while len(out) < length:
        best_run, best = -1, None
        for beam in beams:
            run = 0
            while run < len(beam) and rng.random() < min(1, p(tuple(out) + beam[:run])[beam[run]] / q[beam[run]]):
                run += 1
            if run > best_run:
                best_run, best = run, beam
        out += best[:best_run]
        if len(out) < length:
            probs = p(tuple(out))
            out.append(rng.choice(len(q), p=residual(probs) if best_run < len(best) else probs))
    return tuple(out[:length])


def test_the_biased_reference_rule_fails_the_same_test(base):
    settings = dict(temp=1.0)
    joint, (p1, p2, p3) = exact_distribution(base, settings)
    marginal = joint.sum(axis=(1, 2)) + joint.sum(axis=(0, 2)) + joint.sum(axis=(0, 1))
    q = marginal / marginal.sum()
    # Beam search over a context-free drafter: the best 4 pairs.
    pairs = sorted(itertools.product(range(VOCAB), repeat=2), key=lambda ab: -(q[ab[0]] * q[ab[1]]))[:4]
    tables = {0: lambda prefix: p1, 1: lambda prefix: p2[prefix], 2: lambda prefix: p3[prefix]}
    rng, counts = np.random.default_rng(0), np.zeros((VOCAB,) * 3, int)
    for _ in range(SAMPLES):
        counts[reference_rule_sample(lambda prefix: tables[len(prefix)](prefix), pairs, q, 3, rng)] += 1
    with pytest.raises(AssertionError):
        assert_same_distribution(counts, joint, min_p=1e-6)


def test_open_uniform_is_strictly_inside_zero_one_for_every_hash_value():
    """Every value of the 23 bits it reads, and the extreme words: a uniform
    of exactly 1 (or 0) would make the Gumbel noise infinite."""
    every = mx.arange(1 << 23, dtype=mx.uint32) << 9
    extremes = mx.array([0, 1, 511, 512, 0xFFFFFE00, 0xFFFFFF00, 0xFFFFFFFE, 0xFFFFFFFF], mx.uint32)
    for bits in (every, every | 511, extremes):
        uniform = open_uniform(bits)
        assert mx.all(uniform > 0).item() and mx.all(uniform < 1).item()
        assert mx.all(mx.isfinite(-mx.log(-mx.log(uniform)))).item()
    noise = gumbel_noise([row_seed(1, i) for i in range(64)], mx.arange(64 * 8).reshape(64, 8), 32768)
    assert mx.all(mx.isfinite(noise)).item()


def test_noise_reused_across_calls_draws_what_fresh_noise_draws():
    """A chooser keeps each (seed, position)'s noise while later calls ask
    for it: a run of steps (contexts growing, nodes at several depths, rows
    joining and leaving) chooses exactly what a new chooser chooses at each
    step, and logits that favour no token give tokens that vary with the
    position, so stale noise would show."""
    vocab, nodes = 512, 5
    depths = mx.array([[0, 1, 1, 2, 3], [0, 1, 2, 3, 4]])
    settings = SamplingSettings(temp=1.0, seed=9)
    kept = make_chooser(settings)
    logits = mx.zeros((2, nodes, vocab))
    chosen = []
    for step, (rows, length) in enumerate(
        [([0, 1], 10), ([0, 1], 12), ([0, 1], 13), ([1, 2], 13), ([1, 2], 17), ([0, 2], 17)]
    ):
        history = TokenHistory(rows, [[0] * (length + r) for r in rows], mx.zeros((2, nodes), mx.int32), None, depths)
        got = kept(logits, history)
        assert mx.array_equal(got, make_chooser(settings)(logits, history)), step
        chosen += np.array(got).ravel().tolist()
    assert len(set(chosen)) >= 20


@pytest.mark.parametrize(
    "settings",
    [dict(temp=1.0, top_k=4), dict(temp=1.0, top_p=0.9), dict(temp=1.0, min_p=0.02)],
    ids=["top_k", "top_p", "min_p"],
)
def test_no_token_outside_the_filters_with_a_real_size_vocabulary(settings):
    """4,000 draws over 32,768 tokens: with 24-bit uniforms about 8 of them
    fell on a token the filter had removed."""
    vocab, draws, chunk = 32768, 4000, 1000
    logits = mx.random.normal((1, 1, vocab), key=mx.random.key(3)) * 3
    allowed = processed_probs(logits[0, 0], settings) > 0
    assert 2 <= allowed.sum() < vocab // 2
    choose = make_chooser(SamplingSettings(**settings, row_seeds=[1000 + r for r in range(draws)]))
    tokens = []
    for start in range(0, draws, chunk):
        rows = list(range(start, start + chunk))
        history = TokenHistory(rows, [[0] * (1 + r % 7) for r in rows])
        tokens += np.array(choose(mx.broadcast_to(logits, (chunk, 1, vocab)), history))[:, 0].tolist()
    assert allowed[tokens].all(), sorted(set(t for t in tokens if not allowed[t]))
    assert len(set(tokens)) > 1


def copies_exact_distribution(exact):
    """P(x1, x2) after the chat prompt, (V, V), from the fixture's tables."""
    p1, p2 = exact
    joint = np.zeros((len(p1), len(p1)))
    for a, probs in p2.items():
        joint[a] = p1[a] * probs
    return joint


def pair_counts(token_lists, vocab):
    counts = np.zeros((vocab, vocab), int)
    for (a, b), n in Counter(tuple(t[:2]) for t in token_lists).items():
        counts[a, b] += n
    return counts


@pytest.mark.parametrize("index", range(len(CHAT_SETTINGS)), ids=["temp1-top_k4", "temp0.7-top_p0.9"])
@pytest.mark.parametrize("shape", [(1, 3), (4, 3)], ids=["1x3", "4x3"])
def test_copies_of_one_prompt_across_chunks_sample_the_exact_distribution(chat_model, index, shape):
    """4,000 copies of one prompt in chunks of 500: each copy draws its own
    randomness (its index in the input list), so the first two tokens follow
    the base model's distribution."""
    model, drafter, _, exact, _ = chat_model
    redrafter, tokenizer = load(model, drafter=drafter)
    choose = make_chooser(SamplingSettings(**CHAT_SETTINGS[index], seed=5))
    results = batch_steps(
        redrafter,
        tokenizer,
        [CHAT_PROMPT] * SAMPLES,
        2,
        batch_size=500,
        beam_width=shape[0],
        beam_length=shape[1],
        max_nodes=shape[0] * (shape[1] - 1),
        choose=choose,
    )
    assert sum(r.step_tokens for r in results) > 1.3 * sum(r.steps for r in results)  # drafts are accepted
    joint = copies_exact_distribution(exact[index])
    assert_same_distribution(pair_counts([r.tokens for r in results], len(joint)), joint)


@pytest.mark.parametrize("index, shape", [(0, "4x3"), (1, "1x3")], ids=["temp1-top_k4-4x3", "temp0.7-top_p0.9-1x3"])
def test_generate_prompts_file_of_copies_samples_the_exact_distribution(chat_model, tmp_path, index, shape):
    model, drafter, _, exact, _ = chat_model
    prompts = tmp_path / "copies.jsonl"
    prompts.write_text((json.dumps({"prompt": CHAT_PROMPT}) + "\n") * SAMPLES)
    width, length = shape.split("x")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in CHAT_SETTINGS[index].items()]
    result = run_cli(
        "generate",
        "--model",
        model,
        "--drafter",
        drafter,
        "--prompts",
        prompts,
        "--batch-size",
        400,
        "--max-tokens",
        2,
        "--seed",
        9,
        "--beam-width",
        width,
        "--beam-length",
        length,
        "--max-nodes",  # every draft verified, as above (and no curve measured for 400 rows)
        int(width) * (int(length) - 1),
        *flags,
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line)["tokens"] for line in result.stdout.splitlines()]
    assert len(lines) == SAMPLES
    joint = copies_exact_distribution(exact[index])
    assert_same_distribution(pair_counts(lines, len(joint)), joint)


@pytest.mark.parametrize("index", range(len(CHAT_SETTINGS)), ids=["temp1-top_k4", "temp0.7-top_p0.9"])
def test_the_reference_rule_fails_the_copies_test(chat_model, index):
    """The P/Q, longest-beam rule with the same drafter (its 4x3 beams over
    the same context-free preference) and as many samples is rejected."""
    _, _, _, exact, drafter_probs = chat_model
    p1, p2 = exact[index]
    q = np.zeros(len(p1))
    q[list(drafter_probs)] = list(drafter_probs.values())
    beams = sorted(itertools.product(drafter_probs, repeat=2), key=lambda ab: -(q[ab[0]] * q[ab[1]]))[:4]
    rng = np.random.default_rng(1)
    samples = [
        reference_rule_sample(lambda prefix: p2[prefix[0]] if prefix else p1, beams, q, 2, rng) for _ in range(SAMPLES)
    ]
    joint = copies_exact_distribution(exact[index])
    with pytest.raises(AssertionError):
        assert_same_distribution(pair_counts(samples, len(joint)), joint)


@pytest.mark.parametrize(
    "settings",
    [
        dict(temp=0.8),
        dict(temp=1.0, top_k=3),
        dict(temp=0.9, repetition_penalty=1.5),
        dict(temp=1.0, min_p=0.1, logit_bias={3: 2.0}),
    ],
)
def test_seeded_sampling_equals_autoregressive_sampling_and_ignores_batching(settings):
    """Noise keyed by (the prompt's seed, position): ReDrafter and plain
    decoding draw the same tokens, in a batch or each prompt alone with its
    index in the input list (``row_ids``), and so with its own seed.
    Exercises the tree's per-node repetition-penalty windows against the
    plain loop's."""
    base = BaseModel(tiny_model("llama", seed=12))
    prompts = [[5, 17, 42, 99, 3], [9, 8], [100, 101, 102, 1, 2, 3, 4]]
    choose = make_chooser(SamplingSettings(**settings, seed=123))
    plain = [[] for _ in prompts]
    for step in autoregressive_steps(base, prompts, max_tokens=40, choose=choose):
        for out in step:
            plain[out.row] += out.tokens
    drafter = OracleDrafter(base, [p + t for p, t in zip(prompts, plain)], corrupt=4)
    for groups in ([range(3)], [[0], [1], [2]], [[2, 0], [1]]):
        got = {}
        for group in groups:
            steps = generate_steps(
                ReDrafter(base, drafter),
                [prompts[i] for i in group],
                max_tokens=40,
                draft=DraftSettings(beam_width=3, beam_length=4),
                choose=choose,
                row_ids=group,
            )
            for step in steps:
                for out in step:
                    got.setdefault(group[out.row], []).extend(out.tokens)
        assert [got[i] for i in range(3)] == plain
    assert len({tuple(t) for t in plain}) == 3


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_batched_greedy_equals_each_prompts_solo_run(batch_size):
    from conftest import mlx_lm_greedy

    base = BaseModel(tiny_model("qwen2", seed=13))
    rng = np.random.default_rng(batch_size)
    prompts = [rng.integers(0, 256, size=rng.integers(1, 20)).tolist() for _ in range(batch_size)]
    references = [mlx_lm_greedy(base.model, p, 48) for p in prompts]
    for drafter in (tiny_drafter(seed=3), OracleDrafter(base, [p + r for p, r in zip(prompts, references)], corrupt=5)):
        outputs = [[] for _ in prompts]
        for step in generate_steps(
            ReDrafter(base, drafter), prompts, max_tokens=40, draft=DraftSettings(beam_width=4, beam_length=5)
        ):
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


def test_too_few_row_seeds_is_one_clear_error():
    choose = make_chooser(SamplingSettings(temp=1.0, row_seeds=[1, 2]))
    with pytest.raises(UserError, match="row_seeds holds 2 seeds"):
        choose(mx.zeros((1, 1, 8)), TokenHistory([2], [[0]]))


def test_prompts_with_settings_of_their_own_sample_in_one_batch_as_alone():
    from redrafter_mlx.engine.sampling import chooser_per_prompt

    base = BaseModel(tiny_model("llama", seed=6))
    redrafter = ReDrafter(base, tiny_drafter(seed=7))
    prompts = [[5, 17, 42], [9, 8, 7, 6], [5, 17, 42]]
    settings = [
        SamplingSettings(temp=1.0, top_k=8, seed=11),
        SamplingSettings(temp=0.0, repetition_penalty=1.3),
        SamplingSettings(temp=0.7, top_p=0.9, seed=12),
    ]

    def tokens(prompt_list, choose, ids=None):
        out = {}
        for step in generate_steps(redrafter, prompt_list, max_tokens=20, choose=choose, row_ids=ids):
            for o in step:
                out[o.row] = out.get(o.row, []) + o.tokens
        return [out[i] for i in range(len(prompt_list))]

    alone = [tokens([p], make_chooser(s))[0] for p, s in zip(prompts, settings)]
    together = tokens(
        prompts, chooser_per_prompt({40 + i: make_chooser(s) for i, s in enumerate(settings)}), ids=[40, 41, 42]
    )
    assert together == alone
    assert alone[0] != alone[2]  # the seeds and settings differ
