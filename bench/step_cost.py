"""A ReDrafter step against its verification pass.

For each prompt, in one process and alternating: the mean time of a step
after the prefill (the default model and drafter, ``--max-nodes`` drafted
nodes verified every step, profiling off) over ``--max-tokens`` new tokens,
and one mlx-lm forward pass of the same model over ``--max-nodes + 1``
tokens on a KV cache holding the same prompt (mlx-lm's own model and
cache). The ratio is what a step costs besides its pass. The steps' caches
grow by the answer as they go, so the same pass is also timed behind the
prompt and the first half of the answer (the steps' mean context). A
profiled run of the same steps splits a step into its phases.

    python3 bench/step_cost.py --prompts data/prompts/heldout.jsonl --num-prompts 8 --json out.json
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redrafter_mlx  # noqa: E402, F401  (loads OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from redrafter_mlx.drafting.settings import DraftSettings  # noqa: E402
from redrafter_mlx.engine.decoder import Decoder  # noqa: E402
from redrafter_mlx.engine.profile import StepProfile  # noqa: E402
from redrafter_mlx.loading.loader import load  # noqa: E402
from redrafter_mlx.serving.api import encode_prompt  # noqa: E402
from redrafter_mlx.serving.prompts import read_prompts  # noqa: E402


def step_times(redrafter, prompt, nodes, max_tokens, eos, profile=None) -> tuple[list, list]:
    """Wall seconds of each step after the prefill, until ``max_tokens`` new
    tokens; and the tokens generated."""
    decoder = Decoder(redrafter, DraftSettings(max_nodes=nodes), eos_token_ids=eos, profile=profile)
    tokens = list(decoder.join([prompt], max_tokens)[0].tokens)
    times = []
    while decoder.rows:
        tic = time.perf_counter()
        outputs = decoder.step()
        times.append(time.perf_counter() - tic)
        if outputs:
            tokens += outputs[0].tokens
        if outputs and outputs[0].finish_reason:
            break
    return times, tokens


def pass_time(model, prompt, tokens: int, repeats: int) -> float:
    """Mean seconds of one mlx-lm forward pass of ``tokens`` tokens after the prompt."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    block = mx.array([prompt[-tokens:] if len(prompt) >= tokens else (prompt * tokens)[:tokens]])
    seconds = []
    for _ in range(repeats + 1):
        tic = time.perf_counter()
        mx.eval(model(block, cache=cache))
        seconds.append(time.perf_counter() - tic)
        for c in cache:
            c.trim(tokens)
    return statistics.mean(seconds[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="data/prompts/heldout.jsonl")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-nodes", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=8, help="mlx-lm passes timed per prompt")
    parser.add_argument("--json")
    args = parser.parse_args()

    redrafter, tokenizer = load()
    eos = list(tokenizer.eos_token_ids)
    prompts = [encode_prompt(tokenizer, p) for p in read_prompts(args.prompts)[: args.num_prompts]]
    step_times(redrafter, prompts[0], args.max_nodes, 8, eos)  # warm-up
    pass_time(redrafter.base.model, prompts[0], args.max_nodes + 1, 2)
    rows = []
    for i, prompt in enumerate(prompts):
        steps, generated = step_times(redrafter, prompt, args.max_nodes, args.max_tokens, eos)
        one = pass_time(redrafter.base.model, prompt, args.max_nodes + 1, args.repeats)
        # The steps' caches hold the prompt and what was generated so far: the
        # same pass behind the prompt and half the answer, for reference.
        midway = pass_time(
            redrafter.base.model, prompt + generated[: len(generated) // 2], args.max_nodes + 1, args.repeats
        )
        step = statistics.mean(steps)
        rows.append(
            {
                "prompt": i,
                "prompt_tokens": len(prompt),
                "steps": len(steps),
                "step_ms": 1000 * step,
                "pass_ms": 1000 * one,
                "ratio": step / one,
                "midway_pass_ms": 1000 * midway,
                "midway_ratio": step / midway,
            }
        )
        print(
            f"prompt {i}: {len(steps)} steps, step {1000 * step:.2f} ms, mlx-lm pass over {args.max_nodes + 1} tokens {1000 * one:.2f} ms, "
            f"ratio {step / one:.3f} (behind half the answer too: {1000 * midway:.2f} ms, {step / midway:.3f})",
            flush=True,
        )
    profile = StepProfile()
    for prompt in prompts:
        step_times(redrafter, prompt, args.max_nodes, args.max_tokens, eos, profile)
    phases = {phase: 1000 * seconds / profile.steps for phase, seconds in profile.seconds.items() if phase != "prefill"}
    ratios, midway = [r["ratio"] for r in rows], [r["midway_ratio"] for r in rows]
    print(
        f"step / pass: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) over {len(rows)} prompts"
    )
    print(
        f"step / pass behind half the answer: median {statistics.median(midway):.3f} (min {min(midway):.3f}, max {max(midway):.3f})"
    )
    print("profiled ms per step: " + ", ".join(f"{phase} {ms:.2f}" for phase, ms in phases.items()))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": " ".join(sys.argv),
                    "settings": vars(args),
                    "prompts": rows,
                    "median_ratio": statistics.median(ratios),
                    "median_midway_ratio": statistics.median(midway),
                    "profile_ms_per_step": phases,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
