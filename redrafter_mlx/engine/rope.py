"""Per-token positions for tree tokens, installed into unmodified mlx-lm models.

A tree's nodes stand at the position of their depth, not of their index in
the packed block, so the layout hands RoPE an offset per token (B, N) rather
than one per row; ``TreeRoPE`` wraps a model's own RoPE module to take it.

RoPE is linear in its input at any one position: rotating a head vector x
(D,) to position p is ``x @ R(p)`` for a (D, D) matrix, whose row k is the
module's own rotation of the unit vector e_k to p (pairs of cos/sin, ones
on dimensions the module leaves alone, whatever scaling it applies). In
every RoPE, each output dimension k mixes at most its own input and one
partner's: ``out_k = x_k R[k, k] + x_p(k) R[p(k), k]``. So a tree step asks
each distinct RoPE module, once, for those two coefficients at every
node's position, (B, N, D) each, by rotating two indicator vectors; each
attention layer then rotates its queries and keys with two products and a
gather. A module whose matrices are not of that form (found by probing)
gets the whole matrices, (B, N, D, D), and one batched matmul per layer.
Every layer of a model usually rotates alike (Gemma's local and global
layers are two kinds), so the coefficients are made once or twice a step,
not twice per layer.

That is for MLX's CPU backend, where a RoPE module is a composite of about
a dozen small ops, which rotating token by token would repeat for every
token row in every layer. Where RoPE is one fused kernel (a GPU), each
token is instead rotated as a row of its own by the module itself (one
kernel per call, the module's own arithmetic in its own precision), since
the coefficients would add casts to and from float32 around every call in
a half-precision model.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# Positions at which two RoPE modules must rotate identically to share
# their matrices (rotations differ by position 1 already when base or
# scale differ; the far ones catch scaling that only shows at long range).
PROBE_POSITIONS = (1, 2, 7, 100, 4097, 32771, 131101)


class PairRotation:
    """A rotation in which output dimension k mixes input k and its
    partner's: ``x * diagonal + x[..., partner] * crossed``.

    diagonal, crossed: (B, N, D) float32, R[k, k] and R[partner(k), k] at
    each token's position; partner: (D,) int32 (k itself, and crossed 0,
    where the module leaves k alone)."""

    def __init__(self, diagonal: mx.array, crossed: mx.array, partner: mx.array):
        self.diagonal, self.crossed, self.partner = diagonal[:, None], crossed[:, None], partner

    def __call__(self, x: mx.array) -> mx.array:
        """(B, H, N, D) -> the same, each token turned to its position."""
        x32 = x.astype(mx.float32)
        return (x32 * self.diagonal + mx.take(x32, self.partner, axis=-1) * self.crossed).astype(x.dtype)


class MatrixRotation:
    """A rotation by whole matrices, (B, N, D, D) float32."""

    def __init__(self, matrices: mx.array):
        self.matrices = matrices

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.transpose(0, 2, 1, 3).astype(mx.float32)  # (B, N, H, D)
        return (rows @ self.matrices).astype(x.dtype).transpose(0, 2, 1, 3)


def pairing(matrices: np.ndarray) -> Optional[np.ndarray]:
    """Each dimension's partner (D,) when every column k of the matrices
    (..., D, D) is zero outside rows k and one partner p(k), with p(p(k)) =
    k; else None."""
    support = (np.abs(matrices) > 0).reshape(-1, *matrices.shape[-2:]).any(axis=0)  # (D, D): row j feeds column k
    dim = support.shape[0]
    partner = np.arange(dim)
    for k in range(dim):
        others = [j for j in np.flatnonzero(support[:, k]) if j != k]
        if len(others) > 1:
            return None
        if others:
            partner[k] = others[0]
    return partner if np.array_equal(partner[partner], np.arange(dim)) else None


class Pairs:
    """One kind's pairing as the arrays a ``PairRotation`` is made from,
    built once per kind rather than once per step.

    first: (D,) bool, one dimension of each pair and every dimension left
    alone; units: (2, D) float32, the indicator vectors of ``first`` and of
    the rest; partner: (D,) int32."""

    def __init__(self, partner: np.ndarray):
        self.first = mx.array(np.arange(partner.size) <= partner)
        self.units = mx.stack([self.first, ~self.first]).astype(mx.float32)
        self.partner = mx.array(partner, mx.int32)


class Rotations:
    """The rotations of one model's RoPE modules for the block being fed,
    shared by the modules that rotate alike.

    A module's kind is found on its first tree call (its rotation matrices
    at ``PROBE_POSITIONS`` compared with the kinds seen before, and their
    pairing); the rotation of a kind is made once per block (a new offset
    array) and reused by every layer of that kind."""

    def __init__(self):
        self._kinds: list[tuple[int, np.ndarray, Optional[Pairs]]] = []  # (head dim, probe matrices, pairing) per kind
        self._kind_of: dict[tuple[int, int], int] = {}  # (id(module), head dim) -> kind
        self._made: dict[int, tuple] = {}  # kind -> (offset, rotation)

    @staticmethod
    def matrices(rope: nn.Module, positions: mx.array, dim: int) -> mx.array:
        """positions (...,) int -> (..., dim, dim) float32: row k of each is
        ``rope`` turning the unit vector e_k to that position."""
        count = positions.size
        units = mx.broadcast_to(mx.eye(dim, dtype=mx.float32), (count, dim, dim)).reshape(count * dim, 1, 1, dim)
        rotated = rope(units, offset=mx.repeat(positions.reshape(-1), dim))
        return rotated.astype(mx.float32).reshape(*positions.shape, dim, dim)

    @staticmethod
    def pairs(rope: nn.Module, positions: mx.array, pairs: Pairs) -> PairRotation:
        """positions (B, N) int -> the ``PairRotation`` there. One indicator
        vector holds one dimension of every pair (and the dimensions left
        alone), the other the rest; the module turns both to every position,
        and each output dimension reads its diagonal coefficient from the
        vector that holds it and its crossed one from the other."""
        count, dim = positions.size, pairs.units.shape[-1]
        units = mx.broadcast_to(pairs.units, (count, 2, dim)).reshape(count * 2, 1, 1, dim)
        rotated = rope(units, offset=mx.repeat(positions.reshape(-1), 2))
        rotated = rotated.astype(mx.float32).reshape(*positions.shape, 2, dim)
        own, other = rotated[..., 0, :], rotated[..., 1, :]
        return PairRotation(mx.where(pairs.first, own, other), mx.where(pairs.first, other, own), pairs.partner)

    def kind(self, rope: nn.Module, dim: int) -> int:
        key = (id(rope), dim)
        if key not in self._kind_of:
            probe = np.array(self.matrices(rope, mx.array(PROBE_POSITIONS, mx.int32), dim))
            same = [i for i, (d, seen, _) in enumerate(self._kinds) if d == dim and np.array_equal(seen, probe)]
            if not same:
                partner = pairing(probe)
                self._kinds.append((dim, probe, None if partner is None else Pairs(partner)))
            self._kind_of[key] = same[0] if same else len(self._kinds) - 1
        return self._kind_of[key]

    def __call__(self, rope: nn.Module, offset: mx.array, dim: int):
        """offset (B, N) positions -> the rotation there (``PairRotation``,
        or ``MatrixRotation`` for a module not of pairs)."""
        kind = self.kind(rope, dim)
        made: Optional[tuple] = self._made.get(kind)
        if made is None or made[0] is not offset:
            pairs = self._kinds[kind][2]
            rotation = (
                MatrixRotation(self.matrices(rope, offset, dim)) if pairs is None else self.pairs(rope, offset, pairs)
            )
            made = self._made[kind] = (offset, rotation)
        return made[1]


def rotations_pay() -> bool:
    """Whether tree tokens are rotated by ``Rotations`` on the default
    device (its CPU backend) rather than token by token through the module."""
    return mx.default_device().type == mx.cpu


class TreeRoPE(nn.Module):
    """Wraps a model's RoPE module so that an ``offset`` of shape (B, N) gives
    each token its own position in (B, H, N, D) queries or keys. Any other
    offset passes straight through to the module.

    by_rotations: each token turned to its position by the rotation
    ``Rotations`` makes for its block, or rotated as a row of its own by the
    module, (B, H, N, D) -> (B*N, H, 1, D) and back; None: as
    ``rotations_pay`` says for the device."""

    def __init__(self, rope: nn.Module, rotations: Rotations, by_rotations: Optional[bool] = None):
        super().__init__()
        self.rope = rope
        self.rotations = rotations
        self.by_rotations = by_rotations

    def __call__(self, x: mx.array, offset=0):
        if not (isinstance(offset, mx.array) and offset.ndim == 2):
            return self.rope(x, offset=offset)
        by_rotations = rotations_pay() if self.by_rotations is None else self.by_rotations
        if by_rotations:
            return self.rotations(self.rope, offset, x.shape[-1])(x)
        batch, heads, num_tokens, dim = x.shape
        rows = x.transpose(0, 2, 1, 3).reshape(batch * num_tokens, heads, 1, dim)
        rotated = self.rope(rows, offset=offset.reshape(-1))
        return rotated.reshape(batch, num_tokens, heads, dim).transpose(0, 2, 1, 3)


def is_rope(module: nn.Module) -> bool:
    """nn.RoPE, mlx-lm's variants (Llama3RoPE, YarnRoPE, SuScaledRoPE, ...)
    and any other module named like one; all take ``(x, offset=...)``."""
    return isinstance(module, nn.RoPE) or "rope" in type(module).__name__.lower()


def install_tree_rope(model: nn.Module) -> int:
    """Wrap every RoPE module of ``model`` in place, all sharing one
    ``Rotations``; returns how many."""
    count = 0
    rotations = Rotations()
    for _, parent in model.named_modules():
        for name, child in list(parent.items()):
            if isinstance(child, TreeRoPE):  # installed before
                count += 1
            elif isinstance(child, nn.Module) and not isinstance(parent, TreeRoPE) and is_rope(child):
                parent[name] = TreeRoPE(child, rotations)
                count += 1
    return count
