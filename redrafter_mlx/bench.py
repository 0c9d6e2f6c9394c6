"""Benchmark: autoregressive decoding against ReDrafter on the same prompts,
in the same process, alternating the two so that machine drift hits both.

Batch size 1 uses mlx-lm's own generation loop as the baseline; larger
batches use this project's batched autoregressive loop (same cache).
"""

import hashlib
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.generate import generate_step

from .autoregressive import autoregressive_steps
from .blas import blas_name
from .generate import Chooser, ReDrafter, StepTiming, generate_steps


# Used when no prompts file is given: a mix of tasks like a chat user's.
DEFAULT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a binary search does, step by step.",
    "A farmer has 12 cows and buys 7 more, then sells 5. How many cows does he have?",
    "Give three tips for staying focused while studying.",
    "Write a Python function that returns the factorial of n.",
    "Summarize the water cycle for a ten-year-old.",
    "List the planets of the solar system in order from the sun.",
]


@dataclass
class Run:
    """One method on one batch of prompts."""

    tokens: list  # per prompt, the generated ids
    seconds: float
    steps: int = 0
    step_tokens: int = 0
    peak_memory_gb: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds if self.seconds else 0.0


@dataclass
class ShapeResult:
    beam_width: int
    beam_length: int
    redrafter_tps: list = field(default_factory=list)  # per batch and repeat
    baseline_tps: list = field(default_factory=list)
    speedups: list = field(default_factory=list)
    steps: int = 0
    step_tokens: int = 0
    timing: StepTiming = field(default_factory=StepTiming)
    peak_memory_gb: float = 0.0
    mismatches: int = 0  # greedy outputs that differ from the baseline's

    def summary(self) -> dict:
        t = self.timing
        split = t.drafting + t.verification + t.acceptance
        return {
            "beam_width": self.beam_width,
            "beam_length": self.beam_length,
            "baseline_tps": statistics.median(self.baseline_tps),
            "redrafter_tps": statistics.median(self.redrafter_tps),
            "speedup_median": statistics.median(self.speedups),
            "speedup_min": min(self.speedups),
            "speedup_max": max(self.speedups),
            "tokens_per_step": self.step_tokens / self.steps if self.steps else 0.0,
            "time_split": {
                "drafting": t.drafting / split if split else 0.0,
                "verification": t.verification / split if split else 0.0,
                "acceptance_and_cache": t.acceptance / split if split else 0.0,
            },
            "peak_memory_gb": self.peak_memory_gb,
            "greedy_mismatches": self.mismatches,
        }


def baseline_run(redrafter: ReDrafter, prompts: list, max_tokens: int, choose: Chooser, eos: list, sampler) -> Run:
    mx.reset_peak_memory()
    tic = time.perf_counter()
    if len(prompts) == 1:
        tokens = []
        for token, _ in generate_step(mx.array(prompts[0]), redrafter.base.model, max_tokens=max_tokens, sampler=sampler):
            if token in eos:
                break
            tokens.append(token)
        outputs = [tokens]
    else:
        outputs = [[] for _ in prompts]
        for step in autoregressive_steps(redrafter.base, prompts, max_tokens=max_tokens, choose=choose, eos_token_ids=eos):
            for out in step:
                outputs[out.row] += out.tokens
    return Run(outputs, time.perf_counter() - tic, peak_memory_gb=mx.get_peak_memory() / 1e9)


def redrafter_run(redrafter, prompts, max_tokens, choose, eos, width, length, timing=None) -> Run:
    mx.reset_peak_memory()
    outputs, steps, step_tokens = [[] for _ in prompts], 0, 0
    tic = time.perf_counter()
    for step in generate_steps(
        redrafter, prompts, max_tokens=max_tokens, beam_width=width, beam_length=length,
        choose=choose, eos_token_ids=eos, timing=timing,
    ):
        for out in step:
            outputs[out.row] += out.tokens
            if out.num_accepted is not None:
                steps += 1
                step_tokens += out.num_accepted + 1
    return Run(outputs, time.perf_counter() - tic, steps, step_tokens, mx.get_peak_memory() / 1e9)


def run_benchmark(
    redrafter: ReDrafter,
    prompts: list,
    shapes: list,
    *,
    max_tokens: int,
    batch_size: int,
    repeats: int,
    choose: Chooser,
    sampler,
    greedy: bool,
    eos: list,
    progress: Optional[Callable[[int], None]] = None,
) -> list[ShapeResult]:
    """Time every beam shape against the baseline on every batch of prompts.

    Per batch and repeat, the baseline runs, then each shape, alternating.
    One extra profiled run per shape (on the first batch) splits the time
    into drafting, verification and acceptance (its syncs would distort the
    timed runs, so it is not one of them).
    """
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    results = [ShapeResult(w, l) for w, l in shapes]
    # Warm-up: compile kernels and fill allocator caches for every path.
    baseline_run(redrafter, batches[0], 8, choose, eos, sampler)
    for r in results:
        redrafter_run(redrafter, batches[0], 8, choose, eos, r.beam_width, r.beam_length)
        redrafter_run(redrafter, batches[0], max_tokens, choose, eos, r.beam_width, r.beam_length, timing=r.timing)
    for _ in range(repeats):
        for batch in batches:
            baseline = baseline_run(redrafter, batch, max_tokens, choose, eos, sampler)
            for r in results:
                run = redrafter_run(redrafter, batch, max_tokens, choose, eos, r.beam_width, r.beam_length)
                r.baseline_tps.append(baseline.tokens_per_second)
                r.redrafter_tps.append(run.tokens_per_second)
                r.speedups.append(run.tokens_per_second / baseline.tokens_per_second)
                r.steps += run.steps
                r.step_tokens += run.step_tokens
                r.peak_memory_gb = max(r.peak_memory_gb, run.peak_memory_gb)
                if greedy:
                    r.mismatches += sum(a != b for a, b in zip(run.tokens, baseline.tokens))
                if progress:
                    progress(1)
    return results


def environment(dtype: str) -> dict:
    import mlx_lm

    return {
        "machine": platform.machine(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "device": "metal" if mx.metal.is_available() else ("gpu" if mx.default_device() == mx.gpu else "cpu"),
        "blas": blas_name(),
        "dtype": dtype,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
    }


def weights_digest(drafter_folder: str) -> str:
    """The first 16 hex digits of the SHA-256 of a drafter's weights, so that
    a saved result names the exact drafter it measured."""
    return hashlib.sha256((Path(drafter_folder) / "model.safetensors").read_bytes()).hexdigest()[:16]


def format_table(results: list[ShapeResult]) -> str:
    header = (
        f"{'beams':>6} {'AR tok/s':>9} {'ReDr tok/s':>10} {'speed-up (min-max)':>20} {'tok/step':>8} "
        f"{'draft/verify/accept %':>22} {'peak GB':>8} {'greedy':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        s = r.summary()
        split = s["time_split"]
        lines.append(
            f"{r.beam_width}x{r.beam_length:<4} {s['baseline_tps']:9.1f} {s['redrafter_tps']:10.1f} "
            f"{s['speedup_median']:8.2f}x ({s['speedup_min']:.2f}-{s['speedup_max']:.2f}) {s['tokens_per_step']:8.2f} "
            f"{100 * split['drafting']:7.0f}/{100 * split['verification']:.0f}/{100 * split['acceptance_and_cache']:.0f}"
            f"{'':>6} {s['peak_memory_gb']:8.2f} {'MISMATCH' if r.mismatches else 'same':>8}"
        )
    return "\n".join(lines)


def plot_heatmap(results: list[ShapeResult], path: str, title: str) -> None:
    """Speed-up over beam width x beam length, like the paper's figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = sorted({r.beam_width for r in results})
    lengths = sorted({r.beam_length for r in results})
    grid = [[float("nan")] * len(lengths) for _ in widths]
    for r in results:
        grid[widths.index(r.beam_width)][lengths.index(r.beam_length)] = r.summary()["speedup_median"]
    fig, ax = plt.subplots(figsize=(max(1.2 * len(lengths) + 2, 5), 1.0 * len(widths) + 1.5))
    image = ax.imshow(grid, cmap="viridis", origin="lower")
    ax.set_xticks(range(len(lengths)), [str(l) for l in lengths])
    ax.set_yticks(range(len(widths)), [str(w) for w in widths])
    ax.set_xlabel("beam length")
    ax.set_ylabel("beam width")
    ax.set_title(title, fontsize=9)
    for i in range(len(widths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{grid[i][j]:.2f}x", ha="center", va="center", color="white", fontsize=9)
    fig.colorbar(image, ax=ax, label="speed-up")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: list[ShapeResult], settings: dict, env: dict) -> dict:
    return {"environment": env, "settings": settings, "results": [r.summary() for r in results]}

