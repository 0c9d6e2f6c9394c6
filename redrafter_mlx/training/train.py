"""``redrafter-mlx train``: training a drafter on distilled data, in MLX.

``train_drafter`` is the command: it checks the output and training state
folders, loads the base model and the data folders, makes the training
positions and hidden-state cache (``data``), trains, resuming from the last
checkpoint (``trainer``, ``checkpoints``), and exports the finished drafter
with its model card (``card``). The settings are a ``TrainConfig``
(``config``).

The output: ``train --output OUTPUT`` writes the finished drafter, and only
it, into ``OUTPUT/``: ``config.json`` (naming the base model's identity, by
which the loader matches a drafter to its model), ``model.safetensors`` and
a generated model card ``README.md`` (``datastore`` adds ``datastore.npy``).
The folder loads as it is (``--drafter OUTPUT``) and uploads to the Hugging
Face Hub as it is (``hf upload owner/name OUTPUT``), since the upload takes
every file in it. The training state, the resumable ``checkpoint/`` and
``train_log.jsonl``, goes to the sibling folder ``OUTPUT.train/``: outside
the drafter, so neither the loader nor an upload ever sees it. Runs begun
before this layout kept that state inside ``OUTPUT/``; resuming one moves
it out (``checkpoints.move_old_training_state``).
"""

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

from ..errors import UserError
from .card import base_model_entry
from .checkpoints import (
    CHECKPOINT_DIR,
    LOG_FILE,
    check_training_state_folder,
    keep_log_until,
    move_old_training_state,
    recover_checkpoint,
    training_state_folder,
)
from .config import TrainConfig
from .data import StackedRows, build_draft_vocab, build_positions, cached_positions, compute_hidden_cache
from .distill import Sequences, data_folders
from .trainer import Trainer, train


def train_drafter(
    data: list,
    output: str,
    config: TrainConfig,
    model: Optional[str] = None,
    dtype: Optional[str] = "auto",
    resumed: Optional[Callable[[int], None]] = None,
) -> dict:
    """``redrafter-mlx train``: train a drafter for ``model`` (None: the
    embedded one; it must be the model the data was distilled from) on the
    data folders ``data``; the finished drafter goes to the folder
    ``output`` and the training state to ``output``.train/ (see the module's
    docstring), from whose checkpoint a run resumes (``resumed(step)`` is
    told); returns the last evaluation."""
    from ..engine.base_model import BaseModel
    from ..loading.loader import load_base_model, model_identity

    out, state = Path(output), training_state_folder(output)
    if out.exists() and not out.is_dir():
        raise UserError(f"output {output} is a file, not a folder")
    check_training_state_folder(state)
    if state.is_dir():
        recover_checkpoint(state)
    if (out / CHECKPOINT_DIR).is_dir():
        move_old_training_state(out, state)
    if (
        out.exists()
        and any(not p.name.startswith(".") for p in out.iterdir())
        and not (state / CHECKPOINT_DIR).is_dir()
    ):
        raise UserError(
            f"output folder {output} exists and {state} holds no training checkpoint to resume; use a new output folder"
        )
    folders = data_folders(data)
    for folder in folders:
        if folder.meta is None:
            raise UserError(f"{folder.path} is not a distillation data folder (run `redrafter-mlx distill` first)")
    base_model, tokenizer = load_base_model(model, dtype)
    base = BaseModel(base_model)
    metas = [folder.check_model(base.vocab_size, base.hidden_size) for folder in folders]
    parts = [folder.load() for folder in folders]
    # Rows of the stacked hidden states follow the concatenated sequences' positions.
    hidden = StackedRows([compute_hidden_cache(base, folder, part) for folder, part in zip(folders, parts)])
    sequences = Sequences.concatenate(parts)
    positions = build_positions(sequences, config.depth, config.eval_fraction)
    vocab = build_draft_vocab(sequences, config.draft_vocab) if config.draft_vocab else None
    state.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(base, positions, hidden, config, output, vocab)
    if trainer.load_checkpoint() and resumed is not None:
        resumed(trainer.step)
    keep_log_until(state / LOG_FILE, trainer.step)
    started = time.time()
    with open(state / LOG_FILE, "a") as log:
        result = train(trainer, log=lambda record: log.write(json.dumps(record) + "\n"))
    if not result:  # resumed at the last step: nothing trained, measure again for the card
        result = trainer.evaluate()
    trainer.export(
        {
            "base_model": base_model_entry(model, model_identity(base, tokenizer)),
            "training": dict(
                asdict(config),
                data=list(data),
                sequences=len(sequences),
                positions=int((~positions.held_out).sum()),
                distill_settings=[{k: meta.get(k) for k in ("max_tokens", "temp", "num_prompts")} for meta in metas],
                data_sizes=[
                    {"sequences": len(part), "generated_tokens": int(cached_positions(part).sum())} for part in parts
                ],
                seconds_this_run=round(time.time() - started),
                **result,
            ),
        }
    )
    return result
