"""First-token latency of each turn of a chat, with the conversation's
prompt cache (what `redrafter-mlx chat` does) and without it (the whole
conversation prefilled every turn), side by side: each turn is answered
both ways, alternating which goes first.

    python3 bench/chat_latency.py --prompts data/prompts/dev.jsonl --turns 10 --max-tokens 128 --json bench/results/serving/chat-latency.json

The user turns are the first --turns prompts of the file; greedy, so both
ways give the same answers (checked) and the conversations stay the same.
"""

import argparse
import json
import platform
import statistics
import sys

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS)
from redrafter_mlx.engine.prompt_cache import make_prompt_cache
from redrafter_mlx.loading.loader import load
from redrafter_mlx.serving.chat import answer
from redrafter_mlx.serving.prompts import read_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model")
    parser.add_argument("--drafter")
    parser.add_argument("--json")
    args = parser.parse_args()

    redrafter, tokenizer = load(args.model, drafter=args.drafter)
    questions = read_prompts(args.prompts)[: args.turns]
    messages, cache, rows = [], make_prompt_cache(), []
    answer(redrafter, tokenizer, [{"role": "user", "content": "Hi"}], 8, lambda s: None)  # warm-up
    for turn, question in enumerate(questions, 1):
        messages.append({"role": "user", "content": question})
        runs = {}
        for way in ("cache", "full") if turn % 2 else ("full", "cache"):
            text, stats, _ = answer(
                redrafter, tokenizer, messages, args.max_tokens, lambda s: None, cache if way == "cache" else None
            )
            runs[way] = (text, stats)
        if runs["cache"][0] != runs["full"][0]:
            sys.exit(f"turn {turn}: the answers differ with and without the cache")
        prompt = len(
            tokenizer.encode(
                tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )
        )
        row = {
            "turn": turn,
            "prompt_tokens": prompt,
            "cached_tokens": runs["cache"][1].cached_tokens,
            "first_token_s_full": runs["full"][1].first_token_seconds,
            "first_token_s_cache": runs["cache"][1].first_token_seconds,
        }
        rows.append(row)
        print(
            f"turn {turn:2d}: prompt {prompt:5d} tokens ({row['cached_tokens']} cached): first token {row['first_token_s_full']:.2f} s full prefill, {row['first_token_s_cache']:.2f} s with the cache",
            flush=True,
        )
        messages.append({"role": "assistant", "content": runs["cache"][0]})
    summary = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.machine()} {platform.system()}, float32 on the CPU unless Metal",
        "turns": rows,
        "median_first_token_s_full": statistics.median(r["first_token_s_full"] for r in rows),
        "median_first_token_s_cache": statistics.median(r["first_token_s_cache"] for r in rows),
    }
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
