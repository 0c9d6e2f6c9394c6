"""What a pass costs behind a longer context: mlx-lm's own model and cache
(causal chunk) and this package's tree pass (chain tree, per-token
positions), 1 and several new tokens behind 128 and 512 committed tokens,
timed in turn in one process.

    python3 bench/research/drafting/context_cost.py --json out.json
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import redrafter_mlx  # noqa: E402, F401  (OpenBLAS before mlx.core)
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from redrafter_mlx.engine.prefill import prefill  # noqa: E402
from redrafter_mlx.loading.loader import load  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 5, 9])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    redrafter, _ = load()
    base = redrafter.base

    def ours(context, n):
        prompt = [(17 * i + 3) % base.vocab_size for i in range(context)]
        layout, cache, hidden, logits = prefill(base, [prompt])
        mx.eval(hidden, logits)
        tokens = mx.array([prompt[:n]], mx.int32)
        depths = mx.arange(n, dtype=mx.int32)[None]
        mask = mx.tril(mx.ones((n, n), mx.bool_))[None]

        def run():
            layout.begin_tree(depths, mask)
            mx.eval(base(tokens, cache), [c.state_arrays() for c in cache])

        return run

    def mlx_lm(context, n):
        prompt = [(17 * i + 3) % base.vocab_size for i in range(context)]
        cache = make_prompt_cache(base.model)
        mx.eval(base.model(mx.array([prompt]), cache=cache))
        block = mx.array([prompt[:n]])

        def run():
            mx.eval(base.model(block, cache=cache))
            for c in cache:
                c.trim(n)

        return run

    runs = {(kind, c, n): make(c, n) for kind, make in (("mlx-lm", mlx_lm), ("tree pass", ours)) for c in args.contexts for n in args.tokens}
    for run in runs.values():
        run()
    seconds = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, run in runs.items():
            tic = time.perf_counter()
            run()
            seconds[key].append(time.perf_counter() - tic)
    rows = [{"pass": kind, "context": c, "tokens": n, "ms": 1000 * statistics.median(seconds[(kind, c, n)])} for kind, c, n in runs]
    for row in rows:
        print(f"{row['pass']:>9}: {row['tokens']} tokens behind {row['context']}: {row['ms']:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
