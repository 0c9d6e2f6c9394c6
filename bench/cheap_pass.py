"""The floor where a pass is cheap: the default generation against mlx-lm's
``generate_step`` on a random 2-layer llama (hidden 64, SmolLM2's
vocabulary), whose forward pass costs about a millisecond here, as a small
model's does on an Apple GPU.

Drafting cannot pay there, so the default generation (``auto``) must run at
mlx-lm's own speed: with a drafter whose proposals are never accepted (a
random one in the official format, its head spanning the whole vocabulary)
and with no drafter (context lookup only), for a model and drafter loaded
afresh for each answer (as ``generate``) and loaded once for many answers
(as ``chat`` and ``serve``). Each round times both methods on the same
prompt, alternating; the figure is the median of the rounds' ratios, with
their spread. The cost curve is measured once first, into a cache of this
run's own (so no earlier curve decides).

    python3 bench/cheap_pass.py --rounds 7 --json out.json
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redrafter_mlx  # noqa: E402, F401  (loads OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from redrafter_mlx.drafting.drafter import Drafter, DrafterArgs, save_drafter  # noqa: E402
from redrafter_mlx.engine.decoder import generate_steps  # noqa: E402
from redrafter_mlx.loading.loader import load, load_base_model  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def make_pair(folder: Path) -> tuple[str, str]:
    """A random 2-layer llama with SmolLM2's tokenizer, and a random drafter for it."""
    model_dir, drafter_dir = folder / "llama-2x64", folder / "drafter"
    _, tokenizer = load_base_model(None)
    model_dir.mkdir()
    tokenizer._tokenizer.save_pretrained(str(model_dir))
    config = dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**config))
    mx.save_safetensors(str(model_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (model_dir / "config.json").write_text(json.dumps(config))
    mx.random.seed(1)
    save_drafter(Drafter(DrafterArgs(vocab_size=49152, hidden_size=64, exit_dim=128)), str(drafter_dir))
    return str(model_dir), str(drafter_dir)


def plain_tps(model, prompt: list, tokens: int) -> float:
    tic = time.perf_counter()
    n = 0
    for _, _ in generate_step(mx.array(prompt), model, max_tokens=tokens):
        n += 1
    return n / (time.perf_counter() - tic)


def redrafter_tps(redrafter, prompt: list, tokens: int) -> tuple[float, int, int]:
    """tokens/s of the default generation, and its steps and tokens."""
    running = generate_steps(redrafter, [prompt], max_tokens=tokens)
    tic = time.perf_counter()
    n = steps = 0
    for (out,) in running:
        n += len(out.tokens)
        steps += out.num_accepted is not None
    return n / (time.perf_counter() - tic), steps, n


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--lengths", default="1024,256")
    parser.add_argument("--json")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]

    work = Path(tempfile.mkdtemp(prefix="cheap-pass-"))
    os.environ["REDRAFTER_MLX_CACHE"] = str(work / "cache")
    model_dir, drafter_dir = make_pair(work)
    _, tokenizer = load(model_dir, drafter="none")
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    results = []
    for drafter in (drafter_dir, "none"):
        for loading in ("afresh", "once"):
            kept, _ = load(model_dir, drafter=drafter)
            redrafter_tps(kept, prompt, 16)  # the cost curve (measured the first time), kernels
            plain_tps(kept.base.model, prompt, 16)
            for tokens in lengths:
                ratios, steps = [], []
                for _ in range(args.rounds):
                    pair = load(model_dir, drafter=drafter)[0] if loading == "afresh" else kept
                    base_rate = plain_tps(pair.base.model, prompt, tokens)
                    rate, step_count, emitted = redrafter_tps(pair, prompt, tokens)
                    ratios.append(rate / base_rate)
                    steps.append(emitted / max(step_count, 1))
                row = {
                    "drafter": "random (never accepted)" if drafter != "none" else "none (lookup only)",
                    "loading": loading,
                    "tokens": tokens,
                    "median": statistics.median(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                    "ratios": ratios,
                    "tokens_per_step": statistics.median(steps),
                }
                results.append(row)
                print(
                    f"{row['drafter']:>24} loaded {loading:>6}, {tokens:5d} tokens: {row['median']:.3f}x mlx-lm "
                    f"(rounds {row['min']:.3f}-{row['max']:.3f}), {row['tokens_per_step']:.2f} tokens per step",
                    flush=True,
                )
    curve = json.loads((work / "cache" / "cost.json").read_text())
    if args.json:
        Path(args.json).write_text(
            json.dumps({"command": " ".join(sys.argv), "results": results, "cost_cache": curve}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
