"""Context lookup on hand-made contexts."""

from redrafter_mlx.drafting.lookup import LookupIndex


def test_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    context = [1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]
    index = LookupIndex(context, max_ngram=3)
    # (5, 2, 3) never occurred before; (2, 3) last did at 5..6, followed by 8, 5, 2.
    assert index.propose(3) == [([8, 5, 2], 2)]


def test_never_proposes_past_the_known_context_and_grows_incrementally():
    context = [4, 5, 6, 4]
    index = LookupIndex(context, max_ngram=3)
    assert index.propose(5) == [([5, 6, 4], 1)]
    context += [5]  # the caller appends committed tokens
    assert index.propose(5) == [([6, 4, 5], 2)]
    context += [7]
    assert index.propose(5) == []  # 7 never occurred before
    assert index.indexed == len(context) - 1


def test_index_work_per_token_is_bounded():
    context = list(range(50)) * 4
    index = LookupIndex(context, max_ngram=3)
    index.propose(4)
    assert index.table[(0, 1, 2)] == 153  # only the latest position per n-gram, after its last occurrence
    assert len(index.table) == 3 * 50  # one entry per distinct n-gram, however long the context
    assert index.propose(4) == [([0, 1, 2, 3], 3)]
