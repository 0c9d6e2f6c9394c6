"""Greedy ReDrafter generation replayed on distilled data, without the base
model.

A greedy distillation folder holds the base model's greedy continuation of
every prompt and the hidden state behind each token: all that greedy
verification would compute. At every position the drafter's beams are
searched from the cached hidden state and the longest beam prefix that
matches the sequence is accepted; walking each sequence step by step as
generation does gives the number of steps, hence tokens per step. It differs
from a real run only where a float16 cached hidden state breaks a tie
differently, so it measures a drafter on a whole evaluation set in minutes.
"""

from typing import Optional

import mlx.core as mx
import numpy as np

from ..drafting.beam_search import beam_search
from ..drafting.lookup import LookupIndex
from ..engine.base_model import BaseModel
from ..errors import UserError
from ..loading.loader import load_base_model
from .data import cached_positions, compute_hidden_cache
from .distill import DataFolder, Sequences


def load_greedy_folder(data: str, model: Optional[str] = None) -> tuple[BaseModel, Sequences, np.ndarray]:
    """A greedy distillation folder and the base model it was distilled
    from (``model``; None: the embedded one): (base, sequences, hidden),
    hidden (R, hidden_size) float16 h[t] at every position, computed and
    cached beside the shards when missing."""
    folder = DataFolder(data)
    if (folder.meta or {}).get("temp", 0) != 0:
        raise UserError(f"{data} holds sampled responses; the replay needs greedy ones")
    base = BaseModel(load_base_model(model)[0])
    folder.check_model(base.vocab_size, base.hidden_size)
    sequences = folder.load()
    return base, sequences, compute_hidden_cache(base, folder, sequences, progress=False)


def accepted_lengths(
    drafter,
    embed,
    hidden: np.ndarray,
    windows: np.ndarray,
    width: int,
    batch_size: int = 2048,
    later_rows: Optional[int] = None,
) -> np.ndarray:
    """Drafts accepted at each position.

    hidden: (R, hidden_size) h[t]; windows: (R, length) x[t+1] .. x[t+length],
    -1 past the end of the sequence. x[t+1] is the token the base model has
    just chosen; beams of ``width`` x ``length`` start from it (``later_rows``
    as ``beam_search`` takes it). Returns (R,)
    the longest match of a beam's drafts with x[t+2] ...
    """
    length = windows.shape[1]
    out = []
    for start in range(0, len(windows), batch_size):
        h = mx.array(hidden[start : start + batch_size].astype(np.float32))
        window = mx.array(windows[start : start + batch_size])
        beams, _ = beam_search(drafter, embed, h, window[:, 0], width, length, later_rows)  # (R, width, length)
        matches = beams[:, :, 1:] == window[:, None, 1:]
        prefix = mx.cumprod(matches.astype(mx.int32), axis=-1).sum(-1)
        out.append(np.array(prefix.max(-1)))
    return np.concatenate(out)


def in_vocabulary_lengths(windows: np.ndarray, draft_token_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """(R,) drafts a drafter would get accepted if it were right about every
    token in its draft vocabulary: the run of x[t+2] ... inside it."""
    in_vocab = np.zeros(vocab_size + 1, bool)  # the extra last entry stands for -1, the end
    in_vocab[draft_token_ids] = True
    return np.cumprod(in_vocab[windows[:, 1:]], axis=-1).sum(-1)


def agreeing_prefix(drafted: list, target: list) -> int:
    """How many of a draft's first tokens equal the target's."""
    agree = 0
    while agree < min(len(drafted), len(target)) and drafted[agree] == target[agree]:
        agree += 1
    return agree


def lookup_depths(sequence: list, first: int, count: int, depth: int, max_ngram: int = 3) -> np.ndarray:
    """For positions t = first .. first + count - 1 of one sequence: how
    many of x[t+2] .. x[t+depth+1] context lookup's continuation drafts
    right from the context x[0] .. x[t+1], as generation drafts it."""
    context, matched = list(sequence[: first + 1]), np.zeros(count, np.int64)
    index = LookupIndex(context, max_ngram)
    for i in range(count):
        t = first + i
        context.append(sequence[t + 1])
        target = sequence[t + 2 : t + 2 + depth]
        matched[i] = max((agreeing_prefix(drafted, target) for drafted, _ in index.propose(depth)), default=0)
    return matched


def lookup_lengths(sequences: Sequences, keep: np.ndarray, depth: int) -> np.ndarray:
    """``lookup_depths`` at each position of the sequences ``keep`` (n,)
    selects, in order (as ``data.build_positions`` orders positions)."""
    counts = cached_positions(sequences)
    starts = np.concatenate([[0], np.cumsum(sequences.lengths)[:-1]])
    parts = [
        lookup_depths(
            sequences.tokens[starts[i] : starts[i] + sequences.lengths[i]].tolist(),
            int(sequences.prompt_lengths[i]) - 1,
            int(counts[i]),
            depth,
        )
        for i in np.flatnonzero(keep)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def with_continuation(accepted: np.ndarray, depth: np.ndarray, drafted: int) -> np.ndarray:
    """Drafts accepted per position when other continuations of ``drafted``
    tokens join the tree, every node verified: context lookup's
    (``lookup_lengths``) or a datastore's (``datastore_lengths``),
    ``depth`` (R,) how many of their tokens are right (at most ``drafted``
    count). The longer agreeing prefix counts."""
    return np.maximum(accepted, np.minimum(depth, drafted))


def datastore_lengths(datastore, sequences: Sequences, keep: np.ndarray, depth: int, beams: int) -> np.ndarray:
    """Drafts accepted at each position of the sequences ``keep`` (n,)
    selects, in order, from a datastore's ``beams`` continuations of
    ``depth`` tokens (``Datastore.propose``) of the context x[0] .. x[t+1]:
    the longest agreeing prefix with x[t+2] ..."""
    starts = np.concatenate([[0], np.cumsum(sequences.lengths)[:-1]])
    out = []
    for i in np.flatnonzero(keep):
        sequence = sequences.tokens[starts[i] : starts[i] + sequences.lengths[i]].tolist()
        for t in range(int(sequences.prompt_lengths[i]) - 1, len(sequence) - 1):
            target = sequence[t + 2 : t + 2 + depth]
            out.append(
                max(
                    (
                        agreeing_prefix(drafted, target)
                        for drafted, _, _ in datastore.propose(sequence[: t + 2], depth, beams)
                    ),
                    default=0,
                )
            )
    return np.array(out, np.int64)


def count_steps(accepted: np.ndarray, counts: np.ndarray) -> int:
    """Steps to generate every sequence, as generation counts them.

    accepted: (R,) per position, the sequences' positions back to back;
    counts: (S,) positions (response tokens) per sequence. The prefill
    chooses the first response token; from then on a step that accepts a
    drafts adds a + 1 tokens, until the sequence is complete.
    """
    steps, start = 0, 0
    for n in counts:
        t = 0  # response tokens after the first
        while t < n - 1:
            t += int(accepted[start + t]) + 1
            steps += 1
        start += n
    return steps


def tokens_per_step(accepted: np.ndarray, counts: np.ndarray) -> Optional[float]:
    """Mean tokens per step (accepted + bonus) over the sequences."""
    steps = count_steps(accepted, counts)
    return float(np.maximum(counts - 1, 0).sum() / steps) if steps else None


def step_figures(
    name: str, accepted: np.ndarray, counts: np.ndarray, lookup_depth: Optional[np.ndarray], lookup_length: int
) -> dict:
    """``{name: tokens per step}``, and with ``lookup_depth`` also
    ``{name + "+lookup": the same with one lookup continuation of
    ``lookup_length`` tokens in the tree}`` (``with_continuation``), rounded
    to three places as the result files keep them."""
    figures = {name: round(tokens_per_step(accepted, counts), 3)}
    if lookup_depth is not None:
        figures[f"{name}+lookup"] = round(
            tokens_per_step(with_continuation(accepted, lookup_depth, lookup_length), counts), 3
        )
    return figures
