"""Beam search against a brute-force enumeration on a tiny drafter."""

import itertools

import mlx.core as mx
import numpy as np

from conftest import HIDDEN, tiny_drafter
from redrafter_mlx.drafting.beam_search import beam_search


def sequence_logprob(drafter, embed, hidden, tokens):
    draft_index = {t: i for i, t in enumerate(np.array(drafter.draft_token_ids).tolist())}
    state, per_token = None, []
    for prev, nxt in zip(tokens[:-1], tokens[1:]):
        state = drafter.update_state(embed(mx.array([prev])), state)
        logprobs = drafter.log_probs(hidden[None], state)[0]
        per_token.append(logprobs[draft_index[nxt]].item())
    return sum(per_token), per_token


def test_beams_are_the_best_scoring_sequences_of_a_small_vocabulary():
    """With draft vocabulary V=6 and width >= V, beam search up to depth 2
    is exhaustive over the first token, so the top beams are exactly the
    best sequences found by enumeration, in order."""
    drafter = tiny_drafter(seed=3, draft_vocab=6)
    mx.random.seed(5)
    table = mx.random.normal((256, HIDDEN))
    embed = lambda t: table[t]
    hidden = mx.random.normal((2, HIDDEN))
    first = mx.array([11, 12])
    beams, logprobs = beam_search(drafter, embed, hidden, first, beam_width=6, beam_length=3)
    assert beams.shape == (2, 6, 3) and logprobs.shape == (2, 6, 2)
    vocab = np.array(drafter.draft_token_ids).tolist()
    for row in range(2):
        scored = []
        for a, b in itertools.product(vocab, vocab):
            seq = [first[row].item(), a, b]
            scored.append((sequence_logprob(drafter, embed, hidden[row], seq)[0], seq))
        scored.sort(key=lambda x: -x[0])
        assert beams[row].tolist() == [seq for _, seq in scored[:6]]
        for w in range(6):
            _, per_token = sequence_logprob(drafter, embed, hidden[row], beams[row, w].tolist())
            assert np.allclose(logprobs[row, w].tolist(), per_token, atol=1e-5)


def test_column_zero_is_the_given_token_and_drafts_come_from_the_draft_vocabulary():
    drafter = tiny_drafter(seed=4, draft_vocab=10)
    table = mx.random.normal((256, HIDDEN))
    beams, _ = beam_search(drafter, lambda t: table[t], mx.random.normal((3, HIDDEN)), mx.array([1, 2, 3]), 4, 5)
    assert beams[:, :, 0].tolist() == [[1] * 4, [2] * 4, [3] * 4]
    allowed = set(np.array(drafter.draft_token_ids).tolist())
    assert set(np.array(beams[:, :, 1:]).ravel().tolist()) <= allowed
    # Beams are distinct sequences.
    for row in np.array(beams):
        assert len({tuple(b) for b in row}) == 4


def test_later_rows_draft_the_tokens_after_the_first_from_the_first_rows_only():
    """With later_rows R, the second and later drafted tokens are among the
    first R draft-vocabulary rows, scored as a drafter whose vocabulary ends
    there would score them; the first token may be any row."""
    drafter = tiny_drafter(seed=6, draft_vocab=40)
    table = mx.random.normal((256, HIDDEN))
    embed = lambda t: table[t]
    hidden, first = mx.random.normal((3, HIDDEN)), mx.array([1, 2, 3])
    ids = np.array(drafter.draft_token_ids).tolist()
    beams, logprobs = beam_search(drafter, embed, hidden, first, 4, 4, later_rows=5)
    assert set(np.array(beams[:, :, 2:]).ravel().tolist()) <= set(ids[:5])
    full, _ = beam_search(drafter, embed, hidden, first, 4, 4)
    assert not set(np.array(full[:, :, 2:]).ravel().tolist()) <= set(ids[:5])  # the restriction changed something
    # The depth-2 log-probabilities are normalised over the 5 rows.
    state = drafter.update_state(embed(beams[:, :, 1]), drafter.update_state(embed(first)[:, None], None))
    logits = drafter.draft_logits(mx.broadcast_to(hidden[:, None], state.shape), state)[..., :5]
    expected = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    index = mx.array([[ids.index(t) for t in row] for row in np.array(beams[:, :, 2]).tolist()])
    assert np.allclose(
        np.array(logprobs[:, :, 1]), np.array(mx.take_along_axis(expected, index[..., None], -1)[..., 0]), atol=1e-5
    )
    same, _ = beam_search(drafter, embed, hidden, first, 4, 4, later_rows=40)
    assert same.tolist() == full.tolist()


def test_partial_beams_are_what_shorter_searches_return():
    """With ``partial``, the final beams come first, unchanged, then the
    partial beams of 1, 2, ... drafted tokens: exactly the beams (and
    log-probabilities) of a search that stops at that length, padded."""
    drafter = tiny_drafter(seed=7, draft_vocab=30)
    table = mx.random.normal((256, HIDDEN))
    embed = lambda t: table[t]
    hidden, first = mx.random.normal((2, HIDDEN)), mx.array([4, 9])
    beams, logprobs = beam_search(drafter, embed, hidden, first, 3, 5, partial=True)
    assert beams.shape == (2, 12, 5) and logprobs.shape == (2, 12, 4)
    final, final_logprobs = beam_search(drafter, embed, hidden, first, 3, 5)
    assert beams[:, :3].tolist() == final.tolist()
    assert np.allclose(np.array(logprobs[:, :3]), np.array(final_logprobs))
    for drafted in (1, 2, 3):
        rows = slice(3 * drafted, 3 * drafted + 3)
        short, short_logprobs = beam_search(drafter, embed, hidden, first, 3, drafted + 1)
        assert beams[:, rows, : drafted + 1].tolist() == short.tolist()
        assert (np.array(beams[:, rows, drafted + 1 :]) == -1).all()
        assert np.allclose(np.array(logprobs[:, rows, :drafted]), np.array(short_logprobs), atol=1e-6)
        assert np.isneginf(np.array(logprobs[:, rows, drafted:])).all()
    # The search held beams that no final beam extends: the reason to keep them.
    finals = {tuple(b[:3]) for b in np.array(beams[:, :3]).reshape(-1, 5).tolist()}
    held = {tuple(b[:3]) for b in np.array(beams[:, 6:9]).reshape(-1, 5).tolist()}
    assert held - finals
