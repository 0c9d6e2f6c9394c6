"""Tokens per step with the search's first drafted token taken from the
first F rows of the shipped drafter's frequency-sorted draft vocabulary and
its later tokens from the first L (``DraftSettings.first_vocab``,
``later_vocab``), at fixed node counts, greedy, on tuning prompts (never
the held-out or dev ones).

    python3 bench/research/drafting/draft_vocab.py --prompts data/prompts/tune.jsonl --num-prompts 16 --max-tokens 96 --rows 2048:2048,1024:1024
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import redrafter_mlx  # noqa: E402, F401  (OpenBLAS before mlx.core)
from redrafter_mlx.drafting.settings import DraftSettings  # noqa: E402
from redrafter_mlx.engine.decoder import generate_steps  # noqa: E402
from redrafter_mlx.loading.loader import load  # noqa: E402
from redrafter_mlx.serving.api import encode_prompt  # noqa: E402
from redrafter_mlx.serving.prompts import read_prompts  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="data/prompts/tune.jsonl")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--start", type=int, default=0, help="skip this many prompts of the file first")
    parser.add_argument("--model", help="base model (default: the embedded one, with its shipped drafter)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rows", default="0:2048,2048:2048,1024:1024", help="first:later row counts, comma-separated (0: all rows)")
    args = parser.parse_args()
    redrafter, tokenizer = load(args.model)
    prompts = [encode_prompt(tokenizer, p) for p in read_prompts(args.prompts)[args.start : args.start + args.num_prompts]]
    for pair in args.rows.split(","):
        first, later = (int(r) or None for r in pair.split(":"))
        figures = []
        for nodes in (8, 4):
            tokens = steps = 0
            for prompt in prompts:
                draft = DraftSettings(max_nodes=nodes, first_vocab=first, later_vocab=later)
                for (out,) in generate_steps(redrafter, [prompt], max_tokens=args.max_tokens, draft=draft, eos_token_ids=tokenizer.eos_token_ids):
                    if out.num_accepted is not None:
                        tokens, steps = tokens + out.num_accepted + 1, steps + 1
            figures.append(f"{tokens / steps:.3f} at {nodes} nodes")
        print(f"first token from {first or 'all'} rows, later ones from {later or 'all'}: " + ", ".join(figures), flush=True)


if __name__ == "__main__":
    main()
