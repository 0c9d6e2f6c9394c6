"""Reading PyTorch-trained drafter checkpoints into MLX arrays.

Sources: a trainer output folder (``config.json`` plus ``model.safetensors``
or ``pytorch_model.bin``, possibly sharded with an index json), or one bare
``.safetensors`` / ``.pt`` / ``.bin`` state-dict file. Safetensors files are
parsed here with numpy (no torch, every dtype including bfloat16 and
float64); pickles go through ``torch.load(..., weights_only=True)`` only.
"""

import json
import pickle
import re
import struct
import warnings
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from redrafter_mlx.drafting.drafter import read_config
from redrafter_mlx.errors import UserError

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
SHARD_PATTERNS = (
    re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$"),
    re.compile(r"^pytorch_model-(\d+)-of-(\d+)\.bin$"),
)
# Keys under which training scripts nest the state dict in a bigger pickle.
NESTED_KEYS = ("state_dict", "model_state_dict", "model", "module", "drafter")

_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class Checkpoint:
    """Tensors (name -> mx.array, float64 already narrowed to float32), the
    folder's ``config.json`` if there was one, the files read, and notes."""

    def __init__(self):
        self.tensors: dict[str, mx.array] = {}
        self.origin: dict[str, str] = {}  # tensor name -> file it came from
        self.config: Optional[dict] = None
        self.files: list[str] = []
        self.notes: list[str] = []

    def add(self, tensors: dict, file: Path) -> None:
        for name, value in tensors.items():
            if name in self.tensors:
                raise UserError(f"tensor {name!r} appears twice: in {self.origin[name]} and in {file}")
            self.tensors[name] = value
            self.origin[name] = str(file)
        self.files.append(str(file))


def read_checkpoint(path: str) -> Checkpoint:
    source = Path(path).expanduser()
    if not source.exists():
        raise UserError(f"checkpoint not found: {path}")
    checkpoint = Checkpoint()
    if source.is_dir():
        _read_folder(source, checkpoint)
    elif source.name.endswith(".index.json"):
        _read_index(source, checkpoint)
    else:
        checkpoint.add(read_file(source, checkpoint.notes), source)
    if not checkpoint.tensors:
        raise UserError(f"checkpoint {path} holds no tensors")
    return checkpoint


def _read_folder(folder: Path, checkpoint: Checkpoint) -> None:
    config_path = folder / CONFIG_FILE
    if config_path.is_file():
        checkpoint.config = read_config(config_path)

    for index in (SAFETENSORS_INDEX, TORCH_INDEX):
        if (folder / index).is_file():
            _read_index(folder / index, checkpoint)
            return
    for single in (SAFETENSORS_FILE, TORCH_FILE):
        if (folder / single).is_file():
            if single == SAFETENSORS_FILE and (folder / TORCH_FILE).is_file():
                checkpoint.notes.append(f"read {SAFETENSORS_FILE}; ignored {TORCH_FILE} beside it")
            checkpoint.add(read_file(folder / single, checkpoint.notes), folder / single)
            return
    for pattern in SHARD_PATTERNS:
        shards = sorted((int(m.group(1)), int(m.group(2)), p) for p in folder.iterdir() if (m := pattern.match(p.name)))
        if shards:
            total = shards[0][1]
            numbers = [n for n, _, _ in shards]
            if numbers != list(range(1, total + 1)) or any(t != total for _, t, _ in shards):
                raise UserError(
                    f"incomplete sharded checkpoint in {folder}: found shards {numbers} "
                    f"of {total} ({shards[0][2].name} ...)"
                )
            for _, _, shard in shards:
                checkpoint.add(read_file(shard, checkpoint.notes), shard)
            return
    raise UserError(
        f"no weights in {folder}: expected {SAFETENSORS_FILE}, {TORCH_FILE}, shards with "
        f"{SAFETENSORS_INDEX} / {TORCH_INDEX}, or a state-dict file given directly"
    )


def _read_index(index_path: Path, checkpoint: Checkpoint) -> None:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        assert isinstance(weight_map, dict)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AssertionError):
        raise UserError(f"{index_path} is not a shard index (a JSON object with a 'weight_map')") from None
    files = sorted(set(weight_map.values()))
    for name in files:
        shard = index_path.parent / name
        if not shard.is_file():
            raise UserError(f"shard {name} listed in {index_path} is missing")
        checkpoint.add(read_file(shard, checkpoint.notes), shard)
    listed = set(weight_map)
    absent = sorted(n for n in listed if n not in checkpoint.tensors)
    if absent:
        raise UserError(
            f"{index_path} lists tensors its shards lack: "
            + ", ".join(f"{n} (in {weight_map[n]})" for n in absent[:10])
        )


def read_file(path: Path, notes: list) -> dict:
    """One state-dict file, safetensors or pickle (told apart by content)."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    if path.suffix == ".safetensors" or (len(head) == 9 and head[8:9] == b"{"):
        return read_safetensors(path)
    return read_pickle(path, notes)


def read_safetensors(path: Path) -> dict:
    def bad(why: str):
        return UserError(f"cannot read {path}: not a valid safetensors file ({why})")

    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) < 8:
        raise bad("file too short")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise bad(f"header length {header_len} exceeds the file size {len(data)}")
    try:
        header = json.loads(data[8 : 8 + header_len])
        assert isinstance(header, dict)
    except (json.JSONDecodeError, UnicodeDecodeError, AssertionError):
        raise bad("the header is not a JSON object") from None
    header.pop("__metadata__", None)
    body = memoryview(data)[8 + header_len :]
    tensors = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise bad(f"malformed header entry for {name!r}") from None
        if dtype not in _SAFETENSORS_DTYPES:
            raise UserError(f"{path}: tensor {name!r} has dtype {dtype}, which cannot be converted")
        np_dtype = np.dtype(_SAFETENSORS_DTYPES[dtype])
        count = int(np.prod(shape)) if shape else 1
        if not (0 <= begin <= end <= len(body)) or end - begin != count * np_dtype.itemsize:
            raise bad(
                f"tensor {name!r} ({dtype} {tuple(shape)}) has data offsets {begin}..{end} "
                f"that do not fit its size or the file"
            )
        array = np.frombuffer(body[begin:end], dtype=np_dtype).reshape(shape).copy()
        if dtype == "BF16":
            tensors[name] = mx.array(array).view(mx.bfloat16)
        elif dtype == "F64":
            tensors[name] = mx.array(array.astype(np.float32))
        else:
            tensors[name] = mx.array(array)
    return tensors


def read_pickle(path: Path, notes: list) -> dict:
    try:
        import torch
    except ImportError:
        raise UserError(
            f"reading {path.name} (a PyTorch pickle) needs PyTorch: pip install torch "
            "(or pip install 'redrafter-mlx[torch]'), or convert it to safetensors first"
        ) from None
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols it then refuses anyway
            warnings.simplefilter("ignore", UserWarning)
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        message = str(e)
        found = re.search(r"GLOBAL ([\w.]+)", message)
        if found or "global" in message.lower():
            what = f" (it refers to {found.group(1)})" if found else ""
            raise UserError(
                f"{path} needs arbitrary code to load{what}; it will not be loaded. "
                "Save a plain state dict (tensors only), or safetensors, instead"
            ) from None
        detail = re.search(r"WeightsUnpickler error:\s*(.+?)\n\n", message, re.S)
        why = detail.group(1).strip() if detail else message.splitlines()[0]
        raise UserError(f"cannot read {path}: not a PyTorch checkpoint ({why})") from None
    except Exception as e:  # corrupt zip, truncated file, ...: torch raises many types
        raise UserError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    return _state_dict_from(obj, path, torch, notes)


def _state_dict_from(obj, path: Path, torch, notes: list) -> dict:
    """The tensors of a loaded pickle: a state dict, or one nested under a
    usual key (``{"state_dict": ..., "epoch": 3}``)."""

    def is_state_dict(d):
        return isinstance(d, dict) and d and all(isinstance(v, torch.Tensor) for v in d.values())

    if not is_state_dict(obj) and isinstance(obj, dict):
        for key in NESTED_KEYS:
            if is_state_dict(obj.get(key)):
                others = [repr(k) for k in obj if k != key]
                notes.append(
                    f"read the state dict under {key!r} in {path.name}"
                    + (f"; ignored {', '.join(others[:5])}" if others else "")
                )
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj:
        raise UserError(f"{path} does not hold a state dict (got {type(obj).__name__})")
    tensors = {}
    for name, value in obj.items():
        if not isinstance(value, torch.Tensor):
            raise UserError(f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor")
        value = value.detach().cpu().contiguous()
        if value.dtype in (torch.bfloat16, torch.float64):
            tensors[name] = mx.array(value.float().numpy()).astype(
                mx.bfloat16 if value.dtype == torch.bfloat16 else mx.float32
            )
        elif value.is_floating_point() or value.dtype in (
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
        ):
            tensors[name] = mx.array(value.numpy())
        else:
            raise UserError(f"{path}: tensor {name!r} has dtype {value.dtype}, which cannot be converted")
    return tensors
