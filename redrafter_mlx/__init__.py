"""Recurrent Drafter (ReDrafter) speculative decoding for mlx-lm models."""

import os as _os

from .blas import preload_openblas as _preload_openblas

_preload_openblas()

# In a source checkout, cli.py and convert/ sit beside this package; the wheel
# maps them inside it. Extending the package path makes `redrafter_mlx.cli` and
# `redrafter_mlx.convert` resolve the same way in both.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.exists(_os.path.join(__path__[0], "cli.py")) and _os.path.exists(_os.path.join(_root, "cli.py")):
    __path__.append(_root)

__version__ = "0.1.0"

# The public API, imported on first use: the command line's --help and
# completion need none of it, and importing it loads mlx-lm and transformers.
_API = {
    "DraftSettings": "drafting.settings",
    "load_prompt_cache": "engine.prompt_cache",
    "make_prompt_cache": "engine.prompt_cache",
    "save_prompt_cache": "engine.prompt_cache",
    "SamplingSettings": "engine.sampling",
    "make_chooser": "engine.sampling",
    "load": "loading.loader",
    "batch_generate": "serving.generate",
    "generate": "serving.generate",
    "stream_generate": "serving.generate",
    "GenerationResponse": "serving.generate",
}
__all__ = list(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'redrafter_mlx' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_API))
