"""Datastore lookup: draft what the base model most often wrote after the
context's last few tokens in its own earlier answers (retrieval-based
drafting, as REST does with a corpus).

Context lookup copies from the row's own context; the RNN predicts from the
last hidden state. A datastore adds the model's habits that neither holds:
the phrases it opens, closes and links its answers with, seen thousands of
times in its distilled answers. Its drafts are deterministic, so they join
the same prefix tree without changing what is generated.

The store is the answers' tokens back to back (``datastore.npy`` in a
drafter folder, written by ``redrafter-mlx datastore``). Loading sorts every
position by its preceding tokens, most recent first, packed into one uint64,
so the positions that follow any suffix of the context up to ``max_ngram``
tokens long are one contiguous range, found by binary search.
"""

from pathlib import Path
from typing import Optional

import numpy as np

from .. import files
from ..errors import UserError

FILE = "datastore.npy"
MAX_NGRAM = 4  # longest context suffix matched (fewer when the vocabulary needs more than 16 bits a token)
BOUNDARY16 = 65535  # a boundary in a uint16 file
MAX_MATCHES = 1024  # occurrences a proposal counts at most (evenly spaced over the range)


class Datastore:
    """Continuations of earlier answers, indexed by the tokens before them.

    tokens: (N,) the answers back to back, each followed by at least one
    -1 (a boundary: nothing is matched or continued across it).
    vocab_size: the base model's vocabulary size.
    """

    def __init__(self, tokens: np.ndarray, vocab_size: int):
        self.tokens = np.asarray(tokens, np.int64)
        self.vocab_size = vocab_size
        if self.tokens.ndim != 1 or (self.tokens.size and (self.tokens.min() < -1 or self.tokens.max() >= vocab_size)):
            raise UserError(f"the datastore's tokens are not ids of a {vocab_size}-token vocabulary")
        self.bits = vocab_size.bit_length()  # codes 0 .. vocab_size, vocab_size standing for a boundary
        self.max_ngram = max(1, min(MAX_NGRAM, 64 // self.bits))
        codes = np.where(self.tokens < 0, vocab_size, self.tokens).astype(np.uint64)
        keys = np.zeros(len(codes), np.uint64)
        for back in range(self.max_ngram):  # the token at the position first, then the ones before it
            before = np.concatenate([np.full(back, vocab_size, np.uint64), codes[: len(codes) - back]])
            keys |= before << np.uint64(self.bits * (self.max_ngram - 1 - back))
        following = np.concatenate([self.tokens[1:], [-1]])
        usable = (self.tokens >= 0) & (following >= 0)  # a token with one after it
        positions = np.flatnonzero(usable)
        order = np.argsort(keys[positions], kind="stable")
        self.keys, self.positions = keys[positions][order], positions[order]

    @classmethod
    def from_sequences(cls, sequences: list, vocab_size: int) -> "Datastore":
        """From token sequences (lists or arrays of ids)."""
        parts = [np.append(np.asarray(s, np.int64), -1) for s in sequences if len(s)]
        return cls(np.concatenate(parts) if parts else np.zeros(0, np.int64), vocab_size)

    @classmethod
    def from_answers(cls, sequences, keep: np.ndarray, vocab_size: int) -> "Datastore":
        """From the responses of distilled ``Sequences`` (prompts left out)
        whose ``keep`` (n,) is True."""
        starts = np.concatenate([[0], np.cumsum(sequences.lengths)[:-1]]).astype(np.int64)
        return cls.from_sequences(
            [
                sequences.tokens[a + p : a + n]
                for a, p, n, k in zip(starts, sequences.prompt_lengths, sequences.lengths, keep)
                if k
            ],
            vocab_size,
        )

    def save(self, folder) -> Path:
        """Write ``datastore.npy`` into ``folder`` and return its path: uint16
        with 65535 for a boundary when the vocabulary fits, else int32 with
        -1. Written beside and renamed (``files.replacing``): a failed or
        killed write leaves the old file as it was."""
        path = Path(folder) / FILE
        tokens = (
            np.where(self.tokens < 0, BOUNDARY16, self.tokens).astype(np.uint16)
            if self.vocab_size < BOUNDARY16
            else self.tokens.astype(np.int32)
        )
        with files.replacing(path, tokens.nbytes + 128, "nothing was changed") as temporary:
            with open(temporary, "wb") as f:
                np.save(f, tokens)
        return path

    def matches(self, context: list) -> tuple[np.ndarray, int]:
        """Positions just before the continuations of the longest suffix of
        ``context`` (up to ``max_ngram`` tokens) that occurs, and its length."""
        for n in range(min(self.max_ngram, len(context)), 0, -1):
            prefix = 0
            for token in reversed(context[-n:]):
                if not 0 <= token < self.vocab_size:
                    break
                prefix = (prefix << self.bits) | int(token)
            else:
                shift = self.bits * (self.max_ngram - n)
                lo, hi = np.searchsorted(self.keys, np.array([prefix << shift, (prefix + 1) << shift], np.uint64))
                if hi > lo:
                    found = self.positions[lo:hi]
                    if len(found) > MAX_MATCHES:
                        found = found[np.linspace(0, len(found) - 1, MAX_MATCHES).astype(np.int64)]
                    return found, n
        return np.zeros(0, np.int64), 0

    def propose(self, context: list, length: int, beams: int = 1) -> list[tuple[list, list, int]]:
        """Up to ``beams`` continuations of ``context``, each of at most
        ``length`` tokens: the ``beams`` most frequent next tokens after its
        longest occurring suffix, each followed by the most frequent token
        after it, and so on. Returns (tokens, shares, n) per continuation,
        most frequent first: shares[i] is the share of the occurrences
        continuing tokens[:i] that go on with tokens[i], counting one unseen
        occurrence more (a single occurrence predicts 1/2, not 1); n the
        matched suffix's length."""
        found, n = self.matches(context)
        if not len(found):
            return []
        spans = self.tokens[np.minimum(found[:, None] + 1 + np.arange(length), len(self.tokens) - 1)]
        spans = np.where(np.cumprod(spans >= 0, axis=1) > 0, spans, -1)  # nothing past a boundary
        firsts, counts = np.unique(spans[:, 0], return_counts=True)
        proposals = []
        for i in np.argsort(-counts, kind="stable")[:beams]:
            rows = spans[spans[:, 0] == firsts[i]]
            tokens, shares = [int(firsts[i])], [counts[i] / (len(spans) + 1)]
            for depth in range(1, length):
                column = rows[:, depth]
                column = column[column >= 0]
                if not len(column):
                    break
                values, value_counts = np.unique(column, return_counts=True)
                best = int(np.argmax(value_counts))
                tokens.append(int(values[best]))
                shares.append(value_counts[best] / (len(rows) + 1))
                rows = rows[rows[:, depth] == values[best]]
            proposals.append((tokens, [float(f) for f in shares], n))
        return proposals


def load_datastore(folder, vocab_size: int, required: bool = False) -> Optional[Datastore]:
    """The datastore in a drafter folder, or None when it has none (an
    error when ``required``)."""
    path = Path(folder) / FILE
    if not path.exists():
        if required:
            raise UserError(f"drafter {folder} has no datastore (redrafter-mlx datastore adds one)")
        return None
    try:
        tokens = np.load(path, allow_pickle=False)
        if tokens.dtype == np.uint16:
            tokens = np.where(tokens == BOUNDARY16, -1, tokens.astype(np.int64))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the datastore {path} ({e}); rebuild it with redrafter-mlx datastore") from None
    try:
        return Datastore(tokens, vocab_size)
    except UserError as e:
        raise UserError(f"{path}: {e}; was it built for another model?") from None
