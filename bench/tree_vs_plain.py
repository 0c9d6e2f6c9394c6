"""The tree verification pass against a plain causal forward of as many
tokens, and the RNN beam search's cost, for the default (or given) model:
alternating the two passes, several rounds, medians.

    python3 bench/tree_vs_plain.py [--model M] [--batch-size B] [--rounds R]
"""

import argparse
import json
import statistics

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)
from redrafter_mlx.drafting.cost import SIZES
from redrafter_mlx.engine.calibrate import measure
from redrafter_mlx.loading.loader import load
from redrafter_mlx.serving.bench import environment


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    redrafter, _ = load(args.model)
    tree, plain = [], []
    for _ in range(args.rounds):
        tree.append(measure(redrafter, args.batch_size, (4, 5)))
        plain.append(measure(redrafter, args.batch_size, tree=False))
    rows = []
    print(f"batch {args.batch_size}: nodes, tree pass ms, plain pass ms, tree / plain")
    for i, n in enumerate(SIZES):
        t = statistics.median(c.seconds[i] for c in tree)
        p = statistics.median(c.seconds[i] for c in plain)
        rows.append({"nodes": n, "tree_seconds": t, "plain_seconds": p})
        print(f"{n:4d} {1000 * t:9.2f} {1000 * p:9.2f} {t / p:6.3f}")
    draft = statistics.median(c.draft_seconds for c in tree)
    print(f"RNN 4x5 beam search: {1000 * draft:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "environment": environment(redrafter),
                    "batch_size": args.batch_size,
                    "rows": rows,
                    "draft_seconds": draft,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
