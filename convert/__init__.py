"""Converting drafter checkpoints trained with PyTorch into the MLX drafter
folder that ``redrafter_mlx.drafter.load_drafter`` reads.

Importable as ``redrafter_mlx.convert`` from a source checkout and when
installed. See ``convert_checkpoint``.
"""

from .converter import build_drafter, convert_checkpoint, expected_shapes

__all__ = ["convert_checkpoint", "build_drafter", "expected_shapes"]
