"""How often a datastore's first drafted token is right, against the share
of the matched occurrences that continue with it, on answers the datastore
left out (the trainer's held-out prompts of each data folder): the
measurement behind the datastore's predictions (``Datastore.propose``) and
its prior in ``budget.AcceptanceStats``. Prints one JSON line per grouping.

    python bench/research/datastore/shares.py --drafter redrafter_mlx/drafters/smollm2-135m-instruct --data data/distill-smollm2-135m
"""

import argparse
import json

import numpy as np

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)
from redrafter_mlx.drafting.datastore import load_datastore
from redrafter_mlx.errors import UserError
from redrafter_mlx.training.config import TrainConfig
from redrafter_mlx.training.data import held_out_sequences
from redrafter_mlx.training.distill import DataFolder, Sequences

OCCURRENCES = [(1, 2), (2, 4), (4, 16), (16, 128), (128, None)]


def first_drafts(datastore, sequences: Sequences, keep: np.ndarray) -> np.ndarray:
    """(P, 4) per position of the kept sequences with a proposal: matched
    occurrences, matched suffix length, predicted share of the first
    drafted token, and whether it is right."""
    starts = np.concatenate([[0], np.cumsum(sequences.lengths)[:-1]])
    rows = []
    for i in np.flatnonzero(keep):
        sequence = sequences.tokens[starts[i] : starts[i] + sequences.lengths[i]].tolist()
        for t in range(int(sequences.prompt_lengths[i]) - 1, len(sequence) - 2):
            proposals = datastore.propose(sequence[: t + 2], 1)
            if proposals:
                (token,), (share,), n = proposals[0]
                rows.append((len(datastore.matches(sequence[: t + 2])[0]), n, share, token == sequence[t + 2]))
    return np.array(rows, float).reshape(-1, 4)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="A drafter folder with a datastore.")
    parser.add_argument(
        "--data", action="append", required=True, help="Data folders whose held-out answers are measured."
    )
    args = parser.parse_args()
    sequences = Sequences.concatenate([DataFolder(path).load() for path in args.data])
    vocab_size = DataFolder(args.data[0]).meta["vocab_size"]
    datastore = load_datastore(args.drafter, vocab_size, required=True)
    drafts = first_drafts(datastore, sequences, held_out_sequences(sequences.prompt_index, TrainConfig().eval_fraction))
    found, n, share, right = drafts.T
    print(json.dumps({"positions": len(drafts), "predicted": round(share.mean(), 3), "right": round(right.mean(), 3)}))
    for lo, hi in OCCURRENCES:
        group = (found >= lo) & (found < (hi or np.inf))
        print(
            json.dumps(
                {
                    "occurrences": [lo, hi],
                    "share_of_positions": round(group.mean(), 3),
                    "predicted": round(share[group].mean(), 3),
                    "right": round(right[group].mean(), 3),
                }
            )
        )
    for length in range(1, datastore.max_ngram + 1):
        group = n == length
        print(
            json.dumps(
                {
                    "suffix_length": length,
                    "share_of_positions": round(group.mean(), 3),
                    "predicted": round(share[group].mean(), 3),
                    "right": round(right[group].mean(), 3),
                }
            )
        )


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
