"""Tokens per step and teacher-forced accuracy (depths 1-2) of drafters per
prompt source of dev (the ``source`` field of dev.jsonl), replayed on the
greedy dev responses: the RNN alone at 4x5, with one context-lookup
continuation in the tree, and lookup alone (4 drafted tokens).

    python3 bench/replay_by_source.py DRAFTER [DRAFTER ...]
"""

import json
import sys
from pathlib import Path

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)

import numpy as np

from redrafter_mlx.drafter import load_drafter
from redrafter_mlx.replay import accepted_lengths, load_greedy_folder, step_figures, tokens_per_step, with_continuation
from redrafter_mlx.train import build_positions, cached_positions

sys.path.insert(0, str(Path(__file__).parent))
from replay_acceptance import sequence_rows, teacher_forced_accuracy  # noqa: E402

DEV_PROMPTS = "../shared/data/prompts/dev.jsonl"
DEV_RESPONSES = "data/eval-dev-smollm2-135m"
WIDTH, LENGTH = 4, 5


def main():
    base, sequences, hidden = load_greedy_folder(DEV_RESPONSES)
    positions = build_positions(sequences, LENGTH, eval_fraction=0.02, lookup_length=LENGTH - 1)
    counts = cached_positions(sequences)
    with open(DEV_PROMPTS) as f:
        sources = np.array([json.loads(line)["source"] for line in f])[sequences.prompt_index]
    for path in sys.argv[1:]:
        drafter = load_drafter(path)
        for source in sorted(set(sources)):
            keep = sources == source
            rows = sequence_rows(counts, keep)
            windows, row_hidden = positions.tokens[rows], hidden[positions.hidden_row[rows]]
            lookup, n = positions.lookup_depth[rows], counts[keep]
            accuracy = teacher_forced_accuracy(drafter, getattr(drafter, "draft_token_ids", None), base.embed, row_hidden, windows[:, :3], base.vocab_size)
            accepted = accepted_lengths(drafter, base.embed, row_hidden, windows, WIDTH)
            print(json.dumps({
                "drafter": path, "source": source, "sequences": int(keep.sum()), "accuracy": accuracy,
                **step_figures(f"{WIDTH}x{LENGTH}", accepted, n, lookup, LENGTH - 1),
                "lookup": round(tokens_per_step(with_continuation(np.zeros_like(accepted), lookup, LENGTH - 1), n), 3),
            }), flush=True)


if __name__ == "__main__":
    main()
