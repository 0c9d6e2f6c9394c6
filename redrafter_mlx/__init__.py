"""Recurrent Drafter (ReDrafter) speculative decoding for mlx-lm models."""

import os as _os

from .blas import preload_openblas as _preload_openblas

_preload_openblas()

# In a source checkout, cli.py and convert/ sit beside this package; the wheel
# maps them inside it. Extending the package path makes `redrafter_mlx.cli` and
# `redrafter_mlx.convert` resolve the same way in both.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.exists(_os.path.join(__path__[0], "cli.py")) and _os.path.exists(
    _os.path.join(_root, "cli.py")
):
    __path__.append(_root)

__version__ = "0.1.0"

from .drafting.settings import DraftSettings  # noqa: E402
from .engine.prompt_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache  # noqa: E402
from .engine.sampling import SamplingSettings, make_chooser  # noqa: E402
from .loading.loader import load  # noqa: E402
from .serving.api import batch_generate, generate, stream_generate  # noqa: E402

__all__ = [
    "load", "generate", "stream_generate", "batch_generate", "DraftSettings", "SamplingSettings", "make_chooser",
    "make_prompt_cache", "save_prompt_cache", "load_prompt_cache",
]
