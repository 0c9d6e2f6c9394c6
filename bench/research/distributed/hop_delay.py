"""`redrafter-mlx bench` on a model split over ranks, with a delay added to
every collective (the hop between stages, the gather of the last hidden
states, any sum), standing for a slower link than this machine's
loopback. Start it with mlx.launch like the command itself:

    mlx.launch --backend ring -n 2 --python "$(which python3)" bench/research/distributed/hop_delay.py \
        --delay-ms 10 -- --prompts data/prompts/heldout.jsonl --num-prompts 6 --max-tokens 96 --configs auto --json OUT

The rank waits for each collective, then sleeps --delay-ms before going
on. This forces the wait inside the pass, which a real link does not;
plain decoding and ReDrafter pay that alike.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

import redrafter_mlx  # noqa: E402, F401  (loads OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx  # noqa: E402

import cli  # noqa: E402
from redrafter_mlx.engine import distributed  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, required=True)
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

    for name in ("recv_like", "all_gather", "all_sum"):
        setattr(distributed.mx.distributed, name, slowed(getattr(mx.distributed, name)))
    cli.main(["bench", *rest])


if __name__ == "__main__":
    main()
