"""Prefill of long prompts: the engine's prefill (the server's: chunks of
up to 2,048 tokens, shorter on the CPU as the context grows) against
mlx-lm's own `generate_step` (chunks of 2,048), to the first token,
alternating, with each one's peak memory.

    python3 bench/long_prefill.py --model gemma --lengths 8000,16000,32000 --json bench/results/long/prefill-gemma3-270m.json
    python3 bench/long_prefill.py --model default --lengths 1000,4000,8000 --json bench/results/long/prefill-smollm2.json

The prompt is this Python's own standard library source, cut to each
length.
"""

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import redrafter_mlx  # noqa: E402, F401  (loads OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from redrafter_mlx.engine.prefill import Prefill  # noqa: E402
from redrafter_mlx.loading.gguf import gemma3_270m_path  # noqa: E402
from redrafter_mlx.loading.loader import load  # noqa: E402
from redrafter_mlx.serving.bench import environment  # noqa: E402

SOURCES = ["_pydecimal", "typing", "inspect", "pydoc", "tarfile", "argparse"]


def ours(base, prompt: list) -> None:
    prefill = Prefill(base, [prompt])
    while not prefill.done:
        prefill.advance()
    _, cache, hidden, logits = prefill.finish()
    mx.eval(mx.argmax(logits, axis=-1), [c.state_arrays() for c in cache])


def theirs(base, prompt: list) -> None:
    next(generate_step(mx.array(prompt), base.model, max_tokens=1, prompt_cache=make_prompt_cache(base.model)))


def timed(run, base, prompt: list) -> tuple:
    mx.clear_cache()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    run(base, prompt)
    return time.perf_counter() - tic, mx.get_peak_memory() / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="gemma", help="a model path, 'gemma' for Gemma 3 270M, or 'default' for the embedded model"
    )
    parser.add_argument("--lengths", default="8000,16000,32000")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    model = gemma3_270m_path() if args.model == "gemma" else None if args.model == "default" else args.model
    redrafter, tokenizer = load(model, drafter="none")
    base = redrafter.base
    text = "\n\n".join(Path(inspect.getsourcefile(__import__(m))).read_text() for m in SOURCES)
    ids = tokenizer.encode(text)
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        if base.max_context and length >= base.max_context:
            length = base.max_context - 8
        prompt = ids[:length]
        runs = {"redrafter": [], "mlx_lm": []}
        for repeat in range(args.repeats):
            for name, run in (
                (("redrafter", ours), ("mlx_lm", theirs))
                if repeat % 2 == 0
                else (("mlx_lm", theirs), ("redrafter", ours))
            ):
                runs[name].append(timed(run, base, prompt))
        row = {"tokens": len(prompt)}
        for name, measured in runs.items():
            row[f"{name}_seconds"] = statistics.median(s for s, _ in measured)
            row[f"{name}_peak_gb"] = max(m for _, m in measured)
        row["ratio"] = row["mlx_lm_seconds"] / row["redrafter_seconds"]
        rows.append(row)
        print(
            f"{len(prompt)} tokens: redrafter-mlx {row['redrafter_seconds']:.1f} s ({row['redrafter_peak_gb']:.2f} GB), mlx-lm "
            f"{row['mlx_lm_seconds']:.1f} s ({row['mlx_lm_peak_gb']:.2f} GB): {row['ratio']:.2f}x as fast",
            flush=True,
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps({"command": " ".join(sys.argv), "environment": environment(redrafter), "lengths": rows}, indent=1)
        + "\n"
    )


if __name__ == "__main__":
    main()
