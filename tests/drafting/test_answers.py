"""The store of earlier answers: what it proposes, how it stays bounded, and
that drafting from it leaves the output unchanged."""

from conftest import mlx_lm_greedy, run, tiny_model
from redrafter_mlx.drafting.answers import AnswerStore, answer_store
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.types import ReDrafter


def test_proposes_what_followed_the_longest_matching_suffix_with_shares():
    store = AnswerStore(1000)
    store.add([1, 2, 3, 4, 5])
    store.add([9, 2, 3, 4, 6])
    store.add([7, 3, 8])
    # (2, 3) occurred twice, followed by 4 both times, then 5 once and 6 once.
    assert store.propose([0, 2, 3], 3) == [([4, 5], [2 / 3, 1 / 3], 2)]
    # (3,) alone: followed by 4, 4 and 8.
    ((tokens, shares, n),) = store.propose([5, 3], 1, beams=1)
    assert (tokens, n) == ([4], 1) and shares == [2 / 4]
    assert [p[0] for p in store.propose([5, 3], 1, beams=2)] == [[4], [8]]
    assert store.propose([42], 4) == []  # never seen
    assert store.propose([4, 5], 4) == []  # an answer's end: nothing follows it


def test_stays_within_its_size_dropping_the_oldest_answers():
    store = AnswerStore(40)
    for i in range(10):
        store.add([100 + i, 1, 2, 3, 4, 5, 6, 7, 100 + i])
        assert len(store.tokens) <= 40
    assert store.propose([109], 2) == [([1, 2], [0.5, 0.5], 1)]  # the newest answer is kept
    assert store.propose([100], 2) == []  # the oldest is gone, from the index too
    assert store.propose([6, 7], 1) == [([106], [0.2], 2)]  # the four answers kept, 106 .. 109, one each
    store.add(list(range(60)))  # larger than the store: not kept
    assert store.propose([10], 1) == []
    assert answer_store(0) is None and answer_store(1).max_tokens > 1000


def test_a_repeated_request_drafts_from_the_first_answer_and_keeps_the_output():
    base = BaseModel(tiny_model("llama", seed=3))
    prompt = [5, 17, 42, 99, 3, 250, 7, 18]
    expected = mlx_lm_greedy(base.model, prompt, 40)
    redrafter = ReDrafter(base, None, answers=AnswerStore(10_000))
    first, first_accepted = run(redrafter, [prompt], max_tokens=40, lookup=False, max_nodes=8)
    second, second_accepted = run(redrafter, [prompt + [1]], max_tokens=40, lookup=False, max_nodes=8)
    again, again_accepted = run(redrafter, [prompt], max_tokens=40, lookup=False, max_nodes=8)
    assert first == [expected] and again == [expected]
    assert sum(first_accepted) == 0  # nothing to draft from yet, without lookup
    assert sum(again_accepted) > 20  # the first answer, drafted again
    assert len(redrafter.answers) >= 3 * 39
