"""The training loss and the training loop.

The objective, matching how the drafter is used at inference: at every
position t of a distilled sequence whose next token x[t+1] is generated (not
prompt), take the frozen base model's last hidden state h[t]; feed the RNN
the next T tokens x[t+1] .. x[t+T] (teacher forcing) and score its
predictions of x[t+2] .. x[t+T+1]. The loss is the sum over depths of the
mean cross-entropy at that depth (``drafter_loss``). (At inference x[t+1] is
the token the base model has just chosen, column 0 of the beams.)

Two options start from what the base model already knows. ``warm_start``
(exit_dim = hidden_size) makes the drafter's first prediction the base
model's own: the input projection passes h through, the residual blocks start
as the identity, and the vocab projection starts as the base model's output
head rows of the draft vocabulary; ``freeze_head_steps`` keeps that
projection fixed for the first steps (all of them: only the features are
trained, as EAGLE keeps the base model's head). ``hidden_loss`` > 0 adds, at each depth k,
the mean squared error between the drafter's features (what its vocab
projection reads) and h[t+k+1], the base model's own state for the target
(as EAGLE trains its drafter), so the drafter learns features, not only ids.

``Trainer`` holds the drafter, its optimizer, the data (``data``) and the
step; its data order and compiled step are deterministic, so that a run
resumed from a checkpoint (``checkpoints``) trains exactly as one that was
never stopped. ``train`` runs it to the last step, evaluating on held-out
positions and saving checkpoints as it goes; ``Trainer.export`` writes the
finished drafter, with its model card (``card``), into the output folder.
"""

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from .. import files
from ..drafting.datastore import FILE as DATASTORE_FILE
from ..drafting.drafter import WEIGHTS_FILE, Drafter, DrafterArgs, save_drafter
from ..errors import UserError
from ..loading.loader import MODEL_CARD_FILE
from .card import model_card
from .checkpoints import CHECKPOINT_DIR, EXPORT_DIR, publish, read_checkpoint, save_checkpoint, training_state_folder
from .config import TrainConfig
from .data import Positions, draft_index_map, draft_targets


def drafter_loss(
    drafter: Drafter,
    embed: Callable[[mx.array], mx.array],
    hidden: mx.array,
    tokens: mx.array,
    targets: mx.array,
    teacher_hidden: Optional[mx.array] = None,
    hidden_weight: float = 0.0,
) -> tuple[mx.array, mx.array, mx.array]:
    """The ReDrafter training loss.

    Args:
        hidden: (N, hidden_size) h[t].
        tokens: (N, T) RNN inputs x[t+1] .. x[t+T] (-1 past the end).
        targets: (N, T) draft-vocabulary index of x[t+2] .. x[t+T+1], -1
            where there is none (past the end, or outside a reduced draft
            vocabulary).
        teacher_hidden: (N, T, hidden_size) h[t+1] .. h[t+T], the states the
            targets were chosen from, needed when ``hidden_weight`` > 0.
        hidden_weight: adds ``hidden_weight`` times the mean over dimensions
            of the squared error between the drafter's features and them,
            where the target exists (exit_dim must equal hidden_size).

    Returns:
        loss: sum over depths of the mean per-position loss at that depth.
        correct, counted: (T,) top-1 hits (against ``targets``) and scored
            positions per depth.
    """
    state, loss, correct, counted = None, mx.array(0.0), [], []
    for k in range(tokens.shape[1]):
        state = drafter.update_state(embed(mx.maximum(tokens[:, k], 0)), state)
        features = drafter.features(hidden, state)
        logits = drafter.lm_head[-1](features).astype(mx.float32)
        valid = targets[:, k] >= 0
        target = mx.maximum(targets[:, k], 0)
        ce = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, target[:, None], axis=-1)[:, 0]
        if hidden_weight > 0:
            error = (features.astype(mx.float32) - teacher_hidden[:, k]).square().mean(axis=-1)
            ce = ce + hidden_weight * error
        n = valid.sum()
        loss = loss + (ce * valid).sum() / mx.maximum(n, 1)
        correct.append(((mx.argmax(logits, axis=-1) == target) & valid).sum())
        counted.append(n)
    return loss, mx.stack(correct), mx.stack(counted)


def warm_start(drafter: Drafter, base, draft_token_ids: Optional[np.ndarray]) -> None:
    """Make ``drafter`` (exit_dim = hidden_size) predict what the base
    model's head predicts from h: input projection [I 0], residual blocks
    the identity, vocab projection the head's rows of the draft vocabulary."""
    size = base.hidden_size
    drafter.input_proj.weight = mx.concatenate([mx.eye(size), mx.zeros((size, size))], axis=1)
    drafter.input_proj.bias = mx.zeros((size,))
    for block in drafter.lm_head[:-1]:
        block.linear.weight = mx.zeros_like(block.linear.weight)
        block.linear.bias = mx.zeros_like(block.linear.bias)
    ids = draft_token_ids if draft_token_ids is not None else np.arange(base.vocab_size)
    drafter.lm_head[-1].weight = base.head_rows(mx.array(ids))


class Trainer:
    """Holds the drafter, optimizer, data and step counter; resumable."""

    def __init__(
        self,
        base,
        positions: Positions,
        hidden_cache: np.ndarray,
        config: TrainConfig,
        output: str,
        draft_token_ids: Optional[np.ndarray],
    ):
        """``output``: the drafter folder ``export`` writes; checkpoints go
        to its training state folder (``training_state_folder``)."""
        self.base, self.config, self.output = base, config, Path(output)
        self.state_folder = training_state_folder(output)
        self.positions, self.hidden_cache = positions, hidden_cache
        self.train_rows = np.flatnonzero(~positions.held_out)
        self.eval_rows = np.flatnonzero(positions.held_out)
        if len(self.train_rows) < config.batch_size:
            raise UserError(
                f"only {len(self.train_rows)} training positions, fewer than one batch of {config.batch_size}"
            )
        args = DrafterArgs(
            vocab_size=base.vocab_size,
            hidden_size=base.hidden_size,
            exit_dim=config.exit_dim,
            num_draft_layers=config.num_draft_layers,
            draft_vocab_size=len(draft_token_ids) if draft_token_ids is not None else None,
            sorted_draft_vocab=draft_token_ids is not None,  # build_draft_vocab: most frequent first
        )
        if (config.warm_start or config.hidden_loss > 0) and config.exit_dim != base.hidden_size:
            raise UserError(
                f"a warm start and the hidden-state loss need an exit dim equal to the base model's hidden size {base.hidden_size}"
            )
        mx.random.seed(config.seed)
        self.drafter = Drafter(args)
        if config.warm_start:
            warm_start(self.drafter, base, draft_token_ids)
        self.to_draft = draft_index_map(base.vocab_size, draft_token_ids)
        if draft_token_ids is not None:
            self.drafter.draft_token_ids = mx.array(draft_token_ids)
        if config.dtype == "bfloat16":
            self.drafter.set_dtype(mx.bfloat16)  # floating arrays only: token ids stay int32
        if draft_token_ids is not None:
            self.drafter.freeze(keys=["draft_token_ids"], strict=False)
        schedule = optim.join_schedules(
            [
                optim.linear_schedule(1e-7, config.learning_rate, max(config.warmup, 1)),
                optim.cosine_decay(config.learning_rate, max(config.steps - config.warmup, 1), 0.0),
            ],
            [max(config.warmup, 1)],
        )
        self.optimizer = optim.AdamW(learning_rate=schedule, weight_decay=config.weight_decay)
        self.optimizer.init(self.drafter.trainable_parameters())
        self.step = self._saved_step = 0
        self.head_frozen = False
        self._set_head_frozen(config.freeze_head_steps > 0)
        self.embed = lambda t: mx.stop_gradient(base.embed(t))
        self._compiled_step = None  # built on first use, after any checkpoint is loaded

    def _set_head_frozen(self, frozen: bool) -> None:
        """Freeze or unfreeze the vocab projection and rebuild the compiled
        step. The optimizer's state for it, made before any freezing, stays
        zero while it is frozen."""
        if frozen == self.head_frozen:
            return
        if frozen:
            self.drafter.lm_head[-1].freeze()
        else:
            self.drafter.lm_head[-1].unfreeze()
        self.head_frozen, self._compiled_step = frozen, None

    def _make_train_step(self):
        loss_and_grad = nn.value_and_grad(self.drafter, self._loss)

        def train_step(*batch):
            (loss, correct, counted), grads = loss_and_grad(*batch)
            grads, _ = optim.clip_grad_norm(grads, self.config.grad_clip)
            self.optimizer.update(self.drafter, grads)
            return loss

        state = [self.drafter.state, self.optimizer.state]
        return mx.compile(train_step, inputs=state, outputs=state)

    def _loss(self, hidden, tokens, targets, teacher_hidden=None):
        return drafter_loss(self.drafter, self.embed, hidden, tokens, targets, teacher_hidden, self.config.hidden_loss)

    def batch(self, rows: np.ndarray) -> tuple:
        """Arrays for ``_loss``: h[t] (n, hidden), RNN inputs (n, T),
        targets (n, T) and, with the hidden loss, h[t+1] .. h[t+T] (n, T,
        hidden), the states the base model chose each target from."""
        hidden_rows = self.positions.hidden_row[rows]
        hidden = mx.array(self.hidden_cache[hidden_rows].astype(np.float32))
        window = self.positions.tokens[rows]
        targets = draft_targets(self.to_draft, window[:, 1:])
        arrays = (hidden, mx.array(window[:, :-1]), mx.array(targets))
        if self.config.hidden_loss == 0:
            return arrays
        # h[t+k+1] is the next row of the same sequence wherever x[t+k+2]
        # exists; elsewhere the target is masked, so any row will do.
        depth = self.config.depth
        teacher_rows = np.minimum(hidden_rows[:, None] + 1 + np.arange(depth), len(self.hidden_cache) - 1)
        teacher = self.hidden_cache[teacher_rows.reshape(-1)].astype(np.float32).reshape(len(rows), depth, -1)
        return arrays + (mx.array(teacher),)

    def rows_for_step(self, step: int) -> np.ndarray:
        """Deterministic data order: a fresh permutation each epoch."""
        per_epoch = len(self.train_rows) // self.config.batch_size
        epoch, index = divmod(step, per_epoch)
        order = np.random.default_rng(self.config.seed + epoch).permutation(len(self.train_rows))
        return np.sort(self.train_rows[order[index * self.config.batch_size : (index + 1) * self.config.batch_size]])

    def train_step(self) -> float:
        self._set_head_frozen(self.step < self.config.freeze_head_steps)
        if self._compiled_step is None:
            self._compiled_step = self._make_train_step()
        loss = self._compiled_step(*self.batch(self.rows_for_step(self.step)))
        mx.eval(loss, self.drafter.parameters(), self.optimizer.state)
        self.step += 1
        return loss.item()

    def evaluate(self, max_rows: int = 50000) -> dict:
        """Loss and top-1 accuracy per depth on held-out positions."""
        rows = self.eval_rows[:max_rows]
        if len(rows) == 0:
            return {}
        total_loss, correct, counted, batches = 0.0, 0, 0, 0
        for start in range(0, len(rows), self.config.batch_size):
            loss, c, n = self._loss(*self.batch(rows[start : start + self.config.batch_size]))
            total_loss += loss.item()
            correct, counted, batches = correct + np.array(c), counted + np.array(n), batches + 1
        accuracy = (correct / np.maximum(counted, 1)).round(4).tolist()
        return {"eval_loss": round(total_loss / batches, 4), "eval_accuracy": accuracy}

    # -- checkpoints -------------------------------------------------------

    @property
    def checkpoint_folder(self) -> Path:
        return self.state_folder / CHECKPOINT_DIR

    def save_checkpoint(self) -> None:
        """Weights, optimizer state and step, in the training state folder
        (``checkpoints.save_checkpoint``: killed at any moment, it holds a
        whole checkpoint; on a full disk the last one is kept)."""
        save_checkpoint(self.state_folder, self.drafter, self.optimizer.state, self.step, self.config, self._saved_step)
        self._saved_step = self.step

    def load_checkpoint(self) -> bool:
        """Resume from the checkpoint in the training state folder, if there
        is one (False when there is none); a checkpoint saved with other
        settings is refused. Training goes on in the checkpoint's draft
        vocabulary, whatever the data given now would rank."""
        saved = read_checkpoint(self.state_folder, self.config)
        if saved is None:
            return False
        step, loaded, optimizer_state = saved
        self.drafter.update(loaded.parameters())
        if loaded.args.draft_vocab_size:
            # The head's rows are the checkpoint's draft vocabulary; data added
            # since may rank tokens otherwise, but targets must index those rows.
            self.to_draft = draft_index_map(self.base.vocab_size, np.array(loaded.draft_token_ids))
        self.optimizer.state = optimizer_state
        self.step = self._saved_step = step
        mx.eval(self.drafter.parameters(), self.optimizer.state)
        return True

    def export(self, extra_config: Optional[dict] = None) -> None:
        """Write the final drafter into the output folder, with its model
        card (made from ``extra_config``: the base model, the training
        settings, data and results). A datastore already in the folder
        stays, and the card describes it. The drafter is made in the
        training state folder and moved in file by file, ``config.json``
        last: a folder without it never loads as a drafter, so a run killed
        here leaves none that does."""
        staged = self.state_folder / EXPORT_DIR
        files.remove(staged)
        keeps = "the training checkpoint is kept: free space and run the same command again to finish"
        try:
            save_drafter(self.drafter, str(staged), extra_config)
            if (self.output / DATASTORE_FILE).exists():  # the card describes the datastore the folder holds
                try:
                    os.link(self.output / DATASTORE_FILE, staged / DATASTORE_FILE)
                except OSError:  # a file system without hard links
                    shutil.copyfile(self.output / DATASTORE_FILE, staged / DATASTORE_FILE)
            (staged / MODEL_CARD_FILE).write_text(model_card(staged, self.output.name))
            files.sync_tree(staged)
        except (OSError, RuntimeError) as e:
            files.remove(staged)
            raise files.failure(self.output / WEIGHTS_FILE, e, None, keeps) from None
        publish(staged, self.output)


def train(trainer: Trainer, progress: bool = True, log: Optional[Callable[[dict], None]] = None) -> dict:
    """Run (or resume) training to ``config.steps``; returns the last eval."""
    from tqdm import tqdm

    config = trainer.config
    bar = tqdm(total=config.steps, initial=trainer.step, unit="step", disable=not progress, dynamic_ncols=True)
    try:
        return _train(trainer, bar, log)
    finally:
        bar.close()  # on an error too, so that the error has a line of its own


def _train(trainer: Trainer, bar, log: Optional[Callable[[dict], None]]) -> dict:
    config = trainer.config
    tokens_per_step = config.batch_size * config.depth
    last_eval, tic = {}, time.perf_counter()
    while trainer.step < config.steps:
        loss = trainer.train_step()
        if not math.isfinite(loss):
            raise UserError(f"training diverged at step {trainer.step} (loss {loss}); lower the learning rate")
        elapsed, tic = time.perf_counter() - tic, time.perf_counter()
        bar.update(1)
        bar.set_postfix_str(f"loss {loss:.3f}, {tokens_per_step / elapsed:.0f} tokens/s")
        record = {"step": trainer.step, "loss": round(loss, 4)}
        if trainer.step % config.eval_every == 0 or trainer.step == config.steps:
            last_eval = trainer.evaluate()
            record.update(last_eval)
            bar.write(json.dumps(record))
        if log:
            log(record)
        if trainer.step % config.save_every == 0 or trainer.step == config.steps:
            trainer.save_checkpoint()
    return last_eval
