"""Dynamic tree attention: deduplicate the beams' shared prefixes into one
prefix tree that the base model verifies in a single forward pass.

Beams ``Mars is a red / Mars is reddish when / Mars is dark red`` share
``Mars is``; packed, they are 8 nodes instead of 12. Node order is the beams'
row-major order restricted to the first occurrence of each prefix, so every
node comes after its ancestors and the root is node 0.
"""

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class Tree:
    """A batch of packed prefix trees, padded to ``nodes`` per row.

    tokens: (batch, nodes) token id of each node.
    depths: (batch, nodes) depth of each node; the root (beam column 0) is 0.
    mask: (batch, nodes, nodes) bool, node i may attend to node j: j is i or
        one of its ancestors, and j is a real node.
    unpack: (batch, beam_width, beam_length) index of the node holding each
        beam position, so ``tokens[unpack] == beams`` row by row.
    num_nodes: (batch,) number of real nodes; padding nodes follow them.
    """

    tokens: mx.array
    depths: mx.array
    mask: mx.array
    unpack: mx.array
    num_nodes: mx.array

    def truncate(self, nodes: int) -> "Tree":
        """Keep the first ``nodes`` nodes of every row (at least max(num_nodes))."""
        return Tree(
            self.tokens[:, :nodes],
            self.depths[:, :nodes],
            self.mask[:, :nodes, :nodes],
            self.unpack,
            self.num_nodes,
        )


def pack_beams(beams: mx.array) -> Tree:
    """Build the prefix tree of ``beams`` (batch, beam_width, beam_length).

    The result has beam_width * beam_length node slots per row (a static
    shape, so no host synchronisation); real nodes come first. Call
    ``Tree.truncate(max(num_nodes))`` once the counts are known.
    """
    batch, width, length = beams.shape
    slots = width * length
    # shared[b, v, w, l]: beams v and w agree on positions 0..l.
    same = beams[:, :, None, :] == beams[:, None, :, :]
    shared = mx.cumprod(same.astype(mx.int32), axis=-1).astype(mx.bool_)  # (B, W, W, L)
    # The first beam holding each prefix owns its node.
    owner = mx.argmax(shared, axis=2)  # (B, W, L)
    beam_index = mx.arange(width)[None, :, None]
    position = mx.arange(length)[None, None, :]
    is_node = (owner == beam_index).reshape(batch, slots)
    slot = (beam_index * length + position).reshape(1, slots)

    # Packed index of each real slot, and the slot behind each packed index.
    rank = mx.cumsum(is_node.astype(mx.int32), axis=-1) - 1  # (B, slots)
    owner_slot = (owner * length + position).reshape(batch, slots)
    unpack = mx.take_along_axis(rank, owner_slot, axis=-1).reshape(batch, width, length)
    order = mx.argsort(mx.where(is_node, slot, slot + slots), axis=-1)  # (B, slots)
    num_nodes = is_node.sum(axis=-1)

    # Ancestor-or-self in slot coordinates: slot (v, k) is an ancestor of
    # (w, l) when k <= l and the beams agree up to k.
    slot_beam, slot_pos = mx.arange(slots) // length, mx.arange(slots) % length
    ancestor = shared[:, slot_beam[:, None], slot_beam[None, :], slot_pos[None, :]]
    ancestor = ancestor & (slot_pos[None, :] <= slot_pos[:, None])  # (B, slots, slots)
    ancestor = mx.take_along_axis(ancestor, order[:, :, None], axis=1)
    ancestor = mx.take_along_axis(ancestor, order[:, None, :], axis=2)
    real = mx.arange(slots)[None, :] < num_nodes[:, None]
    mask = ancestor & real[:, None, :]

    flat = beams.reshape(batch, slots)
    tokens = mx.take_along_axis(flat, order, axis=-1)
    depths = (order % length).astype(mx.int32)
    return Tree(tokens, depths, mask, unpack, num_nodes)
