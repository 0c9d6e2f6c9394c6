"""Per-token positions for tree tokens, installed into unmodified mlx-lm models.

A tree's nodes stand at the position of their depth, not of their index in
the packed block, so the layout hands RoPE an offset per token (B, N) rather
than one per row; ``TreeRoPE`` wraps a model's own RoPE module to take it.
"""

import mlx.core as mx
import mlx.nn as nn


class TreeRoPE(nn.Module):
    """Wraps a model's RoPE module so that an ``offset`` of shape (B, N) gives
    each token its own position. Any other offset passes straight through.

    ``mx.fast.rope`` takes one offset per batch row, so each token is rotated
    as a row of its own: (B, H, N, D) -> (B*N, H, 1, D) and back.
    """

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.rope = rope

    def __call__(self, x: mx.array, offset=0):
        if not (isinstance(offset, mx.array) and offset.ndim == 2):
            return self.rope(x, offset=offset)
        batch, heads, num_tokens, dim = x.shape
        rows = x.transpose(0, 2, 1, 3).reshape(batch * num_tokens, heads, 1, dim)
        rotated = self.rope(rows, offset=offset.reshape(-1))
        return rotated.reshape(batch, num_tokens, heads, dim).transpose(0, 2, 1, 3)


def is_rope(module: nn.Module) -> bool:
    """nn.RoPE, mlx-lm's variants (Llama3RoPE, YarnRoPE, SuScaledRoPE, ...)
    and any other module named like one; all take ``(x, offset=...)``."""
    return isinstance(module, nn.RoPE) or "rope" in type(module).__name__.lower()


def install_tree_rope(model: nn.Module) -> int:
    """Wrap every RoPE module of ``model`` in place; returns how many."""
    count = 0
    for _, parent in model.named_modules():
        for name, child in list(parent.items()):
            if isinstance(child, TreeRoPE):  # installed before
                count += 1
            elif isinstance(child, nn.Module) and not isinstance(parent, TreeRoPE) and is_rope(child):
                parent[name] = TreeRoPE(child)
                count += 1
    return count
