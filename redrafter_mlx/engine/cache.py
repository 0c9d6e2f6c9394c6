"""The KV cache for tree verification, plugged into unmodified mlx-lm models.

Every attention layer gets a ``TreeKVCache``; all of them share one
``CacheLayout`` that says where each row's committed tokens are, and what the
block being fed now is (a causal chunk of the prompt, or a packed tree). The
model sees the layout only through the cache interface mlx-lm models use:
``offset`` (RoPE positions), ``update_and_fetch`` and ``make_mask``.

Buffer layout, per row b of the batch::

    [ left padding | committed tokens | junk | block being verified ]
    0          pad[b]            length[b]    start      start + block

``start`` is the largest committed length; rows that accepted fewer tokens
than others have junk between their end and ``start``, which the mask hides.
A tree's accepted path is later copied to ``length[b]``, so a row's
committed tokens always stay contiguous, with position = index - pad[b].
"""

from abc import ABC, abstractmethod
from typing import NamedTuple, Optional

import mlx.core as mx
import numpy as np

STEP = 256  # grow buffers in multiples of this many positions, like mlx-lm


class Moves(NamedTuple):
    """What a commit copies in every layer: block positions ``first ..
    kept - 1`` of each row's path, either gathered by ``index`` (B, 1,
    kept - first, 1) from the block into one slice (rows that end where the
    block begins) or by ``source`` into ``target`` (B, 1, kept, 1) buffer
    positions; ``end``: one past the furthest position read."""

    first: int
    kept: int
    index: Optional[mx.array]
    source: Optional[mx.array]
    target: Optional[mx.array]
    end: int


class CacheLayout:
    """Host-side bookkeeping shared by all layers.

    left_padding, lengths: (batch,) numpy int arrays (see module docstring).
    Call ``begin_chunk`` or ``begin_tree`` before each forward pass and
    ``end_chunk`` or ``commit`` after it.
    """

    def __init__(self, left_padding: list[int]):
        self.left_padding = np.asarray(left_padding, dtype=np.int64)
        self.lengths = np.zeros_like(self.left_padding)
        self.offset = None  # what RoPE gets for the current block
        self._depths: Optional[mx.array] = None  # (B, N), tree mode only
        self._tree_mask: Optional[mx.array] = None  # (B, N, N), tree mode only
        self._masks: dict = {}
        self._moves = None  # (path, accepted, Moves or None) of the block being committed

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def start(self) -> int:
        return int(self.lengths.max())

    @property
    def aligned(self) -> bool:
        """Whether every row ends where the next block begins (no junk
        between a row's end and ``start``): always so at batch 1."""
        return bool((self.lengths == self.lengths.max()).all())

    @property
    def in_tree(self) -> bool:
        """Whether the block being fed is a tree (verification), not a prefill chunk."""
        return self._depths is not None

    def padding_mask(self, num_tokens: int) -> Optional[mx.array]:
        """(B, N) bool: which tokens of a prefill chunk are not left padding;
        None when all are (a tree's padding nodes come after its real ones,
        and the recurrent layers that ask are set right in ``commit_path``)."""
        if self.in_tree or int(self.left_padding.max()) <= self.start:
            return None
        positions = self.start + np.arange(num_tokens)
        return mx.array(positions[None, :] >= self.left_padding[:, None])

    def begin_chunk(self) -> None:
        """The next block is a causal chunk of the (left-padded) prompts. Only
        valid while all rows have the same length, i.e. before any tree."""
        assert (self.lengths == self.lengths[0]).all(), "chunks need aligned rows"
        self._depths = self._tree_mask = self._moves = None
        self._masks = {}
        positions = self.lengths - self.left_padding
        if self.batch_size == 1:
            self.offset = int(positions[0])
        else:
            self.offset = mx.array(positions, mx.int32)

    def end_chunk(self, num_tokens: int) -> None:
        self.lengths += num_tokens

    def begin_tree(self, depths: mx.array, tree_mask: mx.array) -> None:
        """The next block is a packed tree: depths (B, N), tree_mask (B, N, N)."""
        self._depths, self._tree_mask, self._masks, self._moves = depths, tree_mask, {}, None
        positions = mx.array(self.lengths - self.left_padding, mx.int32)
        self.offset = positions[:, None] + depths  # (B, N) per-token positions

    def commit(self, accepted: np.ndarray) -> None:
        """Rows advance by ``accepted`` (B,) tokens after a tree step."""
        self.lengths += accepted
        self._moves = None

    def moves(self, path: np.ndarray, accepted: np.ndarray) -> Optional["Moves"]:
        """What committing a verified block's paths moves, the same in every
        layer (worked out once a step, until ``commit``): None when each
        row's root and accepted nodes, ``path[b, : accepted[b] + 1]``, are
        in place already (the root alone, or a path packed in order at
        batch 1 or with aligned rows)."""
        if self._moves is not None and self._moves[0] is path and self._moves[1] is accepted:
            return self._moves[2]
        start, kept = self.start, int(accepted.max()) + 1
        source = start + path[:, :kept]
        target = self.lengths[:, None] + np.arange(kept)
        moves = None
        if not (source == target).all():
            if (self.lengths == start).all():
                first = int(np.argmax((source != target).any(axis=0)))
                index = mx.array(path[:, None, first:kept, None], mx.int32)
                moves = Moves(first, kept, index, None, None, int(source.max()) + 1)
            else:
                moves = Moves(
                    0,
                    kept,
                    None,
                    mx.array(source[:, None, :, None], mx.int32),
                    mx.array(target[:, None, :, None], mx.int32),
                    int(source.max()) + 1,
                )
        self._moves = (path, accepted, moves)
        return moves

    def window_start(self, window_size: Optional[int]) -> int:
        """The first buffer position a sliding-window layer reads for the
        block being fed: no query of any row sees a key before it (a row's
        first query, at its length, sees the ``window_size - 1`` keys before
        it). A windowed layer attends to its keys from here on, as mlx-lm's
        rotating cache keeps only its window; 0 without a window."""
        if window_size is None:
            return 0
        return max(int(self.lengths.min()) - window_size + 1, 0)

    def mask(self, num_tokens: int, window_size: Optional[int], return_array: bool = False) -> Optional[mx.array]:
        """(B, 1, N, start + N - window_start) bool: which keys each query of
        the block sees, of those its layer reads (``window_start`` on); None
        where one token of a chunk sees every key it reads (no left
        padding), as mlx-lm's own cache answers."""
        if num_tokens == 1 and self._depths is None and not return_array and not self.left_padding.any():
            return None
        if window_size not in self._masks:
            self._masks[window_size] = self._make_mask(num_tokens, window_size)
        return self._masks[window_size]

    def _make_mask(self, num_tokens: int, window_size: Optional[int]) -> mx.array:
        start = self.start
        keys = mx.arange(self.window_start(window_size), start + num_tokens)[None, None, :]  # (1, 1, S)
        pad = mx.array(self.left_padding, mx.int32)[:, None, None]
        length = mx.array(self.lengths, mx.int32)[:, None, None]
        block_index = keys - start
        committed = (keys >= pad) & (keys < length)  # (B, 1, S)
        if self._depths is None:
            query = mx.arange(num_tokens)[None, :, None]  # (1, N, 1)
            # A padding query sees itself only, so its softmax stays finite.
            block = (block_index >= 0) & (block_index <= query) & (keys >= pad)
            block = block | (block_index == query)
            query_pos = length - pad + query
            key_depth = block_index
        else:
            first = self.window_start(window_size)
            block = mx.pad(self._tree_mask, [(0, 0), (0, 0), (start - first, 0)])
            query_pos = length - pad + self._depths[:, :, None]
            key_depth = mx.pad(self._depths, [(0, 0), (start - first, 0)])[:, None, :]
        visible = committed | block
        if window_size is not None:
            key_pos = mx.where(block_index >= 0, length - pad + key_depth, keys - pad)
            visible = visible & (query_pos - key_pos < window_size)
        return visible[:, None]

    def filter(self, rows: list[int]) -> int:
        """Keep only these rows (finished rows leave the batch), then drop the
        padding columns that every remaining row has; returns how many."""
        self.left_padding = self.left_padding[rows]
        self.lengths = self.lengths[rows]
        trim = int(self.left_padding.min())
        self.left_padding -= trim
        self.lengths -= trim
        return trim

    def extend(self, other: "CacheLayout") -> tuple[int, int]:
        """Append the rows of another layout (prompts joining a batch between
        steps). Both sides' buffers are left-padded to the wider one,
        ``start`` positions; returns the padding added to (self, other)."""
        mine, theirs = self.start, other.start
        widest = max(mine, theirs)
        self.left_padding = np.concatenate([self.left_padding + widest - mine, other.left_padding + widest - theirs])
        self.lengths = np.concatenate([self.lengths + widest - mine, other.lengths + widest - theirs])
        return widest - mine, widest - theirs


class StepCache(ABC):
    """One layer's cache, whatever the layer keeps: keys and values
    (``TreeKVCache``), a recurrent state (``recurrent.RecurrentCache``), or
    nothing, for a layer another rank runs (``distributed.SkippedCache``).
    All the caches of a batch share its ``CacheLayout`` (``layout``, set by
    each concrete cache's constructor), which positions and masks come from.

    This declares everything asked of one layer's cache: by the model (an
    unmodified mlx-lm model calls ``offset``, ``make_mask`` and
    ``update_and_fetch`` as on its own caches; it may ask any layer's cache
    for a mask, as gemma3 does by index) and by the engine
    (``commit_path``, ``filter``, ``extend``, ``rows_kv``,
    ``state_arrays``). Every concrete cache implements every member; where
    its kind of layer is never asked for one, it refuses with an error
    saying why.

    Beyond this, mlx-lm's recurrent layers use their cache as an
    ``ArraysCache`` (``cache[i]`` reads and writes the i-th state array,
    ``lengths``, ``advance``): ``RecurrentCache`` is one, and no other
    layer asks that of its cache. mlx-lm also asks whether a cache has
    ``bits`` (a quantized cache, whose keys and values come packed): none
    has, so attention gets plain arrays. Shapes below: B rows, a block of
    N tokens, ``start`` = ``layout.start``.
    """

    layout: CacheLayout

    # -- what the model asks --------------------------------------------------

    @property
    @abstractmethod
    def offset(self):
        """The positions RoPE gives the block being fed (the layout's
        ``offset``): in a prefill chunk, the position of its first token,
        an int at batch 1 or (B,) int32 per row; in a tree, (B, N) int32,
        each token's position (its row's length, less padding, plus the
        token's depth)."""

    @abstractmethod
    def make_mask(
        self, num_tokens: int, return_array: bool = False, window_size: Optional[int] = None
    ) -> Optional[mx.array]:
        """The mask for a block of ``num_tokens`` tokens, as mlx-lm's mask
        builders ask for it. For attention (``create_attention_mask``):
        (B, 1, N, start + N - layout.window_start(window_size)) bool, which
        keys each query sees of those an attention layer with that window
        (None: none) reads, in the order ``update_and_fetch`` returns
        them; None where a single prefill token sees every key, unless
        ``return_array``. For a recurrent layer (``create_ssm_mask``, which
        passes ``num_tokens`` alone): (B, N) bool, which tokens of a
        prefill chunk are not left padding, or None where all are."""

    @abstractmethod
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """An attention layer's keys (B, kv_heads, N, key_dim) and values
        (B, kv_heads, N, value_dim) for the block being fed, stored at
        positions ``start .. start + N``; returns the keys and values the
        layer attends to, (B, kv_heads, S, dim) each, with S = start + N -
        ``layout.window_start(window)`` (every key before the block,
        committed, padding or junk, which ``make_mask`` hides, then the
        block's)."""

    # -- what the engine asks -------------------------------------------------

    @abstractmethod
    def commit_path(self, path: np.ndarray, accepted: np.ndarray) -> None:
        """After a verified block: keep each row's root and accepted nodes,
        the packed block indices ``path[b, : accepted[b] + 1]`` (host
        arrays (B, P) and (B,)), as the row's next committed tokens,
        before the layout advances the rows (``CacheLayout.commit``)."""

    @abstractmethod
    def filter(self, rows: mx.array, trim: int) -> None:
        """Keep the batch rows ``rows`` (K,) int, in that order, without
        their first ``trim`` positions (padding every kept row has; see
        ``CacheLayout.filter``)."""

    @abstractmethod
    def extend(self, other: "StepCache", length: int, other_length: int, pad: int, other_pad: int) -> None:
        """Append the rows of another batch's cache of the same layer: each
        side holds ``length`` / ``other_length`` positions, and is moved
        right by ``pad`` / ``other_pad`` (see ``extend_batch``)."""

    @abstractmethod
    def rows_kv(self, row: int, begin: int, end: int) -> tuple:
        """What a prompt cache keeps of one row whose committed tokens are
        buffer positions ``begin .. end``: keys and values (1, kv_heads,
        end - begin, dim) each, or (the state arrays, (1, ...) each, None)
        for a recurrent layer, whose state sums up those tokens."""

    @abstractmethod
    def state_arrays(self) -> list:
        """The arrays to evaluate so that the cache holds what was fed
        (empty when it keeps none)."""


class TreeKVCache(StepCache):
    """One layer's keys and values, (B, kv_heads, capacity, head_dim).

    window: a sliding-window layer's window (None: it reads every key). Its
    buffer keeps every key, as prompt caches reuse any prefix of it, but a
    pass reads only the keys its window reaches (``CacheLayout.window_start``):
    what it costs does not grow with the context."""

    def __init__(self, layout: CacheLayout, window: Optional[int] = None):
        self.layout, self.window = layout, window
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.block_end = 0  # where the block last fed ends

    @property
    def offset(self):
        return self.layout.offset

    def make_mask(
        self, num_tokens: int, return_array: bool = False, window_size: Optional[int] = None
    ) -> Optional[mx.array]:
        return self.layout.mask(num_tokens, window_size, return_array)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start, num_tokens = self.layout.start, keys.shape[2]
        end = start + num_tokens
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(keys, values, end)
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.block_end = end
        first = self.layout.window_start(self.window)
        return self.keys[..., first:end, :], self.values[..., first:end, :]

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        capacity = (needed + STEP - 1) // STEP * STEP
        batch, heads, _, key_dim = keys.shape
        new_keys = mx.zeros((batch, heads, capacity, key_dim), keys.dtype)
        new_values = mx.zeros((batch, heads, capacity, values.shape[3]), values.dtype)
        if self.keys is not None:
            old = self.keys.shape[2]
            new_keys[..., :old, :] = self.keys
            new_values[..., :old, :] = self.values
        self.keys, self.values = new_keys, new_values

    def commit_path(self, path: np.ndarray, accepted: np.ndarray) -> None:
        """Copy each row's root and accepted nodes, the packed block indices
        ``path[b, : accepted[b] + 1]`` (host arrays, (B, P) and (B,)), to
        the row's end, ``lengths[b]`` on (the caller then advances lengths).
        Nothing moves when they are in place already: the root alone, or a
        path packed in order, at batch 1 or with aligned rows."""
        moves = self.layout.moves(path, accepted)
        if moves is None:
            return
        start, first, kept = self.layout.start, moves.first, moves.kept
        # The gather and scatter below are not bounds-checked: sources must
        # stay inside the verified block.
        assert moves.end <= self.block_end, "path outside the verified block"
        if moves.index is not None:
            # Every row ends where the block begins (always so at batch 1):
            # the path is in place up to ``first``, and the rest is one slice
            # for all rows, written in place (a scatter into the whole buffer
            # copies it).
            for buffer in (self.keys, self.values):
                shape = (*buffer.shape[:2], kept - first, buffer.shape[3])
                moved = mx.take_along_axis(
                    buffer[..., start : self.block_end, :], mx.broadcast_to(moves.index, shape), axis=2
                )
                buffer[..., start + first : start + kept, :] = moved
            return
        for name in ("keys", "values"):
            buffer = getattr(self, name)
            shape = (*buffer.shape[:2], kept, buffer.shape[3])
            moved = mx.take_along_axis(buffer, mx.broadcast_to(moves.source, shape), axis=2)
            setattr(self, name, mx.put_along_axis(buffer, mx.broadcast_to(moves.target, shape), moved, axis=2))

    def filter(self, rows: mx.array, trim: int) -> None:
        """Keep ``rows``, without their first ``trim`` (padding) positions."""
        self.keys, self.values = self.keys[rows, :, trim:], self.values[rows, :, trim:]

    def extend(self, other: "TreeKVCache", length: int, other_length: int, pad: int, other_pad: int) -> None:
        """Append another cache's rows, each side holding ``length`` /
        ``other_length`` positions and moved right by ``pad`` / ``other_pad``."""

        def shifted(buffer, used, shift):
            return mx.pad(buffer[..., :used, :], [(0, 0), (0, 0), (shift, 0), (0, 0)])

        self.keys = mx.concatenate([shifted(self.keys, length, pad), shifted(other.keys, other_length, other_pad)])
        self.values = mx.concatenate(
            [shifted(self.values, length, pad), shifted(other.values, other_length, other_pad)]
        )

    def rows_kv(self, row: int, begin: int, end: int) -> tuple[mx.array, mx.array]:
        """Keys and values of one row's positions begin .. end, (1, H, end - begin, D)."""
        return self.keys[row : row + 1, :, begin:end], self.values[row : row + 1, :, begin:end]

    def state_arrays(self) -> list:
        return [self.keys, self.values]


def extend_batch(layout: CacheLayout, caches: list, other_layout: CacheLayout, other_caches: list) -> None:
    """Append the rows of another batch's layout and caches to these."""
    length, other_length = layout.start, other_layout.start
    pad, other_pad = layout.extend(other_layout)
    for cache, other in zip(caches, other_caches):
        cache.extend(other, length, other_length, pad, other_pad)
