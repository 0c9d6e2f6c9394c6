"""Greedy parity with mlx-lm's own generation loop, on tiny random models."""

import mlx.core as mx
import numpy as np
import pytest

from conftest import OracleDrafter, mlx_lm_greedy, run, tiny_drafter, tiny_model
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.drafting.tree import NO_TOKEN
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.decoder import Decoder
from redrafter_mlx.engine.types import ReDrafter
from redrafter_mlx.errors import UserError

NUM_TOKENS = 64
SHAPES = [(1, 2), (4, 4), (8, 5)]
DRAFTERS = [
    dict(rnn=True),
    dict(rnn=False),
    dict(rnn=True, exit_dim=96, layers=2),
    dict(rnn=False, exit_dim=48, layers=0),
]
MODELS = [("llama", False), ("qwen2", False), ("gemma3", False), ("llama", True)]


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: m[0] + ("-4bit" if m[1] else ""))
def base_and_reference(request):
    kind, quantize = request.param
    base = BaseModel(tiny_model(kind, seed=1, quantize=quantize))
    prompt = [5, 17, 42, 99, 3, 250, 7, 18]
    return base, prompt, mlx_lm_greedy(base.model, prompt, NUM_TOKENS + 8)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_greedy_parity_random_drafters(base_and_reference, shape):
    base, prompt, reference = base_and_reference
    for i, drafter_kwargs in enumerate(DRAFTERS):
        redrafter = ReDrafter(base, tiny_drafter(seed=i, **drafter_kwargs))
        (tokens,), _ = run(redrafter, [prompt], max_tokens=NUM_TOKENS, beam_width=shape[0], beam_length=shape[1])
        assert tokens == reference[:NUM_TOKENS], drafter_kwargs


def test_greedy_parity_with_later_tokens_from_a_short_vocabulary(base_and_reference):
    """A sorted draft vocabulary searched with later_vocab: the beams
    change, the output does not."""
    base, prompt, reference = base_and_reference
    drafter = tiny_drafter(seed=7, draft_vocab=48)
    drafter.args.sorted_draft_vocab = True
    redrafter = ReDrafter(base, drafter)
    searched = []
    search = Decoder._search
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            Decoder, "_search", lambda self, h, t, length=0: searched.append(search(self, h, t, length)) or searched[-1]
        )
        (tokens,), _ = run(redrafter, [prompt], max_tokens=NUM_TOKENS, beam_width=3, beam_length=4, later_vocab=6)
    assert tokens == reference[:NUM_TOKENS]
    short = set(np.array(drafter.draft_token_ids[:6]).tolist())
    assert all(set(np.array(beams[:, :, 2:]).ravel().tolist()) <= short | {NO_TOKEN} for beams, _ in searched)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_greedy_parity_partly_right_drafter(base_and_reference, shape):
    """A drafter that is right up to a random depth each step: accepted
    paths of every length get committed, and the output must not change."""
    base, prompt, reference = base_and_reference
    drafter = OracleDrafter(base, [prompt + reference], corrupt=shape[1])
    (tokens,), accepted = run(
        ReDrafter(base, drafter), [prompt], max_tokens=NUM_TOKENS, beam_width=shape[0], beam_length=shape[1]
    )
    assert tokens == reference[:NUM_TOKENS]
    assert len(set(accepted)) > 1 or shape[1] == 2


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_oracle_drafter_accepts_every_beam(base_and_reference, shape):
    base, prompt, reference = base_and_reference
    width, length = shape
    drafter = OracleDrafter(base, [prompt + reference])
    budget = dict(max_nodes=width * (length - 1), lookup=False)  # verify every drafted node
    (tokens,), accepted = run(
        ReDrafter(base, drafter), [prompt], max_tokens=NUM_TOKENS, beam_width=width, beam_length=length, **budget
    )
    assert tokens == reference[:NUM_TOKENS]
    # Every step but possibly the last (cut by max_tokens) accepts it all.
    assert all(a == length - 1 for a in accepted)
    assert len(accepted) == -(-(NUM_TOKENS - 1) // length)


def test_kv_cache_after_steps_equals_plain_prefill(monkeypatch):
    base = BaseModel(tiny_model("llama", seed=2))
    prompt = [9, 8, 7, 6, 5, 4]
    reference = mlx_lm_greedy(base.model, prompt, 40)
    redrafter = ReDrafter(base, OracleDrafter(base, [prompt + reference], corrupt=4))
    made = []
    original = BaseModel.make_cache
    monkeypatch.setattr(BaseModel, "make_cache", lambda self, pad: made.append(original(self, pad)) or made[-1])
    (tokens,), accepted = run(redrafter, [prompt], max_tokens=30, beam_width=3, beam_length=4)
    layout, cache = made[-1]
    length = int(layout.lengths[0])
    assert length > len(prompt) + 10 and len(set(accepted)) > 1
    committed = prompt + tokens[: length - len(prompt)]

    from mlx_lm.models.cache import make_prompt_cache

    plain = make_prompt_cache(base.model)
    base.model(mx.array([committed]), cache=plain)
    for ours, theirs in zip(cache, plain):
        assert mx.allclose(ours.keys[..., :length, :], theirs.keys[..., :length, :], atol=1e-4)
        assert mx.allclose(ours.values[..., :length, :], theirs.values[..., :length, :], atol=1e-4)


def test_max_tokens_and_eos():
    base = BaseModel(tiny_model("llama", seed=1))
    prompt = [1, 2, 3]
    reference = mlx_lm_greedy(base.model, prompt, 30)
    redrafter = ReDrafter(base, OracleDrafter(base, [prompt + reference]))
    (tokens,), _ = run(redrafter, [prompt], max_tokens=7, beam_width=2, beam_length=5)
    assert tokens == reference[:7]
    (tokens,), _ = run(redrafter, [prompt], max_tokens=0)
    assert tokens == []
    eos = reference[12]
    stop = reference.index(eos)
    (tokens,), _ = run(redrafter, [prompt], max_tokens=30, eos_token_ids=[eos])
    assert tokens == reference[:stop]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(beam_width=0), "beam width"),
        (dict(beam_length=1), "beam length"),
        (dict(max_tokens=-1), "max tokens"),
        (dict(prompt_length=5000), "context"),
    ],
)
def test_bad_settings(kwargs, message):
    redrafter = ReDrafter(BaseModel(tiny_model("llama")), tiny_drafter())
    prompt = [1, 2, 3] * (kwargs.pop("prompt_length", 3) // 3)
    with pytest.raises(UserError, match=message):
        run(redrafter, [prompt], **kwargs)


def test_plain_decoding_steps_across_the_cache_growth_boundary():
    """Root-only trees (no drafted node) whose block ends exactly where the KV
    buffer does: the accepted path never reaches past the block."""
    base = BaseModel(tiny_model("llama", seed=4))
    prompt = np.random.default_rng(0).integers(0, 256, size=250).tolist()
    reference = mlx_lm_greedy(base.model, prompt, 12)
    (tokens,), accepted = run(ReDrafter(base, None), [prompt], max_tokens=12, max_nodes=0, lookup=False)
    assert tokens == reference[:12] and set(accepted) == {0}


def test_prompts_that_join_and_leave_a_running_batch_decode_as_they_would_alone():
    from redrafter_mlx.engine.decoder import Decoder

    redrafter = ReDrafter(BaseModel(tiny_model("llama", seed=4)), tiny_drafter(seed=5))
    prompts = [[5, 17, 42, 99, 3], [7, 7, 8, 9, 10, 11, 12, 13, 14], [200, 3]]
    alone = [run(redrafter, [p], max_tokens=30)[0][0] for p in prompts]
    decoder = Decoder(redrafter, DraftSettings(), cost_batch_sizes=(1, 2, 4))
    tokens = {}

    def record(outputs):
        for out in outputs:
            tokens[out.row] = tokens.get(out.row, []) + out.tokens

    record(decoder.join(prompts[:1], 30))
    for _ in range(3):
        record(decoder.step())
    record(decoder.join(prompts[1:], [30, 30], ids=[1, 2]))
    record(decoder.step())
    decoder.leave([1])
    while decoder.rows or not tokens:
        outputs = decoder.step()
        if not outputs:
            break
        record(outputs)
    assert tokens[0] == alone[0] and tokens[2] == alone[2]
    assert 1 <= len(tokens[1]) < 30 and tokens[1] == alone[1][: len(tokens[1])]
    assert decoder.rows == [] and decoder.tracker.context == {}


def test_prompts_join_a_batch_whose_beams_the_budget_shortened():
    """Earlier runs kept RNN nodes at depth 1 only, so searches stop there
    (beams of length 2, but for every 16th): prompts joining the running
    batch search as long, and every row still decodes as it would alone."""
    redrafter = ReDrafter(BaseModel(tiny_model("llama", seed=4)), tiny_drafter(seed=5))
    prompts = [[5, 17, 42, 99, 3], [7, 7, 8, 9, 10, 11, 12, 13, 14]]
    alone = [run(redrafter, [p], max_tokens=30, max_nodes=4)[0][0] for p in prompts]
    redrafter.acceptance.kept_depths.extend([{1}] * 8)
    decoder = Decoder(redrafter, DraftSettings(max_nodes=4), cost_batch_sizes=(1, 2))
    tokens, lengths = {}, []

    def record(outputs):
        for out in outputs:
            tokens[out.row] = tokens.get(out.row, []) + out.tokens
        lengths.append(decoder.speculator.last.search_length if decoder.speculator.last else None)

    record(decoder.join(prompts[:1], 30))
    for _ in range(3):
        record(decoder.step())
    assert decoder.beams.length == 2
    record(decoder.join(prompts[1:], 30, ids=[1]))
    while decoder.rows:
        outputs = decoder.step()
        if not outputs:
            break
        record(outputs)
    assert tokens[0] == alone[0] and tokens[1] == alone[1]
    assert 2 in lengths and 5 in lengths


def test_a_step_synchronises_once(monkeypatch):
    """One mx.eval per verification step: what was accepted and the next
    beams, together."""
    import redrafter_mlx.engine.decoder as decoder_module

    base = BaseModel(tiny_model("llama", seed=2))
    decoder = Decoder(ReDrafter(base, tiny_drafter(seed=2)), DraftSettings(max_nodes=6), cost_batch_sizes=(2,))
    decoder.join([[5, 6, 7, 5, 6], [9, 3]], 20)
    calls = []
    original = mx.eval
    monkeypatch.setattr(decoder_module.mx, "eval", lambda *arrays: calls.append(1) or original(*arrays))
    for _ in range(5):
        decoder.step()
    assert len(calls) == 5


@pytest.mark.parametrize(
    "settings",
    [dict(temp=0.0), dict(temp=0.8, top_p=0.9), dict(temp=0.8, repetition_penalty=1.3)],
    ids=["greedy", "sampled", "penalty"],
)
def test_plain_steps_run_ahead_and_equal_plain_decoding_with_rows_joining_and_leaving(settings):
    """With nothing drafted (max_nodes 0), each step's pass is issued
    before the last token is read (except when a repetition penalty must
    read it); rows of different lengths, a row joining with a pass in
    flight and rows finishing early all decode as plain decoding does."""
    from redrafter_mlx.engine.autoregressive import autoregressive_steps
    from redrafter_mlx.engine.sampling import SamplingSettings, make_chooser, row_seed

    base = BaseModel(tiny_model("llama", seed=9))
    prompts = [[5, 17, 42, 99, 3], [9, 8], [100, 101, 102, 1, 2, 3, 4]]
    limits = [30, 12, 30]
    choose = make_chooser(SamplingSettings(**settings, seed=5))
    plain = [[] for _ in prompts]
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        for step in autoregressive_steps(
            base,
            [prompt],
            max_tokens=limit,
            choose=make_chooser(SamplingSettings(**settings, row_seeds=[row_seed(5, i)])),
        ):
            plain[i] += step[0].tokens
    decoder = Decoder(ReDrafter(base, None), DraftSettings(max_nodes=0), choose)
    got, ahead = {}, []

    def record(outputs):
        for out in outputs:
            got.setdefault(out.row, []).extend(out.tokens)

    record(decoder.join(prompts[:2], limits[:2]))
    for _ in range(5):
        record(decoder.step())
        ahead.append(decoder.ahead is not None)
    record(decoder.join(prompts[2:], limits[2:], ids=[2]))
    while decoder.rows:
        record(decoder.step())
        ahead.append(decoder.ahead is not None)
    assert [got[i] for i in range(3)] == plain
    assert any(ahead) == ("repetition_penalty" not in settings)


def test_each_step_is_sized_by_the_curve_at_its_context():
    """Where a pass behind a long context costs far more, a prompt that
    long decodes plainly from its first step, while a short one drafts; the
    tokens are the same as plain decoding's either way."""
    from redrafter_mlx.drafting.cost import CostCurve

    model = tiny_model()
    base = BaseModel(model)
    redrafter = ReDrafter(base, None)
    curve = CostCurve(
        [1, 2, 4, 8, 16], [1.0, 1.01, 1.02, 1.03, 1.05], long_context=512, long_sizes=[1, 16], long_seconds=[1.0, 50.0]
    )
    short = [5, 6, 7, 8] * 8  # lookup drafts the repeats
    long = (short * 20)[:600]
    for prompt, drafts in ((short, True), (long, False)):
        decoder = Decoder(redrafter, DraftSettings(), cost_curve=curve)
        outputs = decoder.join([prompt], 24)
        tokens, drafted = [], False
        while outputs:
            tokens += [t for out in outputs for t in out.tokens]
            drafted |= any((out.num_nodes or 1) > 1 for out in outputs)
            outputs = decoder.step()
        assert drafted == drafts
        assert tokens == mlx_lm_greedy(model, prompt, 24)


def test_a_profiled_run_times_each_phase_and_decodes_the_same():
    """A ``StepProfile`` synchronises at every phase (so no plain pass runs
    ahead) and counts the steps; the tokens are those of a run without one."""
    from redrafter_mlx.engine.profile import StepProfile

    base = BaseModel(tiny_model("llama", seed=2))
    redrafter = ReDrafter(base, tiny_drafter(seed=2))
    prompts = [[5, 6, 7, 5, 6], [9, 3]]
    for settings in (DraftSettings(max_nodes=6), DraftSettings(max_nodes=0)):
        plain, _ = run(redrafter, prompts, max_tokens=12, draft=settings)
        profile = StepProfile()
        profiled, _ = run(redrafter, prompts, max_tokens=12, draft=settings, profile=profile)
        assert profiled == plain
        assert profile.steps > 0 and profile.seconds["prefill"] > 0 and profile.seconds["pass"] > 0
        assert (profile.seconds["commit"] > 0) == (settings.max_nodes > 0)
