"""Benchmark: autoregressive decoding against ReDrafter on the same prompts,
in the same process, alternating the two so that machine drift hits both.

The baseline is mlx-lm's own generation loop at batch 1 and its own
``BatchGenerator`` for greedy batches. Sampled batches use this project's
batched plain decoding (same cache). Sampled baselines draw with
ReDrafter's own chooser (its noise is keyed by seed and position), so a
sampled baseline emits exactly the tokens the seeded ReDrafter run emits,
and the two are timed on the same text.
"""

import json
import platform
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step, generation_stream

from ..blas import blas_name
from ..drafting.settings import DraftSettings
from ..engine import calibrate
from ..engine.autoregressive import autoregressive_steps
from ..engine.decoder import fixed_costs, generate_steps
from ..engine.distributed import ONE_PROCESS, Ranks
from ..engine.profile import PHASES, StepProfile
from ..engine.types import Chooser, ReDrafter, TokenHistory
from ..errors import UserError

PROFILED_BATCHES = 4  # batches whose extra profiled run splits each configuration's step time

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
    step_nodes: int = 0
    peak_memory_gb: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds if self.seconds else 0.0


@dataclass
class Config:
    """A named drafting configuration to measure."""

    name: str
    draft: DraftSettings


def parse_configs(text: str) -> list[Config]:
    """Comma-separated: ``auto`` (the default settings), ``lookup`` (context
    lookup only, nodes by cost), ``nodes:K`` (the defaults' drafts, K nodes
    verified every step: tokens per step at a budget, which carries over to
    other machines), ``rnn:WxL`` (the RNN's WxL beams, all verified: the
    paper's method), ``both:WxL`` (those plus one lookup continuation of
    L - 1 tokens, all verified)."""
    configs = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        kind, _, shape = name.partition(":")
        if kind in ("auto", "lookup") and not shape:
            draft = DraftSettings()
        elif kind == "nodes" and shape.isdigit():
            draft = DraftSettings(max_nodes=int(shape))
        elif kind in ("rnn", "both") and shape.count("x") == 1 and all(p.isdigit() for p in shape.split("x")):
            draft = DraftSettings.rnn_only(*map(int, shape.split("x")))
            if kind == "both":
                draft = replace(
                    draft,
                    lookup=True,
                    lookup_length=draft.beam_length - 1,
                    max_nodes=draft.max_nodes + draft.beam_length - 1,
                )
        else:
            raise UserError(f"unknown bench configuration {name!r}; use auto, lookup, nodes:K, rnn:WxL or both:WxL")
        configs.append(Config(name, draft))
    if not configs:
        raise UserError("no bench configuration given")
    return configs


@dataclass
class ConfigResult:
    name: str
    redrafter_tps: list = field(default_factory=list)  # per batch and repeat
    baseline_tps: list = field(default_factory=list)
    baseline_runs: dict = field(default_factory=dict)  # batch index -> plain decoding's tokens/s per repeat
    speedups: dict = field(default_factory=dict)  # batch index -> one speed-up per repeat
    counts: dict = field(
        default_factory=dict
    )  # batch index -> [steps, tokens emitted by steps, nodes, tokens], over repeats
    profile: StepProfile = field(default_factory=StepProfile)  # from extra profiled runs
    peak_memory_gb: float = 0.0
    mismatches: int = 0  # outputs that differ from the baseline's

    def plain_spread(self) -> Optional[list]:
        """[min, max] of plain decoding's runs of a batch over their median (None with one repeat)."""
        ratios = [r / statistics.median(v) for v in self.baseline_runs.values() if len(v) > 1 for r in v]
        return [min(ratios), max(ratios)] if ratios else None

    def summary(self) -> dict:
        spent = {phase: t for phase, t in self.profile.seconds.items() if phase != "prefill"}
        split = sum(spent.values())
        # A batch counts once, by the median of its repeats: on a noisy
        # machine one run per batch spreads its speed-up by tens of percent.
        per_batch = [statistics.median(runs) for runs in self.speedups.values()]
        steps, step_tokens, step_nodes, _ = (sum(c[i] for c in self.counts.values()) for i in range(4))
        return {
            "config": self.name,
            "baseline_tps": statistics.median(self.baseline_tps),
            "redrafter_tps": statistics.median(self.redrafter_tps),
            "speedup_median": statistics.median(per_batch),
            "speedup_min": min(per_batch),
            "speedup_max": max(per_batch),
            "speedups": per_batch,
            # Plain decoding against itself: each repeat of a batch over the median of its repeats.
            "plain_spread": self.plain_spread(),
            "speedup_runs": list(self.speedups.values()),
            "tokens_per_step": step_tokens / steps if steps else 0.0,
            "nodes_per_step": step_nodes / steps if steps else 0.0,
            # What each batch's speed-up came with: a slow batch is short answers or few tokens per step.
            "per_batch": [
                {
                    "tokens_per_step": c[1] / c[0] if c[0] else 0.0,
                    "nodes_per_step": c[2] / c[0] if c[0] else 0.0,
                    "tokens": c[3] / len(self.speedups[b]),
                }
                for b, c in self.counts.items()
            ],
            "time_split": {phase: t / split if split else 0.0 for phase, t in spent.items()},
            "step_ms": self.profile.per_step(),
            "overhead_share": (split - spent["pass"]) / spent["pass"] if spent["pass"] else 0.0,
            "peak_memory_gb": self.peak_memory_gb,
            "mismatches": self.mismatches,
        }


def mlx_lm_sampler(choose: Chooser, prompt: list):
    """An mlx-lm sampler (logprobs (1, V) -> (1,) token) drawing with
    ``choose`` at each successive position after ``prompt``, as prompt 0.
    The committed tokens are not known here without a sync, so the history
    holds placeholders: right for the bench's settings (temperature, top-p),
    which read only positions, not for a repetition penalty."""
    context = list(prompt)

    def sampler(logprobs: mx.array) -> mx.array:
        token = choose(logprobs[:, None], TokenHistory([0], [context]))[:, 0]
        context.append(-1)
        return token

    return sampler


def baseline_run(redrafter: ReDrafter, prompts: list, max_tokens: int, choose: Chooser, eos: list) -> Run:
    mx.reset_peak_memory()
    tic = time.perf_counter()
    if len(prompts) == 1:
        tokens = []
        sampler = mlx_lm_sampler(choose, prompts[0])
        for token, _ in generate_step(
            mx.array(prompts[0]), redrafter.base.model, max_tokens=max_tokens, sampler=sampler
        ):
            if token in eos:
                break
            tokens.append(token)
        outputs = [tokens]
    elif not choose.is_sampled(0):
        outputs = mlx_lm_batch(redrafter.base.model, prompts, max_tokens, eos)
    else:
        outputs = [[] for _ in prompts]
        for step in autoregressive_steps(
            redrafter.base, prompts, max_tokens=max_tokens, choose=choose, eos_token_ids=eos
        ):
            for out in step:
                outputs[out.row] += out.tokens
    seconds = time.perf_counter() - tic
    # mlx-lm's loop leaves a pass in flight on its own stream when it stops
    # early; on a split model its hops must end before the next run's begin.
    mx.synchronize(generation_stream)
    return Run(outputs, seconds, peak_memory_gb=mx.get_peak_memory() / 1e9)


def mlx_lm_batch(model, prompts: list, max_tokens: int, eos: list) -> list:
    """Greedy batched decoding by mlx-lm's own ``BatchGenerator``: each
    prompt's tokens, without the end-of-sequence token."""
    generator = BatchGenerator(
        model, stop_tokens=[[t] for t in eos], completion_batch_size=len(prompts), prefill_batch_size=len(prompts)
    )
    uids = generator.insert(prompts, [max_tokens] * len(prompts))
    outputs = {uid: [] for uid in uids}
    while responses := generator.next_generated():
        for r in responses:
            if r.finish_reason != "stop":
                outputs[r.uid].append(r.token)
    generator.close()
    return [outputs[uid] for uid in uids]


def redrafter_run(redrafter, prompts, max_tokens, choose, eos, config: Config, profile=None, curve=None) -> Run:
    mx.reset_peak_memory()
    outputs, steps, step_tokens, step_nodes = [[] for _ in prompts], 0, 0, 0
    tic = time.perf_counter()
    for step in generate_steps(
        redrafter,
        prompts,
        max_tokens=max_tokens,
        draft=config.draft,
        choose=choose,
        eos_token_ids=eos,
        profile=profile,
        cost_curve=curve,
    ):
        for out in step:
            outputs[out.row] += out.tokens
            if out.num_accepted is not None:
                steps += 1
                step_tokens += out.num_accepted + 1
                step_nodes += out.num_nodes
    return Run(outputs, time.perf_counter() - tic, steps, step_tokens, step_nodes, mx.get_peak_memory() / 1e9)


def run_benchmark(
    redrafter: ReDrafter,
    prompts: list,
    configs: list,
    *,
    max_tokens: int,
    batch_size: int,
    repeats: int,
    choose: Chooser,
    eos: list,
    progress: Optional[Callable[[str], None]] = None,
    batch_done: Optional[Callable[[int, list], None]] = None,
    curve=None,
) -> list[ConfigResult]:
    """Time every configuration against the baseline on every batch of
    prompts.

    Per batch and repeat, the baseline runs, then each configuration,
    alternating. Extra profiled runs per configuration (on PROFILED_BATCHES
    batches spread over the prompts) split the time into host work,
    drafting, verification and acceptance (their syncs would distort the
    timed runs, so they are not among them). A configuration's runs share
    one acceptance history, as the requests of a running chat or server do.
    ``curve``: the cost curve every run sizes its trees by (None: the
    engine's own, which it may measure again between runs).
    ``progress(what)`` is told after every run (``count_runs`` of them:
    warm-up, profiled, timed); ``batch_done(b, [(config, Run, baseline
    Run)])`` after each timed batch.
    """
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    results = [ConfigResult(c.name) for c in configs]
    tick = progress or (lambda what: None)
    # Each configuration has its own acceptance history (lookup: no drafter).
    used = {
        c.name: ReDrafter(
            redrafter.base,
            redrafter.drafter,
            redrafter.identity,
            redrafter.drafter_identity,
            datastore=redrafter.datastore,
        )
        if c.name != "lookup"
        else ReDrafter(redrafter.base, None, redrafter.identity)
        for c in configs
    }
    # Warm-up: compile kernels and fill allocator caches for every path.
    baseline_run(redrafter, batches[0], 8, choose, eos)
    tick("warm-up")
    for c, r in zip(configs, results):
        redrafter_run(used[c.name], batches[0], 8, choose, eos, c, curve=curve)
        tick("warm-up")
        for batch in profiled_batches(batches):
            redrafter_run(used[c.name], batch, max_tokens, choose, eos, c, profile=r.profile, curve=curve)
            tick("profile")
    for _ in range(repeats):
        for b, batch in enumerate(batches):
            baseline = baseline_run(redrafter, batch, max_tokens, choose, eos)
            tick("timed")
            runs = []
            for c, r in zip(configs, results):
                run = redrafter_run(used[c.name], batch, max_tokens, choose, eos, c, curve=curve)
                runs.append((c.name, run, baseline))
                r.baseline_tps.append(baseline.tokens_per_second)
                r.baseline_runs.setdefault(b, []).append(baseline.tokens_per_second)
                r.redrafter_tps.append(run.tokens_per_second)
                r.speedups.setdefault(b, []).append(run.tokens_per_second / baseline.tokens_per_second)
                counts = r.counts.setdefault(b, [0, 0, 0, 0])
                for i, n in enumerate((run.steps, run.step_tokens, run.step_nodes, sum(len(t) for t in run.tokens))):
                    counts[i] += n
                r.peak_memory_gb = max(r.peak_memory_gb, run.peak_memory_gb)
                r.mismatches += sum(a != b for a, b in zip(run.tokens, baseline.tokens))
                tick("timed")
            if batch_done:
                batch_done(b, runs)
    return results


def profiled_batches(batches: list) -> list:
    return batches[:: -(-len(batches) // PROFILED_BATCHES)]


def count_runs(num_batches: int, num_configs: int, repeats: int) -> int:
    """Runs ``run_benchmark`` makes: one warm-up of plain decoding and of
    each configuration, the profiled ones, and the timed ones."""
    profiled = len(profiled_batches(list(range(num_batches))))
    return 1 + num_configs * (1 + profiled) + repeats * num_batches * (1 + num_configs)


def batch_line(b: int, num_batches: int, runs: list) -> str:
    """One line per timed batch: plain decoding's rate, and each
    configuration's speed-up and tokens per step."""
    _, _, baseline = runs[0]
    parts = [f"plain {baseline.tokens_per_second:.1f} tok/s"]
    for name, run, _ in runs:
        per_step = run.step_tokens / run.steps if run.steps else 0.0
        parts.append(f"{name} {run.tokens_per_second / baseline.tokens_per_second:.2f}x ({per_step:.2f} tok/step)")
    return f"batch {b + 1}/{num_batches}: " + ", ".join(parts)


def default_report_path(now=None) -> str:
    """Where results go when no ``--json`` is given: a dated file in the working folder."""
    import datetime

    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return f"bench-{stamp}.json"


def bench_command(
    redrafter: ReDrafter,
    tokenizer,
    texts: list,
    configs: list,
    choose: Chooser,
    used: dict,
    *,
    ranks: Ranks = ONE_PROCESS,
    refresh: bool = False,
    json_path: Optional[str] = None,
    plot: Optional[str] = None,
    profile: bool = False,
    write=print,
) -> list:
    """``redrafter-mlx bench``: the machine and its cost curve, a progress
    bar over every run, a line per batch, the table, and the results saved
    as JSON (to ``json_path``, else a dated file in the working folder);
    with ``profile``, the milliseconds a step spends in each phase.
    ``used``: the command's settings, recorded with the results."""
    import sys

    from tqdm import tqdm

    from .api import encode_prompt

    writer = ranks.rank == 0
    if redrafter.drafter is None and any(c.name.startswith(("rnn", "both")) for c in configs):
        raise UserError("the rnn and both configurations need a drafter")
    batch_size = used["batch_size"]
    env = dict(environment(redrafter), ranks=ranks.size, split=ranks.split)
    write(
        f"device {env['device']}, BLAS {env['blas']}, dtype {env['dtype']}, mlx {env['mlx']}, mlx-lm {env['mlx_lm']}"
        + (f", {ranks.size} ranks ({ranks.split})" if ranks.several else "")
    )
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    curve = calibration(redrafter, min(batch_size, len(prompts)), refresh=refresh)
    write(format_curve(curve))
    num_batches = -(-len(prompts) // batch_size)
    total = count_runs(num_batches, len(configs), used["repeats"])
    with tqdm(total=total, unit="run", desc="bench", file=sys.stderr, disable=not writer) as bar:
        results = run_benchmark(
            redrafter,
            prompts,
            configs,
            max_tokens=used["max_tokens"],
            batch_size=batch_size,
            repeats=used["repeats"],
            choose=choose,
            eos=list(tokenizer.eos_token_ids),
            curve=curve,
            progress=lambda what: (bar.set_postfix_str(what, refresh=False), bar.update(1)),
            batch_done=lambda b, runs: bar.write(batch_line(b, num_batches, runs), file=sys.stderr) if writer else None,
        )
    write(format_table(results))
    if profile:
        write(format_profile(results))
    mismatched = [r.name for r in results if r.mismatches]
    if mismatched:
        print(f"WARNING: ReDrafter output differs from plain decoding for {', '.join(mismatched)}", file=sys.stderr)
    if writer:
        path = json_path or default_report_path()
        settings = dict(
            used,
            num_prompts=len(prompts),
            drafter_sha256=redrafter.drafter_identity or None,
            model_identity=redrafter.identity,
        )
        try:
            with open(path, "w") as f:
                json.dump(report(results, settings, env, curve), f, indent=2)
        except OSError as e:
            raise UserError(f"cannot write the results to {path}: {e.strerror or e}") from None
        write(f"results saved to {path}")
        if plot:
            plot_speedups(results, plot, f"speed-up, {env['device']} {env['dtype']}, batch {batch_size}")
            write(f"plot saved to {plot}")
    return results


def environment(redrafter: ReDrafter) -> dict:
    import mlx_lm

    return {
        "machine": platform.machine(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "device": "metal" if mx.metal.is_available() else ("gpu" if mx.default_device() == mx.gpu else "cpu"),
        "blas": blas_name(),
        "dtype": str(redrafter.base.dtype).replace("mlx.core.", ""),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
    }


def calibration(redrafter: ReDrafter, batch_size: int, refresh: bool = False):
    """The cost curve the default settings size trees by at this batch size."""
    shape = DraftSettings().search_shape(redrafter.drafter) if redrafter.drafter else None
    return calibrate.cost_curve(redrafter, batch_size, shape, refresh=refresh, step_costs=fixed_costs)


def format_table(results: list[ConfigResult]) -> str:
    header = (
        f"{'config':>12} {'AR tok/s':>9} {'ReDr tok/s':>10} {'speed-up (min-max)':>20} {'tok/step':>8} {'nodes':>6} "
        f"{'overhead':>8} {'peak GB':>8} {'tokens':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        s = r.summary()
        lines.append(
            f"{r.name:>12} {s['baseline_tps']:9.1f} {s['redrafter_tps']:10.1f} "
            f"{s['speedup_median']:8.2f}x ({s['speedup_min']:.2f}-{s['speedup_max']:.2f}) {s['tokens_per_step']:8.2f} "
            f"{s['nodes_per_step']:6.1f} {100 * s['overhead_share']:7.0f}% {s['peak_memory_gb']:8.2f} {'MISMATCH' if r.mismatches else 'same':>8}"
        )
    return "\n".join(lines)


def format_profile(results: list[ConfigResult]) -> str:
    """Milliseconds a step spends in each phase, per configuration (from
    the profiled runs, whose synchronisations the timed runs do not pay)."""
    phases = [p for p in PHASES if p != "prefill"]
    header = f"{'config':>12} " + " ".join(f"{p:>9}" for p in phases) + f" {'total':>9}"
    lines = ["milliseconds per step, by phase (profiled runs):", header, "-" * len(header)]
    for r in results:
        ms = r.profile.per_step()
        lines.append(f"{r.name:>12} " + " ".join(f"{ms[p]:9.2f}" for p in phases) + f" {sum(ms.values()):9.2f}")
    return "\n".join(lines)


def format_curve(curve) -> str:
    """The cost curve as one line per size: seconds and cost relative to one token."""
    lines = ["verification cost: nodes per row -> ms (relative to 1)"]
    for n, seconds, relative in zip(curve.sizes, curve.seconds, curve.relative()):
        lines.append(f"  {n:3d}: {1000 * seconds:8.2f} ms  {relative:5.2f}x")
    if curve.long_seconds:
        long = ", ".join(f"{n}: {1000 * seconds:.2f} ms" for n, seconds in zip(curve.long_sizes, curve.long_seconds))
        lines.append(f"  the same behind {curve.long_context} tokens instead of {curve.context}: {long}")
    lines.append(
        f"  a drafting step besides its pass: {1000 * curve.step_seconds:.2f} ms; a plain token: {1000 * curve.plain:.2f} ms"
    )
    if curve.draft_seconds:
        lines.append(f"  RNN beam search: {1000 * curve.draft_seconds:.2f} ms")
    return "\n".join(lines)


def plot_speedups(results: list[ConfigResult], path: str, title: str) -> None:
    """Median speed-up per configuration, with the min-max range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [r.summary() for r in results]
    medians = [s["speedup_median"] for s in summaries]
    low = [m - s["speedup_min"] for m, s in zip(medians, summaries)]
    high = [s["speedup_max"] - m for m, s in zip(medians, summaries)]
    fig, ax = plt.subplots(figsize=(max(1.1 * len(results) + 2, 5), 4))
    ax.bar(range(len(results)), medians, yerr=[low, high], capsize=4, color="tab:blue")
    ax.axhline(1.0, color="gray", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(results)), [r.name for r in results])
    ax.set_ylabel("speed-up over plain decoding")
    ax.set_title(title, fontsize=9)
    for i, m in enumerate(medians):
        ax.text(i, m, f"{m:.2f}x", ha="center", va="bottom", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: list[ConfigResult], settings: dict, env: dict, curve=None) -> dict:
    out = {"environment": env, "settings": settings, "results": [r.summary() for r in results]}
    if curve is not None:
        out["cost_curve"] = {
            "sizes": curve.sizes,
            "seconds": curve.seconds,
            "draft_seconds": curve.draft_seconds,
            "step_seconds": curve.step_seconds,
            "plain_seconds": curve.plain,
            "context": curve.context,
            "long_context": curve.long_context,
            "long_sizes": curve.long_sizes,
            "long_seconds": curve.long_seconds,
        }
    return out
