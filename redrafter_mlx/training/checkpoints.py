"""The training state folder: checkpoints, the log, and resuming a run.

``train --output OUTPUT`` keeps its training state, the resumable
``checkpoint/`` and ``train_log.jsonl``, in the sibling folder
``OUTPUT.train/`` (``training_state_folder``): outside the drafter folder,
so neither the loader nor an upload ever sees it. Runs begun before this
layout kept that state inside ``OUTPUT/``; resuming one moves it out
(``move_old_training_state``).

Every file is written so that a run killed at any moment leaves whole files
behind: a checkpoint is written beside, flushed and renamed into place
(``save_checkpoint``), the one before moved aside first and put back if the
run died in between (``recover_checkpoint``); the finished drafter is made
in ``OUTPUT.train/export/`` and moved into ``OUTPUT/`` file by file,
``config.json`` last (``publish``). A resumed run reads its checkpoint
(``read_checkpoint``), refusing one saved with other settings, and drops the
log's records of the steps it trains again (``keep_log_until``).
"""

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .. import files
from ..drafting.drafter import CONFIG_FILE, Drafter, load_drafter, save_drafter
from ..errors import UserError
from .config import RETIRED_SETTINGS, TrainConfig

CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "trainer.json"
OPTIMIZER_FILE = "optimizer.safetensors"
LOG_FILE = "train_log.jsonl"
STATE_SUFFIX = ".train"  # OUTPUT.train/ beside the drafter folder OUTPUT/ holds the training state
EXPORT_DIR = "export"  # where the finished drafter is made before it is moved into the output folder
# What the training state folder may hold: the checkpoint (and the
# temporary names save_checkpoint renames through), the drafter being
# exported and the log.
STATE_NAMES = {CHECKPOINT_DIR, CHECKPOINT_DIR + ".tmp", CHECKPOINT_DIR + ".old", EXPORT_DIR, LOG_FILE}


def training_state_folder(output) -> Path:
    """Where a run's checkpoint and log go: ``OUTPUT.train/``, the sibling
    of the drafter folder ``OUTPUT`` (a trailing "/", "." and ".." are
    resolved first, so that it is never inside it)."""
    out = Path(os.path.abspath(output))
    if not out.name:
        raise UserError(f"the output folder cannot be {output}")
    return out.with_name(out.name + STATE_SUFFIX)


def check_training_state_folder(state: Path) -> None:
    """Refuse a ``OUTPUT.train`` that holds anything but training state
    (say, a folder of the user's that happens to have that name)."""
    if not state.exists():
        return
    if not state.is_dir():
        raise UserError(f"{state} (where training keeps its checkpoint) is a file; move it away")
    foreign = sorted(p.name for p in state.iterdir() if p.name not in STATE_NAMES and not p.name.startswith("."))
    if foreign:
        raise UserError(
            f"{state} (where training keeps its checkpoint) holds other files ({', '.join(foreign[:3])}); use another output folder"
        )


def move_old_training_state(output: Path, state: Path) -> None:
    """Resume a run begun when the checkpoint and log lived inside the
    drafter folder: move them to the training state folder (a rename, on
    the same file system), leaving the drafter folder to the drafter."""
    if (state / CHECKPOINT_DIR).exists():
        raise UserError(
            f"both {output / CHECKPOINT_DIR} (an older layout) and {state / CHECKPOINT_DIR} exist; remove the one not to resume"
        )
    state.mkdir(parents=True, exist_ok=True)
    for name in sorted(STATE_NAMES - {LOG_FILE}):
        if (output / name).exists():
            (output / name).rename(state / name)
    old_log, new_log = output / LOG_FILE, state / LOG_FILE
    if old_log.exists():  # the older records first, before any this layout wrote
        new_log.write_text(old_log.read_text() + (new_log.read_text() if new_log.exists() else ""))
        old_log.unlink()
    print(
        f"note: moved the training checkpoint and log from {output} to {state}; {output} now holds only the drafter",
        file=sys.stderr,
    )


def keep_log_until(path: Path, step: int) -> None:
    """Drop the log's records of steps after ``step``, the checkpoint a run
    resumes from: a killed run logged steps it trains again, and its last
    line may be cut short."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line + "\n")
    files.write_text(path, "".join(kept))


def save_checkpoint(
    state: Path, drafter: Drafter, optimizer_state, step: int, config: TrainConfig, kept_step: int
) -> None:
    """The drafter's weights, the optimizer's state, the step and the
    settings, as ``state/checkpoint/``: written to a temporary folder,
    flushed, and renamed into place; the one before (of step
    ``kept_step``) is moved aside first and removed last. Killed at any
    moment, the state folder holds a whole checkpoint under one of the two
    names (``recover_checkpoint``); on a full disk the last one is kept."""
    final = state / CHECKPOINT_DIR
    temporary = state / (CHECKPOINT_DIR + ".tmp")
    old = state / (CHECKPOINT_DIR + ".old")
    files.remove(temporary)
    optimizer = dict(tree_flatten(optimizer_state))
    needed = sum(v.nbytes for _, v in tree_flatten(drafter.parameters())) + sum(v.nbytes for v in optimizer.values())
    keeps = f"the checkpoint of step {kept_step} is kept: free space and run the same command again to resume"
    try:
        save_drafter(drafter, str(temporary))
        mx.save_safetensors(str(temporary / OPTIMIZER_FILE), optimizer)
        (temporary / STATE_FILE).write_text(json.dumps({"step": step, "config": asdict(config)}, indent=2))
        files.sync_tree(temporary)
    except (OSError, RuntimeError) as e:
        files.remove(temporary)
        raise files.failure(final, e, needed, keeps) from None
    if final.exists():
        files.remove(old)
        final.rename(old)
    temporary.rename(final)
    files.sync_folder(state)
    files.remove(old)


def recover_checkpoint(state: Path) -> None:
    """Put back the checkpoint that a run killed while saving the next one
    left moved aside (``save_checkpoint``), and remove what it left
    half-written."""
    final, old = state / CHECKPOINT_DIR, state / (CHECKPOINT_DIR + ".old")
    if not (final / STATE_FILE).exists() and (old / STATE_FILE).exists():
        files.remove(final)
        old.rename(final)
    files.remove(old)
    files.remove(state / (CHECKPOINT_DIR + ".tmp"))


def read_checkpoint(state: Path, config: TrainConfig) -> Optional[tuple[int, Drafter, dict]]:
    """The checkpoint in the training state folder ``state`` (recovered
    first), as (step, drafter, optimizer state); None when there is none. A
    checkpoint saved with settings other than ``config`` is refused
    (``UserError``); settings added since take their defaults, and retired
    ones count only when they were not at their neutral values."""
    recover_checkpoint(state)
    folder = state / CHECKPOINT_DIR
    if not (folder / STATE_FILE).exists():
        return None
    saved_state = json.loads((folder / STATE_FILE).read_text())
    current = asdict(config)
    saved = {k: v for k, v in saved_state["config"].items() if k in current or RETIRED_SETTINGS.get(k, v) != v}
    saved = dict(asdict(TrainConfig()), **saved)  # settings added since take their defaults
    if saved != current:
        changed = [k for k in saved if saved[k] != current.get(k)]
        raise UserError(f"{folder} was trained with other settings ({', '.join(changed)}); use a new output folder")
    loaded = load_drafter(str(folder))
    optimizer_state = tree_unflatten(list(mx.load(str(folder / OPTIMIZER_FILE)).items()))
    return saved_state["step"], loaded, optimizer_state


def publish(staged: Path, output: Path) -> None:
    """Move a drafter made in ``staged`` into the folder ``output`` (made if
    missing), each file by one rename, ``config.json`` last (the loader
    needs it), and remove ``staged``. Both are on one file system."""
    output.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in staged.iterdir() if p.name != CONFIG_FILE) + [CONFIG_FILE]
    for name in names:
        os.replace(staged / name, output / name)
    files.sync_folder(output)
    files.remove(staged)
