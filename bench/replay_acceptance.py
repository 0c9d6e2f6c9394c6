"""Greedy tokens per step replayed on distilled data, without running the
base model: a greedy distillation folder already holds the base model's
greedy continuation of every prompt and the hidden state behind each token,
which is all greedy ReDrafter's verification would compute. For every
position the drafter's beams are searched from the cached hidden state; the
step accepts the longest beam prefix that matches the sequence; the replay
walks the sequence step by step as generation would.

It differs from a real run only where the cached float16 hidden states tie
the base model's choice differently, so it ranks drafters and beam shapes in
minutes. Only sequences held out from training are used (the trainer's
rule), unless ``--all``.

    python bench/replay_acceptance.py --drafter DRAFTER --data data/distill-smollm2-135m --shapes 1x5,4x5
"""

import argparse
import json

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx
import numpy as np

from redrafter_mlx.base_model import BaseModel
from redrafter_mlx.beam_search import beam_search
from redrafter_mlx.distill import DataFolder
from redrafter_mlx.drafter import load_drafter
from redrafter_mlx.errors import UserError
from redrafter_mlx.loading import load_base_model
from redrafter_mlx.train import TrainConfig, build_positions, cached_positions, compute_hidden_cache


def accepted_lengths(drafter, base, hidden, tokens, width, length, batch_size=2048):
    """Accepted drafts at each position.

    hidden: (R, hidden_size) h[t]; tokens: (R, length) x[t+1] .. x[t+length],
    -1 past the end. Returns (R,) the longest match of a beam's drafts with
    x[t+2] ..
    """
    out = []
    for start in range(0, len(tokens), batch_size):
        h = mx.array(hidden[start : start + batch_size].astype(np.float32))
        window = mx.array(tokens[start : start + batch_size])
        beams, _ = beam_search(drafter, base.embed, h, window[:, 0], width, length)
        matches = beams[:, :, 1:] == window[:, None, 1:]  # (R, W, length - 1)
        prefix = mx.cumprod(matches.astype(mx.int32), axis=-1).sum(-1)
        out.append(np.array(prefix.max(-1)))
    return np.concatenate(out)


def replay(accepted, starts, counts):
    """Steps to generate each sequence, as generation counts them: the
    prefill chooses the first response token; from then on a step with a
    accepted drafts adds a + 1 tokens, until all are there."""
    steps = 0
    for start, n in zip(starts, counts):
        t = 0  # response tokens after the first
        while t < n - 1:
            t += int(accepted[start + t]) + 1
            steps += 1
    return steps


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="The base model the data was distilled from (default: the embedded one).")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--data", required=True, help="A greedy distillation data folder.")
    parser.add_argument("--shapes", default="1x5,2x5,4x5,8x5")
    parser.add_argument("--all", action="store_true", help="Replay every sequence, not only held-out ones.")
    args = parser.parse_args()

    folder = DataFolder(args.data)
    if (folder.meta or {}).get("temp", 0) != 0:
        raise SystemExit(f"error: {args.data} holds sampled responses; the replay needs greedy ones")
    base = BaseModel(load_base_model(args.model)[0])
    folder.check_model(base.vocab_size, base.hidden_size)
    drafter = load_drafter(args.drafter)
    sequences = folder.load()
    hidden = compute_hidden_cache(base, folder, sequences, progress=False)
    shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")]
    positions = build_positions(sequences, max(length for _, length in shapes) - 1, TrainConfig().eval_fraction)
    counts = cached_positions(sequences)  # positions, i.e. response tokens, per sequence
    first_row = np.concatenate([[0], np.cumsum(counts)[:-1]])
    # A sequence is held out when its positions are (the trainer's rule).
    keep = np.ones(len(counts), bool) if args.all else (counts > 0) & positions.held_out[np.minimum(first_row, len(positions.held_out) - 1)]
    rows = np.concatenate([np.arange(first_row[i], first_row[i] + counts[i]) for i in np.flatnonzero(keep)])
    starts = np.concatenate([[0], np.cumsum(counts[keep])[:-1]])
    step_tokens = int(np.maximum(counts[keep] - 1, 0).sum())  # all but each prefill's token
    result = {"drafter": args.drafter, "sequences": int(keep.sum()), "tokens": int(counts[keep].sum())}
    for width, length in shapes:
        accepted = accepted_lengths(drafter, base, hidden[positions.hidden_row[rows]], positions.tokens[rows, :length], width, length)
        steps = replay(accepted, starts, counts[keep])
        result[f"{width}x{length}"] = round(step_tokens / steps, 3)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
