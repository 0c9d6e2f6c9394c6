"""`redrafter-mlx bench` on a model split over ranks, with a delay added to
every hop of the pipeline, standing for a slower link than this machine's
loopback. Start it with mlx.launch like the command itself:

    mlx.launch --backend ring -n 2 --python "$(which python3)" bench/research/distributed/hop_delay.py \
        --delay-ms 10 --every-collective -- --prompts data/prompts/heldout.jsonl --num-prompts 6 --max-tokens 96 --configs auto --json OUT

The delay: the rank that receives a stage's hidden states waits for them,
then sleeps --delay-ms before going on, so every pass (plain or
verification) pays it once per hop; with --every-collective every gather
and sum pays it too (a pass's final gather, and any all-sum a step would
send). This forces the wait inside the pass, which a real link does not;
both methods pay that alike.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

import redrafter_mlx  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402

import cli  # noqa: E402
from redrafter_mlx.engine import distributed  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--every-collective", action="store_true",
                        help="delay every collective (gathers and sums too), not only the hops between stages")
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    delay = args.delay_ms / 1000

    def slowed(collective):
        def call(*a, **k):
            y = collective(*a, **k)
            mx.eval(y)
            time.sleep(delay)
            return y
        return call

    # The stages' receive (here and in mlx-lm's pipeline), the gather of the
    # last hidden states, and the all-sums (each step's shared seconds).
    for name in ("recv_like", "all_gather", "all_sum") if args.every_collective else ("recv_like",):
        setattr(distributed.mx.distributed, name, slowed(getattr(mx.distributed, name)))
    cli.main(["bench", *rest])


if __name__ == "__main__":
    main()
