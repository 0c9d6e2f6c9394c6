"""Training a drafter on distilled data, in MLX.

The objective, matching how the drafter is used at inference: at every
position t of a distilled sequence whose next token x[t+1] is generated (not
prompt), take the frozen base model's last hidden state h[t]; feed the RNN
the next T tokens x[t+1] .. x[t+T] (teacher forcing) and score its
predictions of x[t+2] .. x[t+T+1]. The loss is the sum over depths of the
mean cross-entropy at that depth. (At inference x[t+1] is the token the base
model has just chosen, column 0 of the beams.)

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

Hidden states come from the data folder: ``distill`` saves them beside each
shard, and shards without them are run through the base model once, a batch
of sequences at a time. Training reads them from a float16 memory-mapped
file, so they are never all in memory.

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
it out (``move_old_training_state``).
"""

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..drafting.datastore import BOUNDARY16
from ..drafting.datastore import FILE as DATASTORE_FILE
from ..drafting.drafter import CONFIG_FILE, WEIGHTS_FILE, Drafter, DrafterArgs, load_drafter, read_config, save_drafter
from .. import files
from ..errors import UserError
from ..loading.loader import MODEL_CARD_FILE, is_hub_id
from .distill import DataFolder, Sequences, data_folders, hidden_path

HIDDEN_FILE = "hidden.f16.npy"
HIDDEN_INDEX = "hidden-index.json"  # which shards the cache was built from
CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "trainer.json"
OPTIMIZER_FILE = "optimizer.safetensors"
LOG_FILE = "train_log.jsonl"
STATE_SUFFIX = ".train"  # OUTPUT.train/ beside the drafter folder OUTPUT/ holds the training state
# What the training state folder may hold: the checkpoint (and the
# temporary names save_checkpoint renames through) and the log.
EXPORT_DIR = "export"  # where the finished drafter is made before it is moved into the output folder
STATE_NAMES = {CHECKPOINT_DIR, CHECKPOINT_DIR + ".tmp", CHECKPOINT_DIR + ".old", EXPORT_DIR, LOG_FILE}
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded default model (load_base_model(None))


@dataclass
class TrainConfig:
    """A training run's settings; checked when made (``UserError``)."""

    depth: int = 5  # T: drafted tokens per position
    exit_dim: int = 1024
    num_draft_layers: int = 1
    draft_vocab: int = 0  # 0: the full vocabulary (official format)
    dtype: str = "float32"  # of the drafter: float32 or bfloat16
    steps: int = 2000
    batch_size: int = 1024  # positions per step
    learning_rate: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.0
    warm_start: bool = False  # start from the base model's head (exit_dim = hidden_size)
    freeze_head_steps: int = 0  # with warm_start: the vocab projection stays the base head's for these steps
    hidden_loss: float = 0.0  # weight of the features' squared error to h[t+k+1] (exit_dim = hidden_size)
    grad_clip: float = 1.0
    eval_every: int = 250
    save_every: int = 250
    eval_fraction: float = 0.02  # of sequences, held out by prompt index
    seed: int = 0

    def __post_init__(self):
        minimums = dict(depth=1, exit_dim=1, num_draft_layers=0, draft_vocab=0, steps=1, batch_size=1, warmup=0,
                        freeze_head_steps=0, hidden_loss=0, eval_every=1, save_every=1)
        for name, low in minimums.items():
            if getattr(self, name) < low:
                raise UserError(f"{name.replace('_', ' ')} must be at least {low}, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise UserError(f"the drafter trains in float32 or bfloat16, not {self.dtype}")
        if self.freeze_head_steps and not self.warm_start:
            raise UserError("freezing the head needs a warm start (it keeps the base model's head)")


# Settings of earlier versions, and the value that made them no-ops: a
# checkpoint saved with these values resumes under today's settings.
RETIRED_SETTINGS = {"rnn": True, "hidden_dropout": 0.0, "soft_targets": 0.0, "lookup_weight": 1.0}


@dataclass
class Positions:
    """Training positions, one row each.

    hidden_row: (R,) row of h[t] in the hidden cache.
    tokens: (R, T + 1) x[t+1] .. x[t+T+1], -1 past the sequence's end.
    held_out: (R,) bool, rows of held-out sequences.
    """

    hidden_row: np.ndarray
    tokens: np.ndarray
    held_out: np.ndarray


def cached_positions(sequences: Sequences) -> np.ndarray:
    """(n,) number of positions t with a generated x[t+1]: t = P-1 .. L-2."""
    return np.maximum(sequences.lengths - sequences.prompt_lengths, 0)


def held_out_sequences(prompt_index: np.ndarray, eval_fraction: float) -> np.ndarray:
    """(n,) bool: the sequences held out from training, by their prompt's
    index (every round(1 / eval_fraction)-th prompt; none for 0)."""
    if eval_fraction <= 0:
        return np.zeros(len(prompt_index), bool)
    return np.asarray(prompt_index) % max(int(round(1 / eval_fraction)), 2) == 0


def build_positions(sequences: Sequences, depth: int, eval_fraction: float) -> Positions:
    """All training positions, in order: every sequence's t = P-1 .. L-2."""
    counts = cached_positions(sequences)
    starts = np.concatenate([[0], np.cumsum(sequences.lengths)[:-1]])
    rows, windows, held = [], [], []
    held_out = held_out_sequences(sequences.prompt_index, eval_fraction)
    row = 0
    for i, n in enumerate(counts):
        seq = sequences.tokens[starts[i] : starts[i] + sequences.lengths[i]]
        padded = np.concatenate([seq, np.full(depth + 1, -1, np.int64)])
        first = sequences.prompt_lengths[i] - 1  # t of the first position
        index = first + 1 + np.arange(n)[:, None] + np.arange(depth + 1)[None, :]
        windows.append(padded[index])
        rows.append(np.arange(row, row + n))
        held.append(np.full(n, held_out[i]))
        row += n
    return Positions(np.concatenate(rows), np.concatenate(windows).astype(np.int32), np.concatenate(held))


def compute_hidden_cache(base, folder: DataFolder, sequences: Sequences, batch_tokens: int = 8192, progress: bool = True) -> np.ndarray:
    """h[t] for every training position, as a float16 (R, hidden) memmap.

    Each shard's hidden states live beside it (``hidden-NNNNN.npy``), saved
    by ``distill`` or computed here by the base model for shards without
    them, one shard at a time (an interruption loses at most one shard's
    work). The training cache is their concatenation, rebuilt when the
    shards change.
    """
    from tqdm import tqdm

    shards = folder.shards()
    for shard in tqdm(shards, desc="hidden states", unit="shard", disable=not progress):
        _shard_hidden(base, shard, batch_tokens)
    sizes = [int(np.load(hidden_path(shard), mmap_mode="r").shape[0]) for shard in shards]
    if sum(sizes) != int(cached_positions(sequences).sum()):
        raise UserError(f"hidden states in {folder.path} do not match its shards; delete hidden-*.npy and rerun")
    path, identity_path = folder.path / HIDDEN_FILE, folder.path / HIDDEN_INDEX
    identity = [[shard.name, size] for shard, size in zip(shards, sizes)]
    if not (path.exists() and identity_path.exists() and json.loads(identity_path.read_text()) == identity):
        # Written front to back (a memory map of a file on a full disk
        # would crash the process when a page is written), then named.
        files.remove(identity_path)
        shape = (sum(sizes), base.hidden_size)
        keeps = "the distilled data is intact: free space and run the same command again"
        with files.replacing(path, 2 * shape[0] * shape[1] + 128, keeps) as temporary:
            with open(temporary, "wb") as f:
                np.lib.format.write_array_header_1_0(f, {"descr": np.dtype(np.float16).str, "fortran_order": False, "shape": shape})
                for shard in shards:
                    f.write(np.ascontiguousarray(np.load(hidden_path(shard)), np.float16).tobytes())
        files.write_text(identity_path, json.dumps(identity), keeps)
    return np.lib.format.open_memmap(path, mode="r")


def _shard_hidden(base, shard: Path, batch_tokens: int) -> None:
    """Write ``hidden-NNNNN.npy`` for a shard that lacks it."""
    with np.load(shard) as data:
        prompt_lengths, lengths, tokens = data["prompt_lengths"], data["lengths"], data["tokens"]
    target = hidden_path(shard)
    if target.exists() and np.load(target, mmap_mode="r").shape == (int((lengths - prompt_lengths).sum()), base.hidden_size):
        return
    states = response_hidden(base, prompt_lengths, lengths, tokens, batch_tokens)
    with files.replacing(target, states.nbytes, "the hidden states of earlier shards are kept: free space and run again") as temporary:
        with open(temporary, "wb") as f:
            np.save(f, states)


def response_hidden(base, prompt_lengths: np.ndarray, lengths: np.ndarray, tokens: np.ndarray, batch_tokens: int = 8192) -> np.ndarray:
    """(positions, hidden_size) float16 h[t] at t = P-1 .. L-2 of each
    sequence (``tokens`` back to back, ``lengths`` L and ``prompt_lengths``
    P per sequence), in order, from batches of right-padded sequences
    (causal attention makes the padding harmless). Batches are made in
    order of length, which cuts the padding computed."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    parts = [None] * len(lengths)
    for members in length_batches(lengths, batch_tokens):
        batch = np.zeros((len(members), int(lengths[members[-1]])), np.int32)
        for row, k in enumerate(members):
            batch[row, : lengths[k]] = tokens[starts[k] : starts[k] + lengths[k]]
        hidden = np.array(base.backbone(mx.array(batch)).astype(mx.float16))
        for row, k in enumerate(members):
            parts[k] = hidden[row, prompt_lengths[k] - 1 : lengths[k] - 1]
    return np.concatenate(parts)


def length_batches(lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Indices of sequences grouped in order of length, shortest first, each
    group as large as fits ``batch_tokens`` padded positions (its longest
    length times its size; a longer sequence makes a group alone)."""
    order = np.argsort(lengths, kind="stable")
    groups, i = [], 0
    while i < len(order):
        j = i + 1
        while j < len(order) and lengths[order[j]] * (j + 1 - i) <= batch_tokens:
            j += 1
        groups.append(order[i:j])
        i = j
    return groups


class StackedRows:
    """Rows of several 2-D arrays (the hidden-state memmaps of several data
    folders) seen as one array, without copying them: ``stacked[rows]``
    gathers from each part."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(p) for p in parts])
        self.shape = (int(self.offsets[-1]), parts[0].shape[1])

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        """(n,) row numbers -> (n, width), in the order given."""
        rows = np.asarray(rows)
        part = np.searchsorted(self.offsets, rows, side="right") - 1
        out = np.empty((len(rows), self.shape[1]), self.parts[0].dtype)
        for i, array in enumerate(self.parts):
            mask = part == i
            if mask.any():
                out[mask] = array[rows[mask] - self.offsets[i]]
        return out


def build_draft_vocab(sequences: Sequences, size: int) -> np.ndarray:
    """The ``size`` most frequent generated tokens, most frequent first."""
    starts = np.concatenate([[0], np.cumsum(sequences.lengths)[:-1]])
    generated = np.concatenate(
        [sequences.tokens[s + p : s + l] for s, p, l in zip(starts, sequences.prompt_lengths, sequences.lengths)]
    )
    counts = np.bincount(generated)
    order = np.argsort(-counts, kind="stable")[:size]
    return order.astype(np.int32)


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


def draft_index_map(vocab_size: int, draft_token_ids: Optional[np.ndarray]) -> np.ndarray:
    """(vocab_size,) each token id's index in the draft vocabulary, -1
    outside it; the identity without a reduced draft vocabulary."""
    if draft_token_ids is None:
        return np.arange(vocab_size, dtype=np.int32)
    to_draft = np.full(vocab_size, -1, np.int32)
    to_draft[np.asarray(draft_token_ids)] = np.arange(len(draft_token_ids), dtype=np.int32)
    return to_draft


def draft_targets(to_draft: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Token ids (-1 past the end of a sequence) as draft indices; -1, never
    counted as a target, past the end or outside the draft vocabulary."""
    return np.where(tokens >= 0, to_draft[np.maximum(tokens, 0)], -1)


class Trainer:
    """Holds the drafter, optimizer, data and step counter; resumable."""

    def __init__(self, base, positions: Positions, hidden_cache: np.ndarray, config: TrainConfig, output: str, draft_token_ids: Optional[np.ndarray]):
        """``output``: the drafter folder ``export`` writes; checkpoints go
        to its training state folder (``training_state_folder``)."""
        self.base, self.config, self.output = base, config, Path(output)
        self.state_folder = training_state_folder(output)
        self.positions, self.hidden_cache = positions, hidden_cache
        self.train_rows = np.flatnonzero(~positions.held_out)
        self.eval_rows = np.flatnonzero(positions.held_out)
        if len(self.train_rows) < config.batch_size:
            raise UserError(f"only {len(self.train_rows)} training positions, fewer than one batch of {config.batch_size}")
        args = DrafterArgs(
            vocab_size=base.vocab_size,
            hidden_size=base.hidden_size,
            exit_dim=config.exit_dim,
            num_draft_layers=config.num_draft_layers,
            draft_vocab_size=len(draft_token_ids) if draft_token_ids is not None else None,
            sorted_draft_vocab=draft_token_ids is not None,  # build_draft_vocab: most frequent first
        )
        if (config.warm_start or config.hidden_loss > 0) and config.exit_dim != base.hidden_size:
            raise UserError(f"a warm start and the hidden-state loss need an exit dim equal to the base model's hidden size {base.hidden_size}")
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
            [optim.linear_schedule(1e-7, config.learning_rate, max(config.warmup, 1)),
             optim.cosine_decay(config.learning_rate, max(config.steps - config.warmup, 1), 0.0)],
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
        """Weights, optimizer state and step, written to a temporary folder,
        flushed, and renamed into place; the one before is moved aside
        first and removed last. Killed at any moment, the state folder
        holds a whole checkpoint under one of the two names
        (``recover_checkpoint``); on a full disk the last one is kept."""
        final = self.checkpoint_folder
        temporary = self.state_folder / (CHECKPOINT_DIR + ".tmp")
        old = self.state_folder / (CHECKPOINT_DIR + ".old")
        files.remove(temporary)
        optimizer = dict(tree_flatten(self.optimizer.state))
        needed = sum(v.nbytes for _, v in tree_flatten(self.drafter.parameters())) + sum(v.nbytes for v in optimizer.values())
        keeps = f"the checkpoint of step {self._saved_step} is kept: free space and run the same command again to resume"
        try:
            save_drafter(self.drafter, str(temporary))
            mx.save_safetensors(str(temporary / OPTIMIZER_FILE), optimizer)
            (temporary / STATE_FILE).write_text(json.dumps({"step": self.step, "config": asdict(self.config)}, indent=2))
            files.sync_tree(temporary)
        except (OSError, RuntimeError) as e:
            files.remove(temporary)
            raise files.failure(final, e, needed, keeps) from None
        if final.exists():
            files.remove(old)
            final.rename(old)
        temporary.rename(final)
        files.sync_folder(self.state_folder)
        files.remove(old)
        self._saved_step = self.step

    def load_checkpoint(self) -> bool:
        """Resume from the checkpoint in the training state folder, if there
        is one (False when there is none); a checkpoint saved with other
        settings is refused. Training goes on in the checkpoint's draft
        vocabulary, whatever the data given now would rank."""
        recover_checkpoint(self.state_folder)
        folder = self.checkpoint_folder
        if not (folder / STATE_FILE).exists():
            return False
        state = json.loads((folder / STATE_FILE).read_text())
        current = asdict(self.config)
        saved = {k: v for k, v in state["config"].items() if k in current or RETIRED_SETTINGS.get(k, v) != v}
        saved = dict(asdict(TrainConfig()), **saved)  # settings added since take their defaults
        if saved != current:
            changed = [k for k in saved if saved[k] != current.get(k)]
            raise UserError(f"{folder} was trained with other settings ({', '.join(changed)}); use a new output folder")
        loaded = load_drafter(str(folder))
        self.drafter.update(loaded.parameters())
        if loaded.args.draft_vocab_size:
            # The head's rows are the checkpoint's draft vocabulary; data added
            # since may rank tokens otherwise, but targets must index those rows.
            self.to_draft = draft_index_map(self.base.vocab_size, np.array(loaded.draft_token_ids))
        self.optimizer.state = tree_unflatten(list(mx.load(str(folder / OPTIMIZER_FILE)).items()))
        self.step = self._saved_step = state["step"]
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


def recover_checkpoint(state: Path) -> None:
    """Put back the checkpoint that a run killed while saving the next one
    left moved aside (``Trainer.save_checkpoint``), and remove what it left
    half-written."""
    final, old = state / CHECKPOINT_DIR, state / (CHECKPOINT_DIR + ".old")
    if not (final / STATE_FILE).exists() and (old / STATE_FILE).exists():
        files.remove(final)
        old.rename(final)
    files.remove(old)
    files.remove(state / (CHECKPOINT_DIR + ".tmp"))


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


def train_drafter(data: list, output: str, config: TrainConfig, model: Optional[str] = None, dtype: Optional[str] = "auto",
                  resumed: Optional[Callable[[int], None]] = None) -> dict:
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
    if out.exists() and any(not p.name.startswith(".") for p in out.iterdir()) and not (state / CHECKPOINT_DIR).is_dir():
        raise UserError(f"output folder {output} exists and {state} holds no training checkpoint to resume; use a new output folder")
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
    trainer.export({
        "base_model": base_model_entry(model, model_identity(base, tokenizer)),
        "training": dict(asdict(config), data=list(data), sequences=len(sequences), positions=int((~positions.held_out).sum()),
                         distill_settings=[{k: meta.get(k) for k in ("max_tokens", "temp", "num_prompts")} for meta in metas],
                         data_sizes=[{"sequences": len(part), "generated_tokens": int(cached_positions(part).sum())} for part in parts],
                         seconds_this_run=round(time.time() - started), **result),
    })
    return result


# -- the output folder and its model card -------------------------------------


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
        raise UserError(f"{state} (where training keeps its checkpoint) holds other files ({', '.join(foreign[:3])}); use another output folder")


def move_old_training_state(output: Path, state: Path) -> None:
    """Resume a run begun when the checkpoint and log lived inside the
    drafter folder: move them to the training state folder (a rename, on
    the same file system), leaving the drafter folder to the drafter."""
    if (state / CHECKPOINT_DIR).exists():
        raise UserError(f"both {output / CHECKPOINT_DIR} (an older layout) and {state / CHECKPOINT_DIR} exist; remove the one not to resume")
    state.mkdir(parents=True, exist_ok=True)
    for name in sorted(STATE_NAMES - {LOG_FILE}):
        if (output / name).exists():
            (output / name).rename(state / name)
    old_log, new_log = output / LOG_FILE, state / LOG_FILE
    if old_log.exists():  # the older records first, before any this layout wrote
        new_log.write_text(old_log.read_text() + (new_log.read_text() if new_log.exists() else ""))
        old_log.unlink()
    print(f"note: moved the training checkpoint and log from {output} to {state}; {output} now holds only the drafter", file=sys.stderr)


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
    model_option = f"--model {base['hub_id']} " if base.get("hub_id") else "" if base.get("default") else "--model MODEL "
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
        f"redrafter-mlx generate {model_option}--drafter OWNER/NAME --prompt \"Hello\"",
        "```",
        "",
        "`--drafter` takes the Hub id this folder was uploaded to (downloaded once into the Hugging Face cache) or",
        "the folder itself."
        + (" `MODEL` is the base model, from any folder, Hub id or GGUF file that holds it." if model_option == "--model MODEL " else ""),
        "The drafter fits only its base model: `config.json` names the model's identity (`base_model.identity`, a",
        "digest of its shapes, vocabulary and first embeddings, the same however the model is stored), and the",
        "drafter's sizes must match the model's.",
        "",
        "## Base model",
        "",
        _table([("model", f"`{name}`" + (" (the default model of redrafter-mlx)" if base.get("default") else "")),
                ("identity", f"`{base['identity']}`" if base.get("identity") else "not recorded"),
                ("hidden size", args.hidden_size), ("vocabulary", f"{args.vocab_size:,} tokens")]),
        "",
        "## Drafter",
        "",
        _table([("`exit_dim`", args.exit_dim), ("residual blocks", args.num_draft_layers), ("RNN", "on" if args.rnn else "off"),
                ("draft vocabulary", f"the {args.draft_vocab_size:,} most frequent generated tokens" + (", most frequent first" if args.sorted_draft_vocab else "")
                 if args.draft_vocab_size else "the whole vocabulary"),
                ("parameters", f"{parameters / 1e6:.2f} M, {' and '.join(dtypes)} ({size:.1f} MB)"),
                ("datastore", datastore_summary(folder))]),
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
    out = ["## How it was made", "", "```bash", made.get("command", "redrafter-mlx make-drafter"), "```", "",
           _table([("model kind", "chat (its chat template applied)" if made.get("kind") == "chat" else "text (continues plain text)"),
                   ("prompts", f"`{made.get('prompts')}`: {made.get('train_prompts', 0):,} for training, {made.get('held_out_prompts', 0):,} held out"),
                   ("distillation", runs),
                   ("time", f"{made.get('hours', sum(minutes.values()) / 60):.2f} hours in all (" + ", ".join(f"{k} {v:.0f} min" for k, v in minutes.items())
                    + f"), {made.get('cpu_hours', 0):.1f} CPU hours")]
                  + ([("note", made["note"])] if made.get("note") else []))]
    speed = made.get("held_out_speed") or {}
    rows = []
    for key, configs in speed.items():
        if not isinstance(configs, dict):
            continue
        for name, s in configs.items():
            label = {"auto": "this drafter (defaults)", "lookup": "context lookup alone"}.get(name, name)
            rows.append(f"| {key} | {label} | {s['speedup_median']:.2f}x ({s['speedup_min']:.2f}-{s['speedup_max']:.2f}) | "
                        f"{s['tokens_per_step']:.2f} | {s['nodes_per_step']:.1f} |")
    if rows:
        source = f" of `{made['held_out_file']}`" if made.get("held_out_file") else ""
        out += ["", f"Speed against plain decoding on {speed.get('prompts', 0)} held-out prompts{source}, {speed.get('max_tokens', 0)} new tokens, "
                "batch 1, alternating in one process (the median over prompts, min-max):", "",
                "| sampling | drafting | speed-up | tokens per step | nodes per step |", "|---|---|---|---|---|", *rows]
    return out


def _training_section(training: dict) -> list:
    """The card's data and training sections, from config.json's ``training``."""
    data, sizes, distilled = training.get("data", []), training.get("data_sizes", []), training.get("distill_settings", [])
    rows = ["| folder | sequences | generated tokens | max tokens | temperature | prompts |", "|---|---|---|---|---|---|"]
    for i, path in enumerate(data):
        size = sizes[i] if i < len(sizes) else {}
        meta = distilled[i] if i < len(distilled) else {}
        cells = [size.get("sequences"), size.get("generated_tokens"), meta.get("max_tokens"), meta.get("temp"), meta.get("num_prompts")]
        rows.append(f"| `{path}` | " + " | ".join("" if c is None else f"{c:,}" if isinstance(c, int) else str(c) for c in cells) + " |")
    fraction = training.get("eval_fraction", 0)
    held = f"the answers to 1 prompt in {max(int(round(1 / fraction)), 2)} (by its index) are held out of training" if fraction > 0 else "no prompts are held out"
    settings = [(f"`{key}`", training[key]) for key in asdict(TrainConfig()) if key in training]
    steps, batch, positions = training.get("steps"), training.get("batch_size"), training.get("positions")
    section = ["## Data", "", f"The base model's own answers (`redrafter-mlx distill`), {training.get('sequences', 0):,} sequences; {held}.",
               "", *rows, "", "## Training", "", _table(settings), ""]
    if steps and batch and positions:
        section.append(f"{steps:,} steps of {batch:,} positions: {steps * batch / positions:.2f} epochs of {positions:,} training positions"
                       + (f"; {training['seconds_this_run']:,} s in the last run." if "seconds_this_run" in training else "."))
    if "eval_accuracy" in training:
        accuracy = " ".join(f"{a:.3f}" for a in training["eval_accuracy"])
        section += ["", f"Held out: loss {training.get('eval_loss')}; top-1 accuracy at depths 1-{len(training['eval_accuracy'])}: {accuracy}."]
    return section
