"""What the RNN's beam search costs per step, and what could make it cheaper:
the search eager and under ``mx.compile``, and the drafter's vocabulary
projection as a float32, float16, 8-bit and 4-bit matmul for the row counts
the search uses, and the search with its later tokens drafted from the
first --later-rows rows of the draft vocabulary (``DraftSettings.later_vocab``).
Medians of --repeats runs, alternating the variants.

    python3 bench/drafting_cost.py --json bench/results/drafting-cost.json
"""

import argparse
import json
import statistics
import time

import redrafter_mlx  # noqa: F401, I001  (preloads OpenBLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn

from redrafter_mlx.bench import environment
from redrafter_mlx.beam_search import beam_search
from redrafter_mlx.loading import load


def timed(run, repeats: int) -> float:
    mx.eval(run())
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--drafter")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--later-rows", default="4096,2048,1024", help="Row counts to time the search with (comma-separated).")
    parser.add_argument("--json")
    args = parser.parse_args()
    redrafter, _ = load(args.model, args.drafter)
    drafter, embed = redrafter.drafter, redrafter.base.embed
    width, length = 4, 5
    report = {"environment": environment(str(redrafter.base.dtype)), "search": [], "projection": []}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        hidden = mx.random.normal((batch, redrafter.base.hidden_size)).astype(redrafter.base.dtype)
        first = mx.arange(100, 100 + batch, dtype=mx.int32)
        compiled = mx.compile(lambda h, f: beam_search(drafter, embed, h, f, width, length))
        eager = beam_search(drafter, embed, hidden, first, width, length)
        same = bool(mx.array_equal(eager[0], compiled(hidden, first)[0]))
        later = [int(r) for r in args.later_rows.split(",") if r]
        searches = {"eager": lambda: beam_search(drafter, embed, hidden, first, width, length), "compiled": lambda: compiled(hidden, first)}
        for rows in later:
            searches[f"later{rows}"] = lambda rows=rows: beam_search(drafter, embed, hidden, first, width, length, rows)
        times = {name: [] for name in searches}
        for _ in range(3):
            for name, search in searches.items():
                times[name].append(timed(search, args.repeats))
        row = {"batch": batch, **{f"{name}_ms": 1000 * statistics.median(t) for name, t in times.items()}, "same_beams": same}
        report["search"].append(row)
        print(
            f"beam search {width}x{length}, batch {batch}: eager {row['eager_ms']:.2f} ms, mx.compile {row['compiled_ms']:.2f} ms (same beams: {same}); "
            + ", ".join(f"later tokens from {rows} rows {row[f'later{rows}_ms']:.2f} ms" for rows in later)
        )

    projection = drafter.lm_head[-1]
    rows_out, features = projection.weight.shape
    for rows in (1, 4, 32):
        x = mx.random.normal((rows, features))
        variants = {"float32": (projection, x)}
        half = nn.Linear(features, rows_out, bias=False)
        half.weight = projection.weight.astype(mx.float16)
        variants["float16"] = (half, x.astype(mx.float16))
        for bits in (8, 4):
            variants[f"{bits}-bit"] = (nn.QuantizedLinear.from_linear(projection, group_size=64, bits=bits), x)
        mx.eval([layer.parameters() for layer, _ in variants.values()])
        row = {"rows": rows, **{f"{name}_ms": 1000 * timed(lambda: layer(inp), args.repeats) for name, (layer, inp) in variants.items()}}
        report["projection"].append(row)
        print(f"vocab projection {features} -> {rows_out}, {rows} rows: " + ", ".join(f"{k[:-3]} {v:.2f} ms" for k, v in row.items() if k != "rows"))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
