"""Acceptance: walk the verified tree along the base model's own choices.

The base model picks one token after every tree node (``node_choices``: the
argmax when greedy, one sample per node otherwise). Starting at the root, the
walk descends to the child holding the chosen token, as long as there is one;
the first choice with no matching child is the bonus token. In beam
coordinates: beam w is followed for as long as each drafted token equals the
base model's choice at the node before it; the walk ends on the beam followed
furthest.

Because each node gets exactly one choice, shared prefixes are judged once and
all beams through a node agree. With sampled choices this is exact sampling:
the drafts are a deterministic function of the context, so the emitted tokens
have precisely the base model's distribution.
"""

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class Acceptance:
    """The outcome of one step, per row.

    num_accepted: (B,) drafted tokens accepted, 0 .. beam_length - 1.
    tokens: (B, beam_length) the accepted drafted tokens followed by the bonus
        token; only the first num_accepted + 1 are meaningful.
    path: (B, beam_length) packed tree indices of the root and the accepted
        nodes (the KV entries to keep); the first num_accepted + 1 count.
    next_hidden: (B, hidden_size) hidden state at the last accepted node.
    next_token: (B,) the bonus token, column 0 of the next step's beams.
    """

    num_accepted: mx.array
    tokens: mx.array
    path: mx.array
    next_hidden: mx.array
    next_token: mx.array


def accept(beams: mx.array, unpack: mx.array, node_choices: mx.array, hidden: mx.array) -> Acceptance:
    """Args:
    beams: (B, W, L) drafted beams, column 0 the previous bonus token.
    unpack: (B, W, L) packed node index of each beam position.
    node_choices: (B, N) the base model's token after each packed node.
    hidden: (B, N, hidden_size) the base model's hidden state at each node.
    """
    batch, width, length = beams.shape
    choice_at = mx.take_along_axis(node_choices, unpack.reshape(batch, -1), axis=-1)
    choice_at = choice_at.reshape(batch, width, length)  # choice after each beam position
    matches = (beams[..., 1:] == choice_at[..., :-1]).astype(mx.int32)
    accepted_per_beam = mx.cumprod(matches, axis=-1).sum(axis=-1)  # (B, W)
    best = mx.argmax(accepted_per_beam, axis=-1)[:, None]  # (B, 1), first of the longest
    num_accepted = mx.take_along_axis(accepted_per_beam, best, axis=-1)[:, 0]

    path = mx.take_along_axis(unpack, best[:, :, None], axis=1)[:, 0]  # (B, L)
    best_choices = mx.take_along_axis(choice_at, best[:, :, None], axis=1)[:, 0]
    next_token = mx.take_along_axis(best_choices, num_accepted[:, None], axis=-1)[:, 0]
    best_beam = mx.take_along_axis(beams, best[:, :, None], axis=1)[:, 0]
    drafted = mx.concatenate([best_beam[:, 1:], best_beam[:, :1]], axis=-1)
    tokens = mx.where(mx.arange(length)[None] == num_accepted[:, None], next_token[:, None], drafted)
    last_node = mx.take_along_axis(path, num_accepted[:, None], axis=-1)  # (B, 1)
    next_hidden = mx.take_along_axis(hidden, last_node[:, :, None], axis=1)[:, 0]
    return Acceptance(num_accepted, tokens, path, next_hidden, next_token)
