"""Mean tokens per step (accepted drafts + bonus) of ReDrafter over a
prompts file, per beam shape. Tokens per step does not depend on timing, so
prompts run in batches; results are written after each shape, and shapes
already in the output file are skipped (rerun the same command to resume).
Per-prompt steps and tokens are kept too, so a subset's figure can be
recomputed from a run over the whole file.

    python bench/acceptance.py --drafter DRAFTER --prompts data/prompts/dev.jsonl \\
        --shapes 1x5,2x5,4x5,8x5 --max-tokens 256 --out bench/results/acceptance.json
"""

import argparse
import json
import time
from pathlib import Path

import redrafter_mlx
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.engine.decoder import generate_steps
from redrafter_mlx.serving.api import encode_prompt
from redrafter_mlx.serving.prompts import read_prompts


def measure(redrafter, prompts, width, length, max_tokens, batch_size, choose, eos):
    """Totals over the prompts, and per prompt (steps, tokens from steps, generated tokens)."""
    per_prompt = [[0, 0, 0] for _ in prompts]
    histogram = [0] * length
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        for outputs in generate_steps(
            redrafter,
            batch,
            max_tokens=max_tokens,
            draft=DraftSettings.rnn_only(width, length),
            choose=choose,
            eos_token_ids=eos,
        ):
            for out in outputs:
                counts = per_prompt[start + out.row]
                counts[2] += len(out.tokens)
                if out.num_accepted is not None:
                    counts[0] += 1
                    counts[1] += out.num_accepted + 1
                    histogram[out.num_accepted] += 1
    steps, step_tokens, generated = (sum(column) for column in zip(*per_prompt))
    return {
        "steps": steps,
        "tokens_per_step": step_tokens / steps,
        "generated_tokens": generated,
        "accepted_histogram": histogram,
        "per_prompt": {"columns": ["steps", "step_tokens", "generated_tokens"], "rows": per_prompt},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--num-prompts", type=int, default=None, help="Use the first N prompts (after --every).")
    parser.add_argument("--every", type=int, default=1, help="Use every K-th prompt of the file (a spread-out subset).")
    parser.add_argument("--shapes", default="1x5,2x5,4x5,8x5")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.every < 1:
        parser.error("--every must be at least 1")

    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {"settings": vars(args), "shapes": {}}
    redrafter, tokenizer = redrafter_mlx.load(args.model, drafter=args.drafter)
    texts = read_prompts(args.prompts)[:: args.every][: args.num_prompts]
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    choose = redrafter_mlx.make_chooser(redrafter_mlx.SamplingSettings(temp=args.temp, seed=args.seed))
    for shape in args.shapes.split(","):
        if shape in results["shapes"]:
            continue
        width, length = map(int, shape.split("x"))
        tic = time.perf_counter()
        result = measure(
            redrafter, prompts, width, length, args.max_tokens, args.batch_size, choose, tokenizer.eos_token_ids
        )
        result.update(prompts=len(prompts), seconds=round(time.perf_counter() - tic))
        results["shapes"][shape] = result
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(shape, json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
