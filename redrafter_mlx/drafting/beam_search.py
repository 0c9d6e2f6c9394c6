"""Beam search with the recurrent drafter.

All beams of all rows advance together; nothing here reads a value back to
the host, so a whole search is one lazy graph.
"""

from typing import Callable, Optional, Protocol

import mlx.core as mx

from .tree import NO_TOKEN


class SearchDrafter(Protocol):
    """What the search asks of a drafter (``drafter.Drafter``; tests pass
    doubles that draft known sequences)."""

    draft_vocab_size: int

    def update_state(self, token_embeddings: mx.array, state: Optional[mx.array]) -> mx.array:
        """One RNN step, (..., hidden_size); ``state`` None: the initial state."""

    def read_hidden(self, hidden: mx.array) -> mx.array:
        """h's share of every depth, worked out once per search."""

    def search_log_probs(self, read: mx.array, state: mx.array, rows: Optional[int] = None) -> mx.array:
        """Log-probabilities over the draft vocabulary (or its first ``rows``)."""

    def token_ids(self, draft_indices: mx.array) -> mx.array:
        """Base-model token ids of draft-vocabulary indices."""


def _top_k(scores: mx.array, k: int) -> mx.array:
    """Indices of the k largest scores along the last axis, best first.
    (..., n) -> (..., k)."""
    top = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    order = mx.argsort(-mx.take_along_axis(scores, top, axis=-1), axis=-1)
    return mx.take_along_axis(top, order, axis=-1)


def beam_search(
    drafter: SearchDrafter,
    embed: Callable[[mx.array], mx.array],
    hidden: mx.array,
    first_tokens: mx.array,
    beam_width: int,
    beam_length: int,
    later_rows: Optional[int] = None,
    partial: bool = False,
    first_rows: Optional[int] = None,
) -> tuple[mx.array, mx.array]:
    """Draft ``beam_width`` continuations of ``beam_length - 1`` tokens.

    Args:
        drafter: the recurrent drafter.
        embed: the base model's input embedding, token ids (...) -> (..., hidden_size).
        hidden: (batch, hidden_size), the base model's last hidden state at the
            last token already in the KV cache.
        first_tokens: (batch,), the token the base model chose after it; it
            becomes column 0 of every beam.
        beam_width, beam_length: beam shape; beam_length >= 2.
        later_rows: the drafted tokens after the first come from the first
            ``later_rows`` entries of the draft vocabulary only (its most
            frequent tokens, the order ``train`` gives a reduced one), which
            cuts the vocabulary projection that bounds the search; None
            scores all. first_rows: the same for the first drafted token.
        partial: also return the partial beams the search held at each
            depth before the last (what a search of that length would
            return), which the final beams need not extend: the nodes the
            search found most likely at a depth, whatever became of them.

    Returns:
        beams: (batch, beam_width, beam_length) int32 token ids, best beam
            first; with ``partial``, the final beams, then the partial
            beams of 1, 2, ... beam_length - 2 drafted tokens (as many as
            the final ones, beam_width * (beam_length - 1) rows in all
            unless the draft vocabulary is smaller than the width), each
            padded with ``NO_TOKEN``.
        draft_logprobs: (batch, rows of beams, beam_length - 1), the
            drafter's log-probability of each drafted token (-inf past a
            partial beam's end).
    """
    batch = first_tokens.shape[0]
    width = min(beam_width, drafter.draft_vocab_size, first_rows or beam_width)
    hidden = drafter.read_hidden(hidden)[:, None, :]  # (B, 1, E): h's share of every depth, once

    # The first drafted token: one beam expands into `width` beams.
    state = drafter.update_state(embed(first_tokens)[:, None, :], None)  # (B, 1, D)
    logprobs = drafter.search_log_probs(hidden, state, first_rows)[:, 0]  # (B, V or first_rows)
    draft_index = _top_k(logprobs, width)  # (B, W)
    scores = mx.take_along_axis(logprobs, draft_index, axis=-1)
    tokens = drafter.token_ids(draft_index).astype(mx.int32)
    beams = mx.stack([mx.broadcast_to(first_tokens[:, None], (batch, width)), tokens], -1)
    token_logprobs = scores[..., None]
    state = mx.broadcast_to(state, (batch, width, state.shape[-1]))
    hidden = mx.broadcast_to(hidden, (batch, width, hidden.shape[-1]))
    held = []  # the partial beams, with their log-probabilities

    for _ in range(beam_length - 2):
        held.append((beams, token_logprobs))
        state = drafter.update_state(embed(beams[..., -1]), state)  # (B, W, D)
        logprobs = drafter.search_log_probs(hidden, state, later_rows)  # (B, W, V or later_rows)
        vocab = logprobs.shape[-1]
        candidates = (scores[..., None] + logprobs).reshape(batch, -1)  # (B, W*V)
        best = _top_k(candidates, width)  # (B, W)
        parent, draft_index = best // vocab, best % vocab
        scores = mx.take_along_axis(candidates, best, axis=-1)
        step_logprobs = mx.take_along_axis(logprobs.reshape(batch, -1), best, axis=-1)
        tokens = drafter.token_ids(draft_index).astype(mx.int32)
        beams = mx.concatenate([mx.take_along_axis(beams, parent[..., None], axis=1), tokens[..., None]], -1)
        token_logprobs = mx.concatenate(
            [mx.take_along_axis(token_logprobs, parent[..., None], axis=1), step_logprobs[..., None]],
            -1,
        )
        state = mx.take_along_axis(state, parent[..., None], axis=1)

    if width < beam_width:  # tiny draft vocabularies: repeat the last beam
        pad = beam_width - width
        beams = mx.concatenate([beams, mx.repeat(beams[:, -1:], pad, axis=1)], axis=1)
        token_logprobs = mx.concatenate([token_logprobs, mx.repeat(token_logprobs[:, -1:], pad, axis=1)], axis=1)
    if partial:
        widths = [[(0, 0), (0, 0), (0, beam_length - b.shape[-1])] for b, _ in held]
        beams = mx.concatenate(
            [beams] + [mx.pad(b, w, constant_values=NO_TOKEN) for (b, _), w in zip(held, widths)], axis=1
        )
        token_logprobs = mx.concatenate(
            [token_logprobs] + [mx.pad(lp, w, constant_values=-mx.inf) for (_, lp), w in zip(held, widths)], axis=1
        )
    return beams, token_logprobs
