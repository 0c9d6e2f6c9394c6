"""Greedy tokens per step of a drafter, replayed on a greedy distillation
folder without running the base model (``redrafter_mlx/training/replay.py``). Only
sequences held out from training are used (the trainer's rule), unless
``--all``. It also gives the drafter's teacher-forced top-1 accuracy at each
depth over every target (one outside a reduced draft vocabulary counts as a
miss) and, with a reduced draft vocabulary, the tokens per step of a drafter
that is right about every token in its vocabulary: the ceiling that
vocabulary puts on any drafter. With ``--lookup``, each shape is also
replayed with one context-lookup continuation in the same tree, as
``generate`` drafts it (every node verified; ``--lookup-length`` tokens,
generate's default unless given, 4 before session 25): a step accepts the
longer of the two drafts' agreeing prefixes. With ``--datastore N``, each shape is
also replayed with N continuations from the drafter's datastore in the tree
(``redrafter_mlx/drafting/datastore.py``), every node verified.

    python bench/replay_acceptance.py --drafter DRAFTER --data data/distill-smollm2-135m --shapes 1x5,4x5
"""

import argparse
import json

import redrafter_mlx  # noqa: E402, F401  (loads OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
import numpy as np

from redrafter_mlx.drafting.datastore import load_datastore
from redrafter_mlx.drafting.drafter import load_drafter
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.errors import UserError
from redrafter_mlx.training.config import TrainConfig
from redrafter_mlx.training.data import build_positions, cached_positions, draft_index_map, draft_targets
from redrafter_mlx.training.replay import (
    accepted_lengths,
    datastore_lengths,
    in_vocabulary_lengths,
    load_greedy_folder,
    lookup_lengths,
    step_figures,
    tokens_per_step,
    with_continuation,
)
from redrafter_mlx.training.trainer import drafter_loss


def teacher_forced_accuracy(drafter, draft_token_ids, embed, hidden, windows, vocab_size, batch_size=2048):
    """(T,) top-1 accuracy at depths 1..T, T = windows' width - 1, over every
    target x[t+2] .. x[t+T+1] that exists."""
    to_draft = draft_index_map(vocab_size, draft_token_ids)
    correct, targets = 0, (windows[:, 1:] >= 0).sum(0)
    for start in range(0, len(windows), batch_size):
        window = windows[start : start + batch_size]
        h = mx.array(hidden[start : start + batch_size].astype(np.float32))
        _, hits, _ = drafter_loss(
            drafter, embed, h, mx.array(window[:, :-1]), mx.array(draft_targets(to_draft, window[:, 1:]))
        )
        correct = correct + np.array(hits)
    return (correct / np.maximum(targets, 1)).round(4).tolist()


def sequence_rows(counts: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Rows of the positions of the sequences ``keep`` (n,) selects, given
    each sequence's number of positions ``counts`` (n,) in folder order."""
    first_row = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return np.concatenate([np.arange(first_row[i], first_row[i] + counts[i]) for i in np.flatnonzero(keep)])


def sampled_agreement(drafter, embed, head, hidden, next_hidden, windows, temp, batch_size=1024):
    """Depth 1 at temperature ``temp``: the chance that the base model's
    sampled token x[t+2] (drawn from head(h[t+1]) with Gumbel noise) is the
    drafter's token, drafted (a) as its argmax, and (b) as the argmax of its
    log-probabilities over ``temp`` plus the same noise, which a sampler
    whose noise is known before the pass (``redrafter_mlx.sampling``) could
    give the drafter. (b) pays only as far as the drafter's distribution is
    the base model's. Over the positions where x[t+2] exists."""
    valid = windows[:, 1] >= 0
    hidden, next_hidden, first = hidden[valid], next_hidden[valid], windows[valid, 0]
    ids = drafter.token_ids(mx.arange(drafter.draft_vocab_size))
    plain, coupled, key = 0.0, 0.0, mx.random.key(0)
    for start in range(0, len(first), batch_size):
        key, sub = mx.random.split(key)
        h = mx.array(hidden[start : start + batch_size].astype(np.float32))
        state = drafter.update_state(embed(mx.array(first[start : start + batch_size])), None)
        drafted = drafter.log_probs(h, state)  # (n, draft_vocab)
        logits = head(mx.array(next_hidden[start : start + batch_size].astype(np.float32))) / temp
        noise = mx.random.gumbel(logits.shape, key=sub)
        sampled = mx.argmax(logits + noise, axis=-1)
        probs = mx.softmax(logits, axis=-1)
        plain += mx.take_along_axis(probs, ids[mx.argmax(drafted, axis=-1)][:, None], axis=-1).sum().item()
        coupled += (ids[mx.argmax(drafted / temp + noise[:, ids], axis=-1)] == sampled).sum().item()
    return {
        "temp": temp,
        "depth1_argmax": round(plain / len(first), 4),
        "depth1_noise_aimed": round(coupled / len(first), 4),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=None, help="The base model the data was distilled from (default: the embedded one)."
    )
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--data", required=True, help="A greedy distillation data folder.")
    parser.add_argument("--shapes", default="1x5,2x5,4x5,8x5")
    parser.add_argument("--all", action="store_true", help="Replay every sequence, not only held-out ones.")
    parser.add_argument(
        "--lookup", action="store_true", help="Also replay each shape with one context-lookup continuation in the tree."
    )
    parser.add_argument(
        "--lookup-length",
        type=int,
        default=DraftSettings.lookup_length,
        help="Tokens the lookup continuation drafts (default: generate's).",
    )
    parser.add_argument(
        "--datastore",
        type=int,
        default=0,
        help="Also replay each shape with this many continuations from the drafter's datastore in the tree.",
    )
    parser.add_argument(
        "--temp",
        type=float,
        default=0.0,
        help="Also measure depth-1 agreement with the base model's samples at this temperature (``sampled_agreement``).",
    )
    parser.add_argument(
        "--later-rows",
        default="",
        help="Also replay each shape with the drafted tokens after the first taken from this many most frequent draft-vocabulary rows (comma-separated sizes).",
    )
    args = parser.parse_args()
    if args.lookup_length < 1:
        parser.error(f"--lookup-length must be at least 1, got {args.lookup_length}")

    base, sequences, hidden = load_greedy_folder(args.data, args.model)
    drafter = load_drafter(args.drafter)
    shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")]
    longest = max(length for _, length in shapes)
    config = TrainConfig()
    positions = build_positions(sequences, max(longest - 1, config.depth), config.eval_fraction)
    counts = cached_positions(sequences)  # positions, i.e. response tokens, per sequence
    first_row = np.concatenate([[0], np.cumsum(counts)[:-1]])
    # A sequence is held out when its positions are (the trainer's rule).
    keep = (
        np.ones(len(counts), bool)
        if args.all
        else (counts > 0) & positions.held_out[np.minimum(first_row, len(positions.held_out) - 1)]
    )
    rows = sequence_rows(counts, keep)
    result = {"drafter": args.drafter, "sequences": int(keep.sum()), "tokens": int(counts[keep].sum())}
    windows, row_hidden = positions.tokens[rows], hidden[positions.hidden_row[rows]]
    draft_token_ids = getattr(drafter, "draft_token_ids", None)
    result["accuracy"] = teacher_forced_accuracy(
        drafter, draft_token_ids, base.embed, row_hidden, windows, base.vocab_size
    )
    if args.temp > 0:
        next_hidden = hidden[np.minimum(positions.hidden_row[rows] + 1, len(hidden) - 1)]
        result["sampled"] = sampled_agreement(
            drafter, base.embed, base.head, row_hidden, next_hidden, windows, args.temp
        )
    if draft_token_ids is not None:
        bound = in_vocabulary_lengths(windows[:, :longest], np.array(draft_token_ids), base.vocab_size)
        result[f"draft_vocab_ceiling_x{longest}"] = round(tokens_per_step(bound, counts[keep]), 3)
    lookup, lookup_length = (
        (lookup_lengths(sequences, keep, args.lookup_length), args.lookup_length) if args.lookup else (None, 0)
    )
    if lookup is not None:
        result[f"lookup_{lookup_length}_drafted"] = round(tokens_per_step(lookup, counts[keep]), 3)
    stored = None
    if args.datastore:
        datastore = load_datastore(args.drafter, base.vocab_size, required=True)
        stored = datastore_lengths(datastore, sequences, keep, longest - 1, args.datastore)
        if lookup is not None:
            result[f"lookup_{lookup_length}+datastore_{longest - 1}_drafted"] = round(
                tokens_per_step(with_continuation(stored, lookup, lookup_length), counts[keep]), 3
            )
    for width, length in shapes:
        accepted = accepted_lengths(drafter, base.embed, row_hidden, windows[:, :length], width)
        result.update(step_figures(f"{width}x{length}", accepted, counts[keep], lookup, lookup_length))
        if stored is not None:
            both = with_continuation(accepted, stored, length - 1)
            result.update(step_figures(f"{width}x{length}+datastore", both, counts[keep], lookup, lookup_length))
        for rows_kept in [int(r) for r in args.later_rows.split(",") if r]:
            shortlisted = accepted_lengths(
                drafter, base.embed, row_hidden, windows[:, :length], width, later_rows=rows_kept
            )
            result.update(
                step_figures(f"{width}x{length}_later{rows_kept}", shortlisted, counts[keep], lookup, lookup_length)
            )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
