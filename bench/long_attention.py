"""Where a verified node's cost goes at a long context: one attention layer
of the model's shape, for blocks of 1 to 16 queries (a plain token, then
trees), behind contexts of a few hundred to several thousand keys, and the
exponential of its scores alone.

    python3 bench/long_attention.py --json bench/results/long/attention-smollm2.json

Each query of a block reads every committed key, so its softmax takes the
exponential of one score per key and head. Where that exponential is
slow (MLX's CPU backend on x86-64), the block's attention grows with its
queries at a long context, and a tree of n nodes costs nearly n times a
plain token's attention. The elementwise exponential is also timed against
NumPy's on the same machine.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redrafter_mlx  # noqa: E402, F401  (loads OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from redrafter_mlx.loading.loader import load  # noqa: E402
from redrafter_mlx.serving.bench import environment  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` evaluated."""
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="mlx-lm folder or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--contexts", default="512,2000,7000")
    parser.add_argument("--queries", default="1,2,3,4,8,16")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    redrafter, _ = load(args.model)
    config = redrafter.base.model.args
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = len(redrafter.base.model.layers)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        keys = mx.random.normal((1, kv_heads, context + 16, head_dim))
        values = mx.random.normal((1, kv_heads, context + 16, head_dim))
        for n in (int(q) for q in args.queries.split(",")):
            queries = mx.random.normal((1, heads, n, head_dim))
            k, v = keys[..., : context + n, :], values[..., : context + n, :]
            mask = mx.ones((1, 1, n, context + n), mx.bool_)
            scores = mx.random.normal((1, heads, n, context + n))
            mx.eval(queries, k, v, mask, scores)
            attention = timed(
                lambda: mx.fast.scaled_dot_product_attention(queries, k, v, scale=head_dim**-0.5, mask=mask),
                args.repeats,
            )
            exponential = timed(lambda: mx.exp(scores), args.repeats)
            rows.append(
                {
                    "context": context,
                    "queries": n,
                    "attention_ms": attention,
                    "exp_ms": exponential,
                    "attention_ms_all_layers": attention * layers,
                }
            )
            print(
                f"context {context:>6}  queries {n:>3}  attention {attention:6.2f} ms a layer "
                f"({attention * layers:7.1f} ms for {layers} layers), its scores' exp {exponential:6.2f} ms",
                flush=True,
            )
    elements = 1 << 20
    x = mx.random.normal((elements,))
    mx.eval(x)
    host = np.array(x)
    mlx_ns = timed(lambda: mx.exp(x), args.repeats) * 1e6 / elements
    tic = time.perf_counter()
    for _ in range(args.repeats):
        np.exp(host)
    numpy_ns = (time.perf_counter() - tic) / args.repeats * 1e9 / elements
    print(f"exp of one float32: MLX {mlx_ns:.2f} ns, NumPy {numpy_ns:.2f} ns")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "command": " ".join(sys.argv),
                "environment": environment(redrafter),
                "layer": {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "layers": layers},
                "rows": rows,
                "exp_ns_per_element": {"mlx": mlx_ns, "numpy": numpy_ns},
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
