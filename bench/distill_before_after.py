"""`redrafter-mlx distill` end to end, this checkout against an earlier one,
alternating on the same prompts and settings in one run.

Each round runs the earlier checkout's command (one process: it had no
--workers) and then this one's, each into a fresh folder, and times the whole
command (model loading included, a few seconds). Greedy answers must come out
identical; tokens/s counts response tokens. Make the earlier checkout with
`git worktree add /tmp/before COMMIT` (84ab9b9: the code issue 15 was filed
against).

    python3 bench/distill_before_after.py --before /tmp/before \
        --prompts ../shared/data/prompts/train-chat.jsonl --num-prompts 192 --max-tokens 128 --workers 2
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import redrafter_mlx  # noqa: F401  (OpenBLAS)
from redrafter_mlx.api import encode_prompt
from redrafter_mlx.distill import DataFolder
from redrafter_mlx.loading import load_base_model
from redrafter_mlx.prompts import read_prompts

HERE = Path(__file__).resolve().parent.parent


def shortest_prompts(path: str, count: int, folder: Path) -> Path:
    """The ``count`` prompts of ``path`` shortest under the chat template,
    as a plain prompts file both checkouts read."""
    _, tokenizer = load_base_model(None, "float32")
    prompts = read_prompts(path)
    if not all(isinstance(p, str) for p in prompts):
        sys.exit("error: the comparison needs plain text prompts (the earlier checkout reads only those)")
    chosen = sorted(prompts, key=lambda p: len(encode_prompt(tokenizer, p)))[:count]
    out = folder / "prompts.jsonl"
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in chosen), encoding="utf-8")
    return out


def run_distill(checkout: Path, prompts: Path, output: Path, args, extra: list) -> tuple[float, int, list]:
    """Wall seconds of one distill command, its response tokens, and its
    sequences in prompt order."""
    command = [sys.executable, "-m", "redrafter_mlx.cli", "distill", "--prompts", str(prompts), "--output", str(output),
               "--batch-size", str(args.batch_size), "--max-tokens", str(args.max_tokens), *extra]
    environment = dict(os.environ, PYTHONPATH=str(checkout))
    tic = time.perf_counter()
    subprocess.run(command, env=environment, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=checkout)
    seconds = time.perf_counter() - tic
    data = DataFolder(str(output)).load()
    by_prompt = sorted(range(len(data)), key=lambda i: int(data.prompt_index[i]))
    responses = int((data.lengths - data.prompt_lengths).sum())
    return seconds, responses, [data.sequence(i) for i in by_prompt]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="checkout of the earlier commit")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--num-prompts", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        prompts = shortest_prompts(args.prompts, args.num_prompts, scratch)
        for r in range(args.rounds):
            before_s, before_n, before_tokens = run_distill(Path(args.before), prompts, scratch / f"before-{r}", args, [])
            after_s, after_n, after_tokens = run_distill(HERE, prompts, scratch / f"after-{r}", args, ["--workers", str(args.workers)])
            same = len(before_tokens) == len(after_tokens) and all(np.array_equal(a, b) for a, b in zip(before_tokens, after_tokens))
            rows.append(dict(round=r, before_tps=round(before_n / before_s, 1), after_tps=round(after_n / after_s, 1),
                             speedup=round(before_s / after_s * after_n / before_n, 2), before_s=round(before_s, 1),
                             after_s=round(after_s, 1), response_tokens=after_n, same_output=same))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps(dict(settings=vars(args), dtype="float32", rounds=rows)))


if __name__ == "__main__":
    main()
