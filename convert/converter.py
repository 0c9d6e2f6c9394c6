"""PyTorch-trained drafter checkpoint -> MLX drafter folder."""

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from redrafter_mlx import files
from redrafter_mlx.drafting.drafter import CONFIG_FILE, WEIGHTS_FILE, Drafter, DrafterArgs, check_compatible
from redrafter_mlx.errors import UserError
from redrafter_mlx.loading.gguf import DTYPES

from .names import normalize_names
from .readers import read_checkpoint

QUANTIZE_BITS = (4, 8)
GROUP_SIZE = 64
INT_FIELDS = ("vocab_size", "hidden_size", "exit_dim", "num_draft_layers", "draft_vocab_size")
FIELDS = INT_FIELDS + ("rnn",)


def convert_checkpoint(
    torch_path: str,
    mlx_path: str,
    dtype: str = "float16",
    quantize_bits: Optional[int] = None,
    base_model: Optional[str] = None,
    config: Optional[dict] = None,
) -> dict:
    """Convert a drafter trained with PyTorch into the folder ``load_drafter`` reads.

    Args:
        torch_path: a trainer output folder (``config.json`` with
            ``model.safetensors`` or ``pytorch_model.bin``, or shards with their
            index json), a shard index json, or one ``.safetensors`` /
            ``.pt`` / ``.bin`` state-dict file.
        mlx_path: the folder to create; it must not exist or be empty.
        dtype: "float32", "float16" or "bfloat16" for the written weights.
        quantize_bits: 4 or 8 to store the vocab projection as an MLX
            quantized linear (group size 64); config.json then records
            ``"quantization": {"group_size": 64, "bits": N}``.
        base_model: a base model path; the drafter's hidden size and
            vocabulary are checked against it.
        config: drafter config fields (``vocab_size``, ``hidden_size``,
            ``exit_dim``, ``num_draft_layers``, ``rnn``, ``draft_vocab_size``);
            they override the folder's config.json. Fields given nowhere
            are inferred from the tensor shapes when that is unambiguous.

    Returns:
        {"path", "tensors" (number written), "config" (the written
        config.json), "bytes" (written), "dtype", "quantize_bits",
        "source_files", "inferred" ({field: value}), "notes" (what was
        renamed, inferred or overridden, as sentences)}.

    Raises:
        UserError: bad options, a missing/unreadable/unsafe checkpoint,
        missing or extra tensors, shapes that contradict the config, or a
        base-model mismatch. Nothing is left at ``mlx_path`` then.
    """
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if quantize_bits is not None and quantize_bits not in QUANTIZE_BITS:
        raise UserError(f"the vocab projection can be quantized to 4 or 8 bits, not {quantize_bits}")
    if config is not None and not isinstance(config, dict):
        raise UserError(f"config must be a dict of drafter fields, got {type(config).__name__}")
    dest = Path(mlx_path).expanduser()
    _check_destination(dest)

    checkpoint = read_checkpoint(torch_path)
    notes = list(checkpoint.notes)
    mapping, name_notes = normalize_names(list(checkpoint.tensors))
    notes += name_notes
    tensors = {official: checkpoint.tensors[source] for source, official in mapping.items()}
    source_of = {official: source for source, official in mapping.items()}

    given = _given_config(checkpoint.config, config, notes)
    base = _Base(base_model)
    values, inferred = _complete_config(given, tensors, base)
    if inferred:
        notes.append("inferred from the tensors: " + ", ".join(f"{k}={v} ({why})" for k, (v, why) in inferred.items()))
    args = DrafterArgs(**values)
    _check_tensors(args, tensors, source_of)
    if base_model is not None:
        check_compatible(args, base.hidden_size, base.vocab_size)

    weights = _convert(args, tensors, source_of, dtype, quantize_bits)
    out_config = args.to_config()
    if quantize_bits is not None:
        out_config["quantization"] = {"group_size": GROUP_SIZE, "bits": quantize_bits}
    _check_loads(out_config, weights)
    written = _write(dest, out_config, weights)
    return {
        "path": str(dest),
        "tensors": len(weights),
        "config": out_config,
        "bytes": written,
        "dtype": dtype,
        "quantize_bits": quantize_bits,
        "source_files": checkpoint.files,
        "inferred": {k: v for k, (v, _) in inferred.items()},
        "notes": notes,
    }


def _check_destination(dest: Path) -> None:
    if dest.is_dir():
        if any(dest.iterdir()):
            raise UserError(f"output folder {dest} exists and is not empty; remove it or choose another")
    elif dest.exists():
        raise UserError(f"output path {dest} exists and is not a folder")


class _Base:
    """The base model, loaded on first use."""

    def __init__(self, path: Optional[str]):
        self.path = path
        self._sizes = None

    def _load(self):
        if self._sizes is None:
            from redrafter_mlx.engine.base_model import BaseModel
            from redrafter_mlx.loading import loader as loading

            model, _ = loading.load_base_model(self.path, dtype="float32")
            base = BaseModel(model)
            self._sizes = (base.hidden_size, base.vocab_size)
        return self._sizes

    @property
    def hidden_size(self) -> int:
        return self._load()[0]

    @property
    def vocab_size(self) -> int:
        return self._load()[1]


def _given_config(file_config: Optional[dict], config: Optional[dict], notes: list) -> dict:
    given = {k: v for k, v in (file_config or {}).items() if k in FIELDS and v is not None}
    for key, value in (config or {}).items():
        if key not in FIELDS or value is None:
            continue
        if key in given and given[key] != value:
            notes.append(f"{key}={value!r} given overrides config.json's {given[key]!r}")
        given[key] = value
    for key, value in given.items():
        if key == "rnn":
            if value not in (True, False, 0, 1):
                raise UserError(f"drafter config rnn must be true or false, got {value!r}")
            given[key] = bool(value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "num_draft_layers" else 1):
            raise UserError(f"drafter config {key} must be a positive integer, got {value!r}")
    return given


def _complete_config(given: dict, tensors: dict, base: _Base) -> tuple[dict, dict]:
    """Fill the fields ``given`` lacks from tensor shapes; return (values,
    {field: (value, reason)})."""
    values, inferred = dict(given), {}

    def shape(name):
        return tuple(tensors[name].shape) if name in tensors else None

    def infer(field, value, why):
        values[field] = value
        inferred[field] = (value, why)

    if "rnn" not in values:
        infer(
            "rnn",
            "rnn_w.weight" in tensors or "rnn_u.weight" in tensors,
            "rnn_w present" if "rnn_w.weight" in tensors else "no rnn_w/rnn_u tensors",
        )
    if "num_draft_layers" not in values:
        blocks = {int(m.group(1)) for n in tensors if (m := re.match(r"^lm_head\.(\d+)\.linear\.", n))}
        heads = {int(m.group(1)) for n in tensors if (m := re.match(r"^lm_head\.(\d+)\.weight$", n))}
        if blocks == set(range(len(blocks))) and heads == {len(blocks)}:
            infer("num_draft_layers", len(blocks), f"{len(blocks)} residual blocks before lm_head.{len(blocks)}")
    n = values.get("num_draft_layers")
    head = shape(f"lm_head.{n}.weight") if n is not None else None
    if "exit_dim" not in values:
        for name, axis in ((f"lm_head.{n}.weight", 1), ("lm_head.0.linear.weight", 0), ("input_proj.weight", 0)):
            if shape(name) and len(shape(name)) == 2:
                infer("exit_dim", shape(name)[axis], f"{name} shape {shape(name)}")
                break
    if "hidden_size" not in values:
        for name, axis in (("rnn_w.weight", 0), ("rnn_u.weight", 0)):
            if shape(name) and len(shape(name)) == 2:
                infer("hidden_size", shape(name)[axis], f"{name} shape {shape(name)}")
                break
        else:
            proj = shape("input_proj.weight")
            if proj and len(proj) == 2 and proj[1] % 2 == 0:
                infer("hidden_size", proj[1] // 2, f"input_proj.weight shape {proj} reads [h ; s]")
            elif not proj and values.get("exit_dim", 1) % 2 == 0 and "exit_dim" in values:
                infer("hidden_size", values["exit_dim"] // 2, "no input_proj, so exit_dim = 2 * hidden_size")
    ids = shape("draft_token_ids")
    if "draft_vocab_size" not in values and ids and len(ids) == 1:
        infer("draft_vocab_size", ids[0], f"draft_token_ids shape {ids}")
    if "vocab_size" not in values:
        if not ids and head and len(head) == 2:
            infer("vocab_size", head[0], f"lm_head.{n}.weight shape {head}")
        elif base.path is not None:
            infer("vocab_size", base.vocab_size, f"the base model {base.path}")

    missing = [f for f in ("vocab_size", "hidden_size", "exit_dim", "num_draft_layers") if f not in values]
    if missing:
        raise UserError(
            f"the drafter config lacks {', '.join(missing)} and the tensors do not determine "
            f"{'it' if len(missing) == 1 else 'them'}; give "
            + ", ".join(f"--{f.replace('_', '-')}" for f in missing)
            + " (or a config.json)"
        )
    return values, inferred


def expected_shapes(args: DrafterArgs) -> dict:
    """Official tensor name -> (shape, what fixes it)."""
    h, e, n = args.hidden_size, args.exit_dim, args.num_draft_layers
    v = args.draft_vocab_size or args.vocab_size
    v_why = f"draft_vocab_size={v}" if args.draft_vocab_size else f"vocab_size={v}"
    shapes = {}
    if e != 2 * h:
        shapes["input_proj.weight"] = ((e, 2 * h), f"exit_dim={e}, 2*hidden_size={2 * h}")
        shapes["input_proj.bias"] = ((e,), f"exit_dim={e}")
    for i in range(n):
        shapes[f"lm_head.{i}.linear.weight"] = ((e, e), f"exit_dim={e}")
        shapes[f"lm_head.{i}.linear.bias"] = ((e,), f"exit_dim={e}")
    shapes[f"lm_head.{n}.weight"] = ((v, e), f"{v_why}, exit_dim={e}")
    if args.rnn:
        shapes["rnn_u.weight"] = ((h, h), f"hidden_size={h}")
        shapes["rnn_u.bias"] = ((h,), f"hidden_size={h}")
        shapes["rnn_w.weight"] = ((h, h), f"hidden_size={h}")
    if args.draft_vocab_size:
        shapes["draft_token_ids"] = ((v,), v_why)
    return shapes


def _check_tensors(args: DrafterArgs, tensors: dict, source_of: dict) -> None:
    expected = expected_shapes(args)

    def label(name):
        source = source_of.get(name, name)
        return repr(name) if source == name else f"{name!r} (named {source!r} in the checkpoint)"

    config_line = (
        f"config: vocab_size={args.vocab_size}, hidden_size={args.hidden_size}, exit_dim={args.exit_dim}, "
        f"num_draft_layers={args.num_draft_layers}, rnn={str(args.rnn).lower()}"
        + (f", draft_vocab_size={args.draft_vocab_size}" if args.draft_vocab_size else "")
    )
    problems = []
    missing = [n for n in expected if n not in tensors]
    if missing:
        problems.append("missing tensors: " + ", ".join(f"{n} {expected[n][0]}" for n in missing))
    extra = [n for n in tensors if n not in expected]
    if extra:
        listed = ", ".join(f"{label(n)} {tuple(tensors[n].shape)}" for n in extra[:10])
        more = f" and {len(extra) - 10} more" if len(extra) > 10 else ""
        hint = ""
        if "input_proj.weight" in extra and args.exit_dim == 2 * args.hidden_size:
            hint = " (input_proj exists only when exit_dim != 2 * hidden_size)"
        elif any(n.startswith("rnn_") for n in extra) and not args.rnn:
            hint = " (the config says rnn=false)"
        problems.append(f"unexpected tensors: {listed}{more}{hint}")
    if problems:
        raise UserError(f"the checkpoint does not match the drafter {config_line}; " + "; ".join(problems))

    for name, (shape, why) in expected.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise UserError(f"tensor {label(name)} has shape {got}, expected {shape} from {why} ({config_line})")
        is_float = mx.issubdtype(tensors[name].dtype, mx.floating)
        if name == "draft_token_ids":
            if is_float or tensors[name].dtype == mx.bool_:
                raise UserError(f"tensor {label(name)} must hold integer token ids, got {tensors[name].dtype}")
            ids = tensors[name].astype(mx.int64)
            if ids.size and (ids.min().item() < 0 or ids.max().item() >= args.vocab_size):
                raise UserError(f"tensor {label(name)} holds token ids outside 0..{args.vocab_size - 1}")
        elif not is_float:
            raise UserError(f"tensor {label(name)} must be floating point, got {tensors[name].dtype}")


def _convert(args, tensors, source_of, dtype, quantize_bits) -> dict:
    weights = {}
    for name, value in tensors.items():
        if name == "draft_token_ids":
            weights[name] = value.astype(mx.int32)
            continue
        out = value.astype(DTYPES[dtype])
        if not mx.all(mx.isfinite(out)).item():
            if mx.all(mx.isfinite(value.astype(mx.float32))).item():
                raise UserError(f"tensor {source_of[name]!r} overflows {dtype}; convert to float32 or bfloat16")
            raise UserError(f"tensor {source_of[name]!r} holds NaN or infinite values")
        weights[name] = out
    if quantize_bits is not None:
        name = f"lm_head.{args.num_draft_layers}"
        if args.exit_dim % GROUP_SIZE:
            raise UserError(
                f"quantizing the vocab projection needs exit_dim divisible by the group size "
                f"{GROUP_SIZE}, got exit_dim={args.exit_dim}"
            )
        packed, scales, biases = mx.quantize(weights[f"{name}.weight"], group_size=GROUP_SIZE, bits=quantize_bits)
        weights[f"{name}.weight"], weights[f"{name}.scales"], weights[f"{name}.biases"] = packed, scales, biases
    mx.eval(list(weights.values()))
    return weights


def build_drafter(config: dict) -> Drafter:
    """A Drafter for a converted config.json, with a quantized vocab
    projection when the config says so (what ``load_drafter`` must do)."""
    drafter = Drafter(DrafterArgs.from_dict(config))
    quantization = config.get("quantization")
    if quantization:
        drafter.lm_head[-1] = nn.QuantizedLinear.from_linear(
            drafter.lm_head[-1], group_size=quantization["group_size"], bits=quantization["bits"]
        )
    return drafter


def _check_loads(config: dict, weights: dict) -> None:
    """The written folder must load: same names and shapes as a Drafter."""
    drafter = build_drafter(config)
    wanted = {k: tuple(v.shape) for k, v in tree_flatten(drafter.parameters())}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if wanted != got:  # a converter bug, not bad input; still say it plainly
        raise UserError(f"internal error: converted tensors {got} do not fit the MLX drafter {wanted}")


def _write(dest: Path, config: dict, weights: dict) -> int:
    created = []
    parent = dest.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    tmp = dest.parent / f".{dest.name}.converting-{uuid.uuid4().hex[:8]}"
    try:
        for folder in reversed(created):
            folder.mkdir()
        tmp.mkdir()
        mx.save_safetensors(str(tmp / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        written = sum(f.stat().st_size for f in tmp.iterdir())
        files.sync_tree(tmp)  # on the disk before it has its name
        _check_destination(dest)  # it may have appeared meanwhile
        os.replace(tmp, dest)  # replaces an empty folder on POSIX
        files.sync_folder(dest.parent)
        return written
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in created:
            try:
                folder.rmdir()
            except OSError:
                pass
        if isinstance(e, (OSError, RuntimeError)):
            needed = sum(int(v.nbytes) for v in weights.values())
            raise files.failure(dest, e, needed, "nothing was written") from None
        raise
