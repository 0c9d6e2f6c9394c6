"""Decode speed with long prompts: ReDrafter's default generation against
mlx-lm's own `generate_step` on the same prompt, greedy, alternating, in one
process. Decode time only: each prompt is prefilled once, and both methods
start from copies of that cache (mlx-lm's own caches, a window layer's
keeping its last window) and are timed from their first token to their
last.

    python3 bench/long_prompts.py --lengths 500,2000,7000 --json bench/results/long/smollm2-heldout.json
    python3 bench/long_prompts.py --model gemma --lengths 24000 --json bench/results/long/gemma3-270m-heldout.json

Prompts are built at run time from this Python's own standard library (a
large module, cut to the length, then a task): an edit, which copies from
the prompt (a function of the module written out again with a docstring),
and a summary, which does not. A chat model gets them as a user message
through its chat template; a pretrained one as text to continue (the
function's first line after a comment saying it is copied; a docstring
opening a summary). ``--set`` picks the modules: ``tune`` for trying
changes, ``heldout`` (the default) for figures on record.
"""

import argparse
import ast
import importlib.util
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
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache  # noqa: E402

from redrafter_mlx.engine.decoder import generate_steps  # noqa: E402
from redrafter_mlx.engine.prefill import prefill  # noqa: E402
from redrafter_mlx.engine.prompt_cache import PromptCache  # noqa: E402
from redrafter_mlx.loading.gguf import gemma3_270m_path  # noqa: E402
from redrafter_mlx.loading.loader import load  # noqa: E402
from redrafter_mlx.serving.api import encode_prompt  # noqa: E402
from redrafter_mlx.serving.bench import environment  # noqa: E402

MODULES = {
    "tune": ["argparse", "inspect", "tarfile", "pydoc", "logging"],
    "heldout": [
        "typing",
        "_pydecimal",
        "email._header_value_parser",
        "mailbox",
        "turtle",
        "configparser",
        "difflib",
        "smtplib",
    ],
}


def module_source(name: str) -> str:
    spec = importlib.util.find_spec(name)
    return Path(spec.origin).read_text()


def functions(source: str) -> list:
    """(name, first line number) of each top-level function or method whose body is several lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= 6:
            found.append((node.name, node.lineno))
    return sorted(found, key=lambda f: f[1])


def build(tokenizer, module: str, length: int, kind: str) -> dict:
    """One prompt of about ``length`` tokens: the module's source from its
    first function on, cut to fit before the task (repeated when the module
    is shorter)."""
    source = module_source(module)
    found = functions(source)
    if found:
        source = "\n".join(source.splitlines()[found[0][1] - 1 :])
    while len(tokenizer.encode(source)) < length:
        source += "\n\n" + source
    chat = tokenizer.has_chat_template
    ids = tokenizer.encode(source)[: max(length - 80, 64)]
    text = tokenizer.decode(ids)
    shown = [f for f in found if f"def {f[0]}(" in text]
    name = shown[len(shown) // 2][0] if shown else None
    if kind == "edit" and name:
        if chat:
            task = f"Write the function `{name}` above out again, unchanged except for a one-line docstring at its top."
            prompt = encode_prompt(tokenizer, [{"role": "user", "content": f"{text}\n\n{task}"}])
        else:
            prompt = tokenizer.encode(f"{text}\n\n\n# The function {name}, copied from above:\n\ndef {name}(")
    else:
        kind = "summary"
        if chat:
            prompt = encode_prompt(
                tokenizer,
                [{"role": "user", "content": f"{text}\n\nSummarize in a few sentences what the code above does."}],
            )
        else:
            prompt = tokenizer.encode(f'{text}\n\n\n"""A summary of the module above, in plain English:\n\n')
    return {"module": module, "kind": kind, "function": name, "prompt": prompt}


def mlx_lm_caches(model, cache: list, windows: list, length: int) -> list:
    """mlx-lm's own caches holding what ours hold after ``length`` tokens: a
    window layer keeps its last window, in order, the next write at its start."""
    caches = make_prompt_cache(model)
    for theirs, ours, window in zip(caches, cache, windows):
        keys, values = ours.keys[..., :length, :], ours.values[..., :length, :]
        if isinstance(theirs, RotatingKVCache):
            kept = min(length, theirs.max_size)
            theirs.state = (
                keys[..., length - kept :, :],
                values[..., length - kept :, :],
                length,
                theirs.keep,
                theirs.max_size,
                kept,
            )
        elif isinstance(theirs, KVCache):
            theirs.state = (keys, values, length)
    return caches


def plain(model, prompt: list, saved: list, max_tokens: int, eos: set) -> tuple:
    caches = []
    for c in saved:  # each run writes its own copy (a window layer's writes in place, so its arrays too)
        copy = type(c).__new__(type(c))
        copy.__dict__.update(c.__dict__)
        copy.keys, copy.values = c.keys * 1, c.values * 1
        caches.append(copy)
    tokens, first = [], None
    for token, _ in generate_step(mx.array(prompt[-1:]), model, max_tokens=max_tokens, prompt_cache=caches):
        first = first or time.perf_counter()
        if token in eos:
            break
        tokens.append(token)
    return tokens, time.perf_counter() - first


def redrafter_run(redrafter, prompt: list, kv: list, max_tokens: int, eos: set) -> tuple:
    cache = PromptCache(prompt[:-1], [k for k, _ in kv], [v for _, v in kv], redrafter.identity)
    tokens, first, steps = [], None, 0
    for outputs in generate_steps(
        redrafter, [prompt], max_tokens=max_tokens, eos_token_ids=list(eos), prompt_caches=[cache]
    ):
        first = first or time.perf_counter()
        for out in outputs:
            tokens += out.tokens
            steps += out.num_accepted is not None
    return tokens, time.perf_counter() - first, steps


def measure(redrafter, tokenizer, case: dict, max_tokens: int, repeats: int) -> dict:
    base, prompt = redrafter.base, case["prompt"]
    eos = set(tokenizer.eos_token_ids)
    _, cache, _, _ = prefill(base, [prompt[:-1]])
    mx.eval([c.state_arrays() for c in cache])
    kv = [c.rows_kv(0, 0, len(prompt) - 1) for c in cache]
    saved = mlx_lm_caches(base.model, cache, base.windows, len(prompt) - 1)
    ratios, runs = [], []
    for _ in range(repeats):
        a, plain_seconds = plain(base.model, prompt, saved, max_tokens, eos)
        b, seconds, steps = redrafter_run(redrafter, prompt, kv, max_tokens, eos)
        # Tokens per second after the first token, each run's own.
        plain_rate, rate = (len(a) - 1) / plain_seconds, (len(b) - 1) / seconds
        ratios.append(rate / plain_rate)
        runs.append({"plain_tps": plain_rate, "redrafter_tps": rate, "tokens": len(b), "steps": steps, "same": a == b})
    return {
        **{k: case[k] for k in ("module", "kind", "function")},
        "prompt_tokens": len(prompt),
        "speedup": statistics.median(ratios),
        "same": all(r["same"] for r in runs),
        "tokens_per_step": sum(r["tokens"] - 1 for r in runs) / max(sum(r["steps"] for r in runs), 1),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="mlx-lm folder or .gguf; 'gemma' for Gemma 3 270M; default: the embedded SmolLM2"
    )
    parser.add_argument(
        "--drafter", default=None, help="drafter folder, or none (default: the model's shipped drafter)"
    )
    parser.add_argument("--lengths", default="500,2000,7000", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--set", choices=sorted(MODULES), default="heldout", help="which modules build the prompts")
    parser.add_argument("--modules", type=int, default=3, help="modules per length; each gives an edit and a summary")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--repeats", type=int, default=2, help="alternating runs per prompt; its speed-up is their median"
    )
    parser.add_argument("--json", required=True, help="where the results go")
    args = parser.parse_args()
    model = gemma3_270m_path() if args.model == "gemma" else args.model
    redrafter, tokenizer = load(model, drafter=args.drafter)
    results = []
    for length in (int(n) for n in args.lengths.split(",")):
        for module in MODULES[args.set][: args.modules]:
            for kind in ("edit", "summary"):
                case = build(tokenizer, module, length, kind)
                result = measure(redrafter, tokenizer, case, args.max_tokens, args.repeats)
                results.append(dict(result, length=length))
                print(
                    f"{length:>6} {module:<28} {result['kind']:<8} {result['prompt_tokens']:>6} tokens  {result['speedup']:.3f}x  "
                    f"{result['tokens_per_step']:.2f} tokens/step  same={result['same']}",
                    flush=True,
                )
    summary = {}
    for length in sorted({r["length"] for r in results}):
        for kind in ("edit", "summary"):
            ratios = [r["speedup"] for r in results if r["length"] == length and r["kind"] == kind]
            if ratios:
                summary[f"{length} {kind}"] = {
                    "median": statistics.median(ratios),
                    "min": min(ratios),
                    "prompts": len(ratios),
                }
                print(
                    f"{length:>6} {kind:<8} median {statistics.median(ratios):.3f}x  lowest {min(ratios):.3f}x  ({len(ratios)} prompts)"
                )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "command": " ".join(sys.argv),
                "environment": environment(redrafter),
                "summary": summary,
                "mismatches": sum(not r["same"] for r in results),
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
