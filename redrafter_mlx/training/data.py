"""Training data: the positions a drafter is trained on, the base model's
hidden state at each, and the targets of a batch.

A position t of a distilled sequence (``distill.Sequences``) is one whose
next token x[t+1] is generated (not prompt): t = P-1 .. L-2 for a sequence
of L tokens with a P-token prompt. ``build_positions`` lists them all, in
order, with the tokens x[t+1] .. x[t+T+1] each is trained on, and which
are held out (the answers to every round(1 / eval_fraction)-th prompt).

Hidden states come from the data folder: ``distill`` saves them beside each
shard, and shards without them are run through the base model once, a batch
of sequences at a time (``compute_hidden_cache``). Training reads them from
a float16 memory-mapped file, so they are never all in memory; the files of
several data folders are read as one (``StackedRows``).

A reduced draft vocabulary is the most frequent generated tokens
(``build_draft_vocab``); a batch's targets are token ids mapped into it
(``draft_index_map``, ``draft_targets``).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from .. import files
from ..errors import UserError
from .distill import DataFolder, Sequences, hidden_path

HIDDEN_FILE = "hidden.f16.npy"
HIDDEN_INDEX = "hidden-index.json"  # which shards the cache was built from


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


def compute_hidden_cache(
    base, folder: DataFolder, sequences: Sequences, batch_tokens: int = 8192, progress: bool = True
) -> np.ndarray:
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
                np.lib.format.write_array_header_1_0(
                    f, {"descr": np.dtype(np.float16).str, "fortran_order": False, "shape": shape}
                )
                for shard in shards:
                    f.write(np.ascontiguousarray(np.load(hidden_path(shard)), np.float16).tobytes())
        files.write_text(identity_path, json.dumps(identity), keeps)
    return np.lib.format.open_memmap(path, mode="r")


def _shard_hidden(base, shard: Path, batch_tokens: int) -> None:
    """Write ``hidden-NNNNN.npy`` for a shard that lacks it."""
    with np.load(shard) as data:
        prompt_lengths, lengths, tokens = data["prompt_lengths"], data["lengths"], data["tokens"]
    target = hidden_path(shard)
    if target.exists() and np.load(target, mmap_mode="r").shape == (
        int((lengths - prompt_lengths).sum()),
        base.hidden_size,
    ):
        return
    states = response_hidden(base, prompt_lengths, lengths, tokens, batch_tokens)
    with files.replacing(
        target, states.nbytes, "the hidden states of earlier shards are kept: free space and run again"
    ) as temporary:
        with open(temporary, "wb") as f:
            np.save(f, states)


def response_hidden(
    base, prompt_lengths: np.ndarray, lengths: np.ndarray, tokens: np.ndarray, batch_tokens: int = 8192
) -> np.ndarray:
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
        [sequences.tokens[s + p : s + n] for s, p, n in zip(starts, sequences.prompt_lengths, sequences.lengths)]
    )
    counts = np.bincount(generated)
    order = np.argsort(-counts, kind="stable")[:size]
    return order.astype(np.int32)


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
