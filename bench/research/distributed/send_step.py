"""What sending a step from rank 0 costs: the alternative to every rank
drafting its own tree is rank 0 drafting and sending it (and its choices)
each step; ranks that may round differently do a part of that
(``Ranks.settle``: a check each step, the step sent where they differ).

    OPENBLAS_NUM_THREADS=1 mlx.launch --backend ring -n 2 --python "$(which python3)" \\
        bench/research/distributed/send_step.py --steps 300

Times per step, in alternated blocks of steps, on every rank: the one
all-sum that compares the ranks' digests (what each step of ranks that may
round differently pays; alike ranks send nothing), and the same followed
by rank 0's step sent to the others (what a step would pay if only rank 0
drafted, and what a rank that rounds differently pays when it disagrees;
``Ranks.broadcast``). A step's results here are batch 1 at the default
search (4 beams of 5 tokens, 6 nodes kept).
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import redrafter_mlx  # noqa: E402,F401  (OpenBLAS before mlx)
from redrafter_mlx.engine import distributed  # noqa: E402

BLOCK = 20  # steps of one kind timed together, kinds alternated


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", help="where rank 0 writes the medians")
    args = parser.parse_args()
    ranks = distributed.join("pipeline")
    rng = np.random.default_rng(0)
    step = (
        np.array([3]),
        rng.integers(0, 6, (1, 6)),
        rng.integers(0, 49152, (1, 6)),
        [rng.integers(0, 49152, (1, 4, 5)), rng.random((1, 4, 5), np.float32)],
    )
    times = {"checked": [], "checked_and_sent": []}
    for i in range(2 * args.steps // BLOCK):
        kind = i % 2
        tic = time.perf_counter()
        for _ in range(BLOCK):
            ranks.settle(step)
            if kind == 1:
                ranks.broadcast(step if ranks.rank == 0 else None)
        times[list(times)[kind]].append((time.perf_counter() - tic) / BLOCK)
    result = {
        "ranks": ranks.size,
        "steps": args.steps,
        **{f"{k}_ms": 1000 * float(np.median(v)) for k, v in times.items()},
    }
    if ranks.rank == 0:
        print(json.dumps(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    ranks.end()


if __name__ == "__main__":
    main()
