"""Milliseconds of one beam search of the shipped drafter (batch 1, 4
beams, partial beams kept), per search length and (first, later) draft
vocabulary rows: the median of ``--repeats`` calls, each evaluated alone.

    python3 bench/research/drafting/search_time.py --rows 2048:2048,2048:1024
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import redrafter_mlx  # noqa: E402, F401  (OpenBLAS before mlx.core)
import mlx.core as mx  # noqa: E402

from redrafter_mlx.drafting.beam_search import beam_search  # noqa: E402
from redrafter_mlx.loading.loader import load  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="2048:2048,2048:1024", help="first:later row counts, comma-separated")
    parser.add_argument("--lengths", default="3,4,5", help="search lengths, the root included")
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    redrafter, _ = load()
    drafter, embed = redrafter.drafter, redrafter.base.embed
    hidden = mx.random.normal((1, drafter.args.hidden_size), key=mx.random.key(0))
    first_token = mx.array([42])

    def search(length, first, later):
        return beam_search(drafter, embed, hidden, first_token, 4, length, later, True, first)

    for length in (int(n) for n in args.lengths.split(",")):
        for pair in args.rows.split(","):
            first, later = (int(r) for r in pair.split(":"))
            for _ in range(5):
                mx.eval(search(length, first, later))
            seconds = []
            for _ in range(args.repeats):
                tic = time.perf_counter()
                mx.eval(search(length, first, later))
                seconds.append(time.perf_counter() - tic)
            print(f"length {length}, first {first} rows, later {later}: {1000 * statistics.median(seconds):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
