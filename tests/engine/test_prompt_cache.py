"""Prompt caches: a conversation's next turn prefills only what is new and
gives what a full prefill gives; caches save, load and are refused by
another model; the server's store keeps the most useful ones."""

import mlx.core as mx
import pytest

from conftest import tiny_drafter, tiny_model
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.decoder import generate_steps
from redrafter_mlx.engine.prompt_cache import PromptCache, load_prompt_cache, make_prompt_cache, save_prompt_cache
from redrafter_mlx.engine.types import ReDrafter
from redrafter_mlx.errors import UserError
from redrafter_mlx.serving.cache_store import PromptCacheStore

TURNS = [[5, 17, 42, 99, 3, 250, 7, 18], [11, 12, 13], [200, 201, 5, 17, 42], [9]]


def run(redrafter, prompt, cache=None, max_tokens=24, **kwargs):
    tokens = []
    for (out,) in generate_steps(
        redrafter, [prompt], max_tokens=max_tokens, prompt_caches=None if cache is None else [cache], **kwargs
    ):
        tokens += out.tokens
    return tokens


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen3_next", "nemotron_h"])
def redrafter(request):
    # gemma3's sliding-window layers see only the last 8 positions; the
    # hybrids keep recurrent states, reused whole or not at all.
    return ReDrafter(BaseModel(tiny_model(request.param, seed=3)), tiny_drafter(seed=2), identity=request.param)


def test_turns_from_the_cache_equal_full_prefills(redrafter):
    cache, prompt = make_prompt_cache(), []
    for turn in TURNS:
        prompt = prompt + turn
        reused = cache.reusable(prompt)
        with_cache = run(redrafter, prompt, cache)
        assert with_cache == run(redrafter, prompt)
        # It holds the conversation, up to the last token at least.
        assert cache.tokens == (prompt + with_cache)[: len(cache)] and len(cache) >= len(prompt + with_cache) - 1
        assert reused >= len(prompt) - len(turn) - 1  # all of the previous turns but perhaps their last token
        prompt = prompt + with_cache


def test_an_interrupted_generation_leaves_a_consistent_cache(redrafter):
    cache, prompt = make_prompt_cache(), TURNS[0]
    steps = generate_steps(redrafter, [prompt], max_tokens=40, prompt_caches=[cache])
    shown = []
    for _, (out,) in zip(range(3), steps):
        shown += out.tokens
    steps.close()
    assert cache.tokens == (prompt + shown)[: len(cache)]
    # The caller showed fewer tokens than were committed; the next turn uses what they share.
    following = prompt + shown[:-1] + TURNS[1]
    assert run(redrafter, following, cache) == run(redrafter, following)


def test_a_cache_saves_and_loads(redrafter, tmp_path):
    cache = make_prompt_cache()
    first = run(redrafter, TURNS[0], cache)
    path = tmp_path / "conversation.safetensors"
    save_prompt_cache(str(path), cache, {"note": "turn 1"})
    loaded, metadata = load_prompt_cache(str(path), return_metadata=True)
    assert metadata == {"note": "turn 1"} and loaded.tokens == cache.tokens and loaded.model == redrafter.identity
    following = TURNS[0] + first + TURNS[1]
    assert run(redrafter, following, loaded) == run(redrafter, following)


def test_bad_cache_files_and_another_models_cache_are_refused(redrafter, tmp_path):
    cache = make_prompt_cache()
    run(redrafter, TURNS[0], cache, max_tokens=4)
    other = ReDrafter(redrafter.base, redrafter.drafter, identity="another model")
    with pytest.raises(UserError, match="another model"):
        run(other, TURNS[0] + [1, 2], cache)
    bad = tmp_path / "bad.safetensors"
    bad.write_text("not a cache")
    with pytest.raises(UserError, match="cannot read the prompt cache"):
        load_prompt_cache(str(bad))
    with pytest.raises(UserError, match="ends in .safetensors"):
        save_prompt_cache(str(tmp_path / "cache.bin"), cache)


def entry(tokens):
    kv = [mx.zeros((1, 1, len(tokens), 4))]  # 16 bytes per token
    return PromptCache(tokens, kv, kv)


def test_the_store_finds_the_longest_shared_prefix_and_keeps_within_its_memory():
    store = PromptCacheStore(max_bytes=32 * 10, min_reuse=1)  # ten tokens
    store.add(entry([1, 2, 3]))
    store.add(entry([7, 8]))
    assert store.reusable([1, 2, 3, 4]) == 3 and [e.tokens for e in store.entries] == [
        [1, 2, 3],
        [7, 8],
    ]  # a look changes nothing
    assert store.find([1, 2, 3, 4]).tokens == [1, 2, 3]
    assert store.find([5]) is None and store.reusable([5]) == 0
    store.add(entry([1, 2, 3, 4, 5]))  # the next turn replaces the one it extends
    assert [e.tokens for e in store.entries] == [[7, 8], [1, 2, 3, 4, 5]]
    store.add(entry([9, 9, 9, 9]))  # over the limit: the least recently used goes
    assert [e.tokens for e in store.entries] == [[1, 2, 3, 4, 5], [9, 9, 9, 9]]
    store.add(entry(list(range(11))))  # larger than the whole store: its start is kept
    assert [e.tokens for e in store.entries] == [list(range(10))] and store.nbytes == 32 * 10


def test_over_its_memory_the_store_keeps_prefixes_sessions_share_before_their_tails():
    """Two sessions of an agent share their instructions (tokens 0-5); over
    the limit, a finished session's own turns go before that shared start."""
    store = PromptCacheStore(max_bytes=32 * 20, min_reuse=1)
    instructions = list(range(6))
    store.add(entry(instructions + [50, 51, 52, 53]))  # session A's first turn
    assert store.find(instructions + [60, 61]).tokens[:6] == instructions  # session B starts from A's instructions
    assert store.shared[id(store.entries[0])] == 6
    session_b = instructions + [60, 61, 62, 63, 64, 65]
    store.add(entry(session_b))  # B's first turn: 22 tokens held, over 20
    assert [e.tokens for e in store.entries] == [session_b]  # A's own turn went; the start it shares is in B
    store.add(entry([9] * 10))  # something else, over 20 again: B's own turn goes, the shared start stays
    assert [e.tokens for e in store.entries] == [instructions, [9] * 10] and store.nbytes == 32 * 16
    assert store.find(instructions + [70]).tokens == instructions  # a third session still starts from them


def test_a_prompt_sharing_only_the_first_token_neither_matches_nor_makes_the_latest_turn_go_first():
    """An earlier request, then an agent's turns 2 and 3 (3 extends 2's
    prompt, not 2's answer), then one that shares only the first token:
    over the limit, the least recently used go first (the earlier request,
    then turn 2, whose start turn 3 holds), and turn 3 stays whole."""
    store = PromptCacheStore(max_bytes=32 * 36, min_reuse=2)
    store.add(entry([1, 70, 71, 72, 73, 74, 75, 76]))  # an earlier, unrelated request
    turn2 = [1] + list(range(10, 20))
    store.add(entry(turn2 + [90, 91]))  # turn 2 and its answer
    turn3 = turn2 + list(range(30, 40))
    assert len(store.find(turn3)) == 13
    store.add(entry(turn3 + [92, 93]))  # over 36: the earlier request goes
    assert [len(e) for e in store.entries] == [13, 23]
    assert store.find([1, 80, 81]) is None and [len(e) for e in store.entries] == [
        13,
        23,
    ]  # no match, nothing refreshed
    store.add(entry([1, 80, 81, 82, 83, 84, 85]))  # over 36 again: turn 2 goes, not turn 3's tail
    assert [len(e) for e in store.entries] == [23, 7] and store.find(turn3 + [50]).tokens[:21] == turn3


def test_a_recurrent_state_is_reused_whole_or_not_at_all(redrafter):
    if not redrafter.base.recurrent:
        pytest.skip("keys and values are reused as far as they are shared")
    cache = make_prompt_cache()
    answer = run(redrafter, TURNS[0], cache)
    held = len(cache.tokens)
    assert cache.reusable(TURNS[0] + answer + TURNS[1]) == held  # the next turn: all of it
    assert cache.reusable(TURNS[0][:-2] + TURNS[1]) == 0  # an edit: nothing
    assert cache.reusable(TURNS[0][:4]) == 0  # a shorter prompt: nothing
