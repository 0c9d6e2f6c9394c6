"""Per-token positions for tree tokens, installed into unmodified mlx-lm models.

A tree's nodes stand at the position of their depth, not of their index in
the packed block, so the layout hands RoPE an offset per token (B, N) rather
than one per row; ``TreeRoPE`` wraps a model's own RoPE module to take it.

RoPE is linear in its input at any one position: rotating a head vector x
(D,) to position p is ``x @ R(p)`` for a (D, D) matrix, whose row k is the
module's own rotation of the unit vector e_k to p (pairs of cos/sin, ones
on dimensions the module leaves alone, whatever scaling it applies). So a
tree step asks each distinct RoPE module for its matrices once, at every
node's position, (B, N, D, D); each attention layer then rotates its
queries and keys by one batched matmul. Every layer of a model usually
rotates alike (Gemma's local and global layers are two kinds), so the
matrices are made once or twice a step, not twice per layer.

That is for MLX's CPU backend, where a RoPE module is a composite of about
a dozen small ops, which rotating token by token would repeat for every
token row in every layer. Where RoPE is one fused kernel (a GPU), each
token is instead rotated as a row of its own by the module itself (one
kernel per call, the module's own arithmetic in its own precision), since
the matrices would add casts to and from float32 around every call in a
half-precision model.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# Positions at which two RoPE modules must rotate identically to share
# their matrices (rotations differ by position 1 already when base or
# scale differ; the far ones catch scaling that only shows at long range).
PROBE_POSITIONS = (1, 2, 7, 100, 4097, 32771, 131101)


class Rotations:
    """The rotation matrices of one model's RoPE modules for the block being
    fed, shared by the modules that rotate alike.

    A module's kind is found on its first tree call (its rotations at
    ``PROBE_POSITIONS`` compared with the kinds seen before); the matrices
    of a kind are made once per block (a new offset array) and reused by
    every layer of that kind."""

    def __init__(self):
        self._kinds: list[tuple[int, np.ndarray]] = []  # (head dim, probe rotations) per kind
        self._kind_of: dict[tuple[int, int], int] = {}  # (id(module), head dim) -> kind
        self._made: dict[int, tuple[mx.array, mx.array]] = {}  # kind -> (offset, matrices)

    @staticmethod
    def matrices(rope: nn.Module, positions: mx.array, dim: int) -> mx.array:
        """positions (...,) int -> (..., dim, dim) float32: row k of each is
        ``rope`` turning the unit vector e_k to that position."""
        count = positions.size
        units = mx.broadcast_to(mx.eye(dim, dtype=mx.float32), (count, dim, dim)).reshape(count * dim, 1, 1, dim)
        rotated = rope(units, offset=mx.repeat(positions.reshape(-1), dim))
        return rotated.astype(mx.float32).reshape(*positions.shape, dim, dim)

    def kind(self, rope: nn.Module, dim: int) -> int:
        key = (id(rope), dim)
        if key not in self._kind_of:
            probe = np.array(self.matrices(rope, mx.array(PROBE_POSITIONS, mx.int32), dim))
            same = [i for i, (d, seen) in enumerate(self._kinds) if d == dim and np.array_equal(seen, probe)]
            if not same:
                self._kinds.append((dim, probe))
            self._kind_of[key] = same[0] if same else len(self._kinds) - 1
        return self._kind_of[key]

    def __call__(self, rope: nn.Module, offset: mx.array, dim: int) -> mx.array:
        """offset (B, N) positions -> (B, N, dim, dim) float32 matrices."""
        kind = self.kind(rope, dim)
        made: Optional[tuple] = self._made.get(kind)
        if made is None or made[0] is not offset:
            made = self._made[kind] = (offset, self.matrices(rope, offset, dim))
        return made[1]


def matrices_pay() -> bool:
    """Whether tree tokens are rotated by matrices on the default device
    (its CPU backend) rather than token by token through the module."""
    return mx.default_device().type == mx.cpu


class TreeRoPE(nn.Module):
    """Wraps a model's RoPE module so that an ``offset`` of shape (B, N) gives
    each token its own position in (B, H, N, D) queries or keys. Any other
    offset passes straight through to the module.

    by_matrices: each token's heads times its position's matrix
    (``Rotations``), or each token rotated as a row of its own by the
    module, (B, H, N, D) -> (B*N, H, 1, D) and back; None: as
    ``matrices_pay`` says for the device."""

    def __init__(self, rope: nn.Module, rotations: Rotations, by_matrices: Optional[bool] = None):
        super().__init__()
        self.rope = rope
        self.rotations = rotations
        self.by_matrices = by_matrices

    def __call__(self, x: mx.array, offset=0):
        if not (isinstance(offset, mx.array) and offset.ndim == 2):
            return self.rope(x, offset=offset)
        by_matrices = matrices_pay() if self.by_matrices is None else self.by_matrices
        if by_matrices:
            matrices = self.rotations(self.rope, offset, x.shape[-1])  # (B, N, D, D)
            rows = x.transpose(0, 2, 1, 3).astype(mx.float32)  # (B, N, H, D)
            return (rows @ matrices).astype(x.dtype).transpose(0, 2, 1, 3)
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
