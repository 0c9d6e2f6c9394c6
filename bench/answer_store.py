"""What drafting from earlier answers (``chat --answer-store-mb``, ``serve
--answer-store-mb``) buys on multi-turn conversations and on a task asked
again with another object: each turn is answered without the store and with
it, alternating which goes first, greedy, both from the conversation's
prompt cache as `redrafter-mlx chat` answers. The store keeps every answer
given with it, across conversations, as a chat or server process does.

    python3 bench/answer_store.py --json bench/results/serving/answer-store.json
"""

import argparse
import json
import statistics
import time

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)
from redrafter_mlx.drafting.answers import answer_store
from redrafter_mlx.engine.prompt_cache import make_prompt_cache
from redrafter_mlx.engine.types import ReDrafter
from redrafter_mlx.loading.loader import load
from redrafter_mlx.serving.api import stream_steps


def answer(redrafter, tokenizer, messages, cache, max_tokens):
    tic, tokens, last = time.perf_counter(), [], None
    for last in stream_steps(redrafter, tokenizer, messages, max_tokens, prompt_cache=cache):
        tokens += last.tokens
    return tokens, time.perf_counter() - tic, (last.step_tokens / last.steps if last and last.steps else 0.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", default="data/prompts/heldout-conversations.jsonl")
    parser.add_argument("--repeated", default="data/prompts/heldout-repeated.jsonl")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--store-mb", type=float, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    plain, tokenizer = load()
    stored = ReDrafter(
        plain.base,
        plain.drafter,
        plain.identity,
        plain.drafter_identity,
        datastore=plain.datastore,
        answers=answer_store(args.store_mb),
    )
    conversations = [json.loads(line)["turns"] for line in open(args.conversations)]
    repeated = [[json.loads(line)["prompt"]] for line in open(args.repeated)]
    answer(plain, tokenizer, [{"role": "user", "content": "Hello"}], None, 8)  # warm-up
    report = {}
    for name, sets in (("conversations", conversations), ("repeated", repeated)):
        rows, turn = [], 0
        for turns in sets:
            caches = {"without": make_prompt_cache(), "with": make_prompt_cache()}
            messages = []
            for text in turns:
                messages.append({"role": "user", "content": text})
                order = ("without", "with") if turn % 2 == 0 else ("with", "without")
                result = {}
                for method in order:
                    result[method] = answer(
                        stored if method == "with" else plain, tokenizer, messages, caches[method], args.max_tokens
                    )
                assert result["with"][0] == result["without"][0], "the store changed an answer"
                tokens = result["with"][0]
                rows.append(
                    {
                        "turn": len(messages) // 2 + 1,
                        "tokens": len(tokens),
                        "speedup": result["without"][1] / result["with"][1],
                        "tokens_per_step": {m: round(result[m][2], 3) for m in result},
                    }
                )
                messages.append({"role": "assistant", "content": tokenizer.decode(tokens)})
                turn += 1
        report[name] = {
            "answers": len(rows),
            "speedup_median": round(statistics.median(r["speedup"] for r in rows), 3),
            "speedup_min": round(min(r["speedup"] for r in rows), 3),
            "speedup_max": round(max(r["speedup"] for r in rows), 3),
            "tokens_per_step_without": round(statistics.mean(r["tokens_per_step"]["without"] for r in rows), 3),
            "tokens_per_step_with": round(statistics.mean(r["tokens_per_step"]["with"] for r in rows), 3),
            "rows": rows,
        }
        print(json.dumps({k: v for k, v in report[name].items() if k != "rows"} | {"set": name}), flush=True)
    report["store_tokens"] = len(stored.answers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
