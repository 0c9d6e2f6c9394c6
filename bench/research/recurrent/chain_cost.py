"""What verifying chains costs a hybrid model (layers with recurrent state),
against a dense model of the same size.

    python3 bench/research/recurrent/chain_cost.py --json bench/research/recurrent/chain-cost.json

For random models built from mlx-lm's own ModelArgs (the test suite's tiny
ones: a 2-layer llama, 3-4-layer hybrids, at hidden size 64 and at 512),
in float32 on this machine:
- the cost curve (a chain pass of N tokens), and for the hybrid the same
  pass followed by setting its recurrent state to half the chain (the
  commit ``engine.recurrent`` does when a draft is partly accepted);
- tokens per step with a drafter that is right to a varying depth (the test
  suite's oracle, corrupted at depth 1-4), for the dense model verifying
  trees and chains, and for the hybrid verifying chains.
"""

import argparse
import json
import os
import statistics
import sys
import time

import redrafter_mlx  # noqa: E402, F401  (loads OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from conftest import OracleDrafter, mlx_lm_greedy, run, tiny_model  # noqa: E402
from redrafter_mlx.drafting import speculator  # noqa: E402
from redrafter_mlx.engine.base_model import BaseModel  # noqa: E402
from redrafter_mlx.engine.prefill import prefill  # noqa: E402
from redrafter_mlx.engine.types import ReDrafter  # noqa: E402

SIZES = (1, 2, 4, 8, 16)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 18], [9, 8, 7, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def scaled(kind: str, hidden: int):
    """tiny_model's architecture at another size."""
    import conftest

    saved = conftest.HIDDEN
    conftest.HIDDEN = hidden
    try:
        model = tiny_model(kind, seed=1)
    finally:
        conftest.HIDDEN = saved
    return model


def timed(run, repeats=7):
    run()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        run()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def pass_and_commit(base: BaseModel, n: int) -> tuple[float, float]:
    """Seconds of a chain pass of n tokens after 128 committed ones, and of
    the pass plus the commit of half the chain."""
    prompt = [(17 * i + 3) % base.vocab_size for i in range(128)]
    layout, cache, _, _ = prefill(base, [prompt])
    tokens = mx.array([prompt[:n]], mx.int32)
    depths = mx.arange(n, dtype=mx.int32)[None]
    mask = mx.tril(mx.ones((n, n), mx.bool_))[None]
    path, accepted = np.arange(n)[None], np.array([(n - 1) // 2])

    def chain(commit):
        def go():
            layout.begin_tree(depths, mask)
            out = base(tokens, cache)
            if commit:
                for c in cache:
                    c.commit_path(path, accepted)
            mx.eval(out, [c.state_arrays() for c in cache])

        return go

    return timed(chain(False)), timed(chain(True))


def tokens_per_step(base: BaseModel, nodes: int, chains: bool) -> float:
    references = [mlx_lm_greedy(base.model, p, 64) for p in PROMPTS]
    drafter = OracleDrafter(base, [p + r for p, r in zip(PROMPTS, references)], corrupt=4)
    original = speculator.Speculator.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **dict(kwargs, chains=chains))

    speculator.Speculator.__init__ = init
    try:
        steps = tokens = 0
        for p, r in zip(PROMPTS, references):
            (out,), accepted = run(
                ReDrafter(base, drafter), [p], max_tokens=64, max_nodes=nodes, beam_width=4, beam_length=5
            )
            assert out == r, "greedy output changed"
            steps += len(accepted)
            tokens += sum(a + 1 for a in accepted)
    finally:
        speculator.Speculator.__init__ = original
    return tokens / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for label, dense_model, hybrid_models in (
        (
            "hidden 64",
            lambda: tiny_model("llama", seed=1),
            [(k, lambda k=k: tiny_model(k, seed=1)) for k in ("qwen3_next", "nemotron_h", "lfm2")],
        ),
        (
            "hidden 512",
            lambda: scaled("llama", 512),
            [(k, lambda k=k: scaled(k, 512)) for k in ("qwen3_next", "nemotron_h")],
        ),
    ):
        for kind, make in [("llama", dense_model)] + hybrid_models:
            base = BaseModel(make())
            curve = {}
            for n in SIZES:
                alone, committed = pass_and_commit(base, n)
                curve[n] = {"pass_ms": 1000 * alone, "pass_and_commit_ms": 1000 * committed}
            row = {"size": label, "model": kind, "recurrent": base.recurrent, "curve": curve}
            if label == "hidden 64":
                row["tokens_per_step"] = {
                    f"{shape} {n}": tokens_per_step(base, n, shape == "chain")
                    for n in (4, 8, 16)
                    for shape in (("tree", "chain") if not base.recurrent else ("chain",))
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
