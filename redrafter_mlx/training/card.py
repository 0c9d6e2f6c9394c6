"""The model card (``README.md``) of a drafter folder, and the entries of
its ``config.json`` the card is made from.

``train`` writes the card into the finished drafter (``Trainer.export``),
from its ``config.json``: the base model's name and identity
(``base_model_entry``), the drafter's shape, the training settings, data
and held-out results, and ``make-drafter``'s account of its run. Its YAML
front matter is what the Hugging Face Hub reads. ``datastore`` rewrites
only the card's datastore row (``refresh_card_datastore``).
"""

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import numpy as np

from .. import files
from ..drafting.datastore import BOUNDARY16
from ..drafting.datastore import FILE as DATASTORE_FILE
from ..drafting.drafter import CONFIG_FILE, WEIGHTS_FILE, DrafterArgs, read_config
from ..errors import UserError
from ..loading.loader import MODEL_CARD_FILE, is_hub_id
from .checkpoints import STATE_SUFFIX
from .config import TrainConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded default model (load_base_model(None))


def base_model_entry(model: Optional[str], identity: str) -> dict:
    """``config.json``'s ``base_model``: a name, the identity the loader
    computes for the model (``loading.loader.model_identity``), and, when
    the model was given as one, its Hub id; ``default`` for the embedded
    default model (no ``--model``)."""
    if model is None:
        return {"name": DEFAULT_MODEL_NAME, "identity": identity, "default": True}
    if is_hub_id(model):
        return {"name": model, "identity": identity, "hub_id": model}
    return {"name": Path(os.path.abspath(model)).name, "identity": identity}


def datastore_summary(folder) -> str:
    """The model card's description of the folder's datastore: tokens and
    answers (the file holds one boundary after each answer) and size."""
    path = Path(folder) / DATASTORE_FILE
    if not path.is_file():
        return f"none (`redrafter-mlx datastore --drafter FOLDER --data DATA` adds `{DATASTORE_FILE}`)"
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    answers = int((tokens == (BOUNDARY16 if tokens.dtype == np.uint16 else -1)).sum())
    return f"`{DATASTORE_FILE}`, {tokens.size - answers:,} tokens of {answers:,} answers ({path.stat().st_size / 1e6:.1f} MB)"


DATASTORE_ROW = "| datastore |"  # the card's table row that datastore_summary fills


def refresh_card_datastore(folder) -> bool:
    """Rewrite the datastore row of the folder's model card (the generated
    one, or any card with a ``| datastore | ... |`` row, as the shipped
    drafter's has), leaving the rest as it is; False when it has none."""
    card = Path(folder) / MODEL_CARD_FILE
    if not card.is_file():
        return False
    lines = card.read_text().split("\n")
    rows = [i for i, line in enumerate(lines) if line.startswith(DATASTORE_ROW)]
    for i in rows:
        lines[i] = f"{DATASTORE_ROW} {datastore_summary(folder)} |"
    if rows:
        files.write_text(card, "\n".join(lines))
    return bool(rows)


SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _weights_summary(path: Path) -> tuple[int, list[str]]:
    """(parameters, their dtypes) of a drafter's safetensors file, read from
    its header alone: an 8-byte little-endian length, then JSON giving each
    tensor's dtype and shape. The draft vocabulary's token ids are not
    parameters."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    tensors = [v for k, v in header.items() if k not in ("__metadata__", "draft_token_ids")]
    dtypes = sorted({SAFETENSORS_DTYPES.get(v["dtype"], v["dtype"].lower()) for v in tensors})
    return sum(math.prod(v["shape"]) for v in tensors), dtypes


def _table(rows: list) -> str:
    return "\n".join(["| setting | value |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows])


def model_card(folder, folder_name: Optional[str] = None, beside: Optional[str] = None) -> str:
    """The model card (``README.md``) of a drafter folder, made from its
    ``config.json`` (the base model's name and identity, the training
    settings, data and held-out results that ``train`` puts there) and its
    files. ``folder_name``: its name once it is moved into place (its own
    name by default); ``beside``: the folder that keeps what made it
    (``NAME.train/``). The YAML front matter is what the Hugging Face Hub
    reads: library, tags and, when the base model was given as a Hub id,
    the base model, which links the drafter to it."""
    folder = Path(folder)
    folder_name = folder_name or folder.name
    beside = beside or f"{folder_name}{STATE_SUFFIX}/"
    config = read_config(folder / CONFIG_FILE)
    args = DrafterArgs.from_dict(config)
    base = config.get("base_model") if isinstance(config.get("base_model"), dict) else {}
    training = config.get("training") if isinstance(config.get("training"), dict) else {}
    name = base.get("name", "its base model")
    front = ["---", "library_name: redrafter-mlx", "tags:", "- redrafter", "- speculative-decoding", "- mlx"]
    if base.get("hub_id"):
        front.append(f"base_model: {base['hub_id']}")
    front.append("---")
    model_option = (
        f"--model {base['hub_id']} " if base.get("hub_id") else "" if base.get("default") else "--model MODEL "
    )
    parameters, dtypes = _weights_summary(folder / WEIGHTS_FILE)
    size = (folder / WEIGHTS_FILE).stat().st_size / 1e6
    out = front + [
        "",
        f"# ReDrafter drafter for {name}",
        "",
        f"A [ReDrafter](https://arxiv.org/abs/2403.09919) drafter for `{name}`, made by `redrafter-mlx train` from the",
        "model's own answers: a small recurrent network over the model's last hidden state drafts the next tokens,",
        "and the model checks them all in one step, so what is generated is the model's own output, only sooner.",
        "",
        "## Use",
        "",
        "```bash",
        f'redrafter-mlx generate {model_option}--drafter OWNER/NAME --prompt "Hello"',
        "```",
        "",
        "`--drafter` takes the Hub id this folder was uploaded to (downloaded once into the Hugging Face cache) or",
        "the folder itself."
        + (
            " `MODEL` is the base model, from any folder, Hub id or GGUF file that holds it."
            if model_option == "--model MODEL "
            else ""
        ),
        "The drafter fits only its base model: `config.json` names the model's identity (`base_model.identity`, a",
        "digest of its shapes, vocabulary and first embeddings, the same however the model is stored), and the",
        "drafter's sizes must match the model's.",
        "",
        "## Base model",
        "",
        _table(
            [
                ("model", f"`{name}`" + (" (the default model of redrafter-mlx)" if base.get("default") else "")),
                ("identity", f"`{base['identity']}`" if base.get("identity") else "not recorded"),
                ("hidden size", args.hidden_size),
                ("vocabulary", f"{args.vocab_size:,} tokens"),
            ]
        ),
        "",
        "## Drafter",
        "",
        _table(
            [
                ("`exit_dim`", args.exit_dim),
                ("residual blocks", args.num_draft_layers),
                ("RNN", "on" if args.rnn else "off"),
                (
                    "draft vocabulary",
                    f"the {args.draft_vocab_size:,} most frequent generated tokens"
                    + (", most frequent first" if args.sorted_draft_vocab else "")
                    if args.draft_vocab_size
                    else "the whole vocabulary",
                ),
                ("parameters", f"{parameters / 1e6:.2f} M, {' and '.join(dtypes)} ({size:.1f} MB)"),
                ("datastore", datastore_summary(folder)),
            ]
        ),
    ]
    if training:
        out += ["", *_training_section(training)]
    if isinstance(config.get("made"), dict):
        out += ["", *_made_section(config["made"])]
    out += [
        "",
        "## Files",
        "",
        f"`{CONFIG_FILE}` (the drafter's shape, its base model, the training settings), `{WEIGHTS_FILE}`,",
        f"`{DATASTORE_FILE}` when there is a datastore, and this card. The folder is the whole drafter: upload it as",
        f"it is (the training checkpoint and log are kept beside it, in `{beside}`, and are not needed):",
        "",
        "```bash",
        f"hf upload OWNER/NAME {folder_name}",
        "```",
        "",
    ]
    return "\n".join(out)


def _made_section(made: dict) -> list:
    """The card's account of ``redrafter-mlx make-drafter``'s run: the
    command, its data, its stages' times and the held-out speed."""

    def run(r: dict) -> str:
        count = f"{r['count']:,}" if isinstance(r.get("count"), int) else "all"
        if isinstance(r.get("responses"), int) and r["responses"] != r.get("count"):
            count = f"{r['responses']:,} of {count}"
        source = f" of `{Path(r['prompts']).name}`" if r.get("prompts") else ""
        return f"{count} prompts{source} at temperature {r['temp']:g} (up to {r['max_tokens']} tokens)"

    runs = "; ".join(run(r) for r in made.get("runs", []))
    minutes = made.get("stage_minutes", {})
    out = [
        "## How it was made",
        "",
        "```bash",
        made.get("command", "redrafter-mlx make-drafter"),
        "```",
        "",
        _table(
            [
                (
                    "model kind",
                    "chat (its chat template applied)" if made.get("kind") == "chat" else "text (continues plain text)",
                ),
                (
                    "prompts",
                    f"`{made.get('prompts')}`: {made.get('train_prompts', 0):,} for training, {made.get('held_out_prompts', 0):,} held out",
                ),
                ("distillation", runs),
                (
                    "time",
                    f"{made.get('hours', sum(minutes.values()) / 60):.2f} hours in all ("
                    + ", ".join(f"{k} {v:.0f} min" for k, v in minutes.items())
                    + f"), {made.get('cpu_hours', 0):.1f} CPU hours",
                ),
            ]
            + ([("note", made["note"])] if made.get("note") else [])
        ),
    ]
    speed = made.get("held_out_speed") or {}
    rows = []
    for key, configs in speed.items():
        if not isinstance(configs, dict):
            continue
        for name, s in configs.items():
            label = {"auto": "this drafter (defaults)", "lookup": "context lookup alone"}.get(name, name)
            rows.append(
                f"| {key} | {label} | {s['speedup_median']:.2f}x ({s['speedup_min']:.2f}-{s['speedup_max']:.2f}) | "
                f"{s['tokens_per_step']:.2f} | {s['nodes_per_step']:.1f} |"
            )
    if rows:
        source = f" of `{made['held_out_file']}`" if made.get("held_out_file") else ""
        out += [
            "",
            f"Speed against plain decoding on {speed.get('prompts', 0)} held-out prompts{source}, {speed.get('max_tokens', 0)} new tokens, "
            "batch 1, alternating in one process (the median over prompts, min-max):",
            "",
            "| sampling | drafting | speed-up | tokens per step | nodes per step |",
            "|---|---|---|---|---|",
            *rows,
        ]
    return out


def _training_section(training: dict) -> list:
    """The card's data and training sections, from config.json's ``training``."""
    data, sizes, distilled = (
        training.get("data", []),
        training.get("data_sizes", []),
        training.get("distill_settings", []),
    )
    rows = [
        "| folder | sequences | generated tokens | max tokens | temperature | prompts |",
        "|---|---|---|---|---|---|",
    ]
    for i, path in enumerate(data):
        size = sizes[i] if i < len(sizes) else {}
        meta = distilled[i] if i < len(distilled) else {}
        cells = [
            size.get("sequences"),
            size.get("generated_tokens"),
            meta.get("max_tokens"),
            meta.get("temp"),
            meta.get("num_prompts"),
        ]
        rows.append(
            f"| `{path}` | "
            + " | ".join("" if c is None else f"{c:,}" if isinstance(c, int) else str(c) for c in cells)
            + " |"
        )
    fraction = training.get("eval_fraction", 0)
    held = (
        f"the answers to 1 prompt in {max(int(round(1 / fraction)), 2)} (by its index) are held out of training"
        if fraction > 0
        else "no prompts are held out"
    )
    settings = [(f"`{key}`", training[key]) for key in asdict(TrainConfig()) if key in training]
    steps, batch, positions = training.get("steps"), training.get("batch_size"), training.get("positions")
    section = [
        "## Data",
        "",
        f"The base model's own answers (`redrafter-mlx distill`), {training.get('sequences', 0):,} sequences; {held}.",
        "",
        *rows,
        "",
        "## Training",
        "",
        _table(settings),
        "",
    ]
    if steps and batch and positions:
        section.append(
            f"{steps:,} steps of {batch:,} positions: {steps * batch / positions:.2f} epochs of {positions:,} training positions"
            + (f"; {training['seconds_this_run']:,} s in the last run." if "seconds_this_run" in training else ".")
        )
    if "eval_accuracy" in training:
        accuracy = " ".join(f"{a:.3f}" for a in training["eval_accuracy"])
        section += [
            "",
            f"Held out: loss {training.get('eval_loss')}; top-1 accuracy at depths 1-{len(training['eval_accuracy'])}: {accuracy}.",
        ]
    return section
