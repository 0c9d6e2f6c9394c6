"""Measuring the machine's cost curve: the engine runs verification passes of
each size behind two contexts (and one beam search) and times them, then
decodes a few tokens plainly and a few drafting steps to time what a step
costs besides its pass; ``drafting.cost`` keeps the result on disk, keyed
by machine, model, dtype, batch size and beam shape."""

import statistics
import sys
import time
from typing import Callable, Optional, Protocol

import mlx.core as mx
import numpy as np

from ..drafting.beam_search import beam_search
from ..drafting.cost import CONTEXT, LONG_CONTEXT, LONG_SIZES, SIZES, CostCurve, cached_curve, machine_key, stored
from .prefill import prefill
from .recurrent import RecurrentCache
from .types import ReDrafter


class StepCostMeter(Protocol):
    """Measures what the engine's own steps cost besides their passes, by
    running them (``decoder.fixed_costs``): given a prefilled ``curve``'s
    ``prompts`` and ``pass_seconds(n)``, which times one tree pass of ``n``
    tokens there and then (so that each step can be held against a pass
    timed beside it), returns (seconds a drafting step costs besides its
    pass, seconds of one pipelined plain token)."""

    def __call__(
        self, redrafter: ReDrafter, prompts: list, curve: CostCurve, pass_seconds: Callable[[int], float]
    ) -> tuple[float, float]: ...


def _timed(runs: list, repeats: int) -> list[float]:
    """Median seconds of each of ``runs``, after one warm-up each (kernels,
    allocator), timed in turn ``repeats`` times: a burst of other load on a
    shared machine then slows every size alike instead of bending the curve."""
    for run in runs:
        run()
    times = [[] for _ in runs]
    for _ in range(repeats):
        for run, spent in zip(runs, times):
            tic = time.perf_counter()
            run()
            spent.append(time.perf_counter() - tic)
    return [statistics.median(t) for t in times]


def measure(
    redrafter,
    batch_size: int,
    beam_shape: Optional[tuple] = None,
    repeats: int = 3,
    sizes=SIZES,
    tree: bool = True,
    step_costs: Optional[StepCostMeter] = None,
) -> CostCurve:
    """Time tree passes of every size in ``sizes`` (a chain tree: per-token
    positions and a tree mask, as verification runs; with ``tree`` False, a
    plain causal chunk of as many tokens instead) after CONTEXT committed
    tokens, and of ``LONG_SIZES`` after LONG_CONTEXT (or half the model's
    context when that is shorter), and one beam search
    of ``beam_shape`` (``beam_search``'s beam_width, beam_length and
    later_rows) when there is a drafter; all of them in turn, ``repeats``
    times. With ``step_costs`` (a ``StepCostMeter``), also what the
    engine's own steps cost besides their passes."""

    base = redrafter.base
    # Rows of different tokens, so that a mixture of experts reads as many
    # experts as real rows do.
    prompts = [[(17 * i + 3 + 101 * b) % base.vocab_size for i in range(CONTEXT)] for b in range(batch_size)]
    layout, cache, hidden, logits = prefill(base, prompts)
    mx.eval(hidden, logits)  # for a model split over ranks, the prefill's last hops

    def tree_pass(n, layout=layout, cache=cache):
        tokens = mx.array([p[:n] for p in prompts], mx.int32)
        depths = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (batch_size, n))
        mask = mx.broadcast_to(mx.tril(mx.ones((n, n), mx.bool_)), (batch_size, n, n))
        # A model with recurrent layers also pays for setting their state to
        # the accepted prefix: here half the chain, its typical share.
        path = np.broadcast_to(np.arange(n), (batch_size, n))
        accepted = np.full(batch_size, (n - 1) // 2)

        def run():
            if tree:
                layout.begin_tree(depths, mask)
            else:
                layout.begin_chunk()
            outputs = base(tokens, cache)
            if tree and base.recurrent:
                for c in cache:
                    c.commit_path(path, accepted)
            mx.eval(outputs, [c.state_arrays() for c in cache])

        return run

    long_sizes = [n for n in LONG_SIZES if n in sizes] if len(sizes) > 1 else []
    stretch = max(min(LONG_CONTEXT, (base.max_context or LONG_CONTEXT * 2) // 2) // CONTEXT, 2)
    long_layout, long_cache = _stretched(base, layout, cache, stretch) if long_sizes else (None, None)
    runs = [tree_pass(n) for n in sizes] + [tree_pass(n, long_layout, long_cache) for n in long_sizes]
    if redrafter.drafter is not None and beam_shape:
        first = mx.zeros((batch_size,), mx.int32)
        runs.append(lambda: mx.eval(beam_search(redrafter.drafter, base.embed, hidden, first, *beam_shape)))
    times = _timed(runs, repeats)
    times = base.ranks.first(times).tolist()  # every rank sizes its trees by the same curve
    seconds, long_seconds = times[: len(sizes)], times[len(sizes) : len(sizes) + len(long_sizes)]
    seconds = [max(seconds[: i + 1]) for i in range(len(seconds))]  # more nodes never cost less
    long_seconds = [max(long_seconds[: i + 1]) for i in range(len(long_seconds))]
    draft = times[len(sizes) + len(long_sizes)] if len(times) > len(sizes) + len(long_sizes) else 0.0
    curve = CostCurve(
        list(sizes),
        seconds,
        draft,
        context=CONTEXT,
        long_context=stretch * CONTEXT,
        long_sizes=long_sizes or None,
        long_seconds=long_seconds or None,
    )
    if step_costs is not None:
        passes = {}

        def pass_seconds(n: int) -> float:
            run = passes[n] = passes.get(n) or tree_pass(n)
            tic = time.perf_counter()
            run()
            return time.perf_counter() - tic

        costs = step_costs(redrafter, prompts, curve, pass_seconds)
        curve.step_seconds, curve.plain_seconds = (float(t) for t in base.ranks.first(costs))
    return curve


def _stretched(base, layout, cache: list, times: int) -> tuple:
    """A copy of a prefilled cache (rows of one length, no padding) whose
    rows hold their committed tokens ``times`` over: what a pass behind a
    context that long reads, without the prefill it would take (a pass's
    time does not depend on what the keys hold). Recurrent states are
    the same whatever the context's length."""
    long_layout, long_cache = base.make_cache([0] * layout.batch_size)
    length = layout.start
    for short, long in zip(cache, long_cache):
        if isinstance(short, RecurrentCache):
            long.cache = list(short.cache)
        elif short.keys is not None:  # (a layer another rank runs keeps nothing)
            long.keys = mx.concatenate([short.keys[..., :length, :]] * times, axis=2)
            long.values = mx.concatenate([short.values[..., :length, :]] * times, axis=2)
    long_layout.lengths[:] = length * times
    return long_layout, long_cache


# Bumped whenever the engine's verification pass changes what it costs, so
# that curves cached by an earlier engine are measured again.
PASS_REVISION = 4


def curve_key(redrafter: ReDrafter, batch_size: int) -> str:
    return f"{machine_key()}|pass {PASS_REVISION}|model {redrafter.identity}|{redrafter.base.dtype}|batch {batch_size}"


def _draft_key(redrafter: ReDrafter, key: str, beam_shape: Optional[tuple]) -> Optional[str]:
    if beam_shape and redrafter.drafter is not None:
        return f"{key}|drafter {redrafter.drafter_identity}|beams {'x'.join(map(str, beam_shape))}"
    return None


def stored_curve(redrafter: ReDrafter, batch_size: int, beam_shape: Optional[tuple] = None) -> Optional[CostCurve]:
    """The curve on disk for this batch size (with the search's cost, when
    a drafter searches), or None: nothing is measured."""
    key = curve_key(redrafter, batch_size)
    return stored(key, _draft_key(redrafter, key, beam_shape))


def cost_curve(
    redrafter: ReDrafter,
    batch_size: int,
    beam_shape: Optional[tuple] = None,
    refresh: bool = False,
    step_costs: Optional[StepCostMeter] = None,
) -> CostCurve:
    """The cached curve for this machine, model, dtype and batch size, with
    the beam search's cost for ``beam_shape`` and this drafter, and the
    steps' own costs (``step_costs``, see ``measure``); measured when
    missing (or unreadable) and whenever ``refresh``."""
    if redrafter.base.ranks.several:
        # Split over ranks: hops included, measured on every start, the same on every rank.
        if redrafter.base.ranks.rank == 0:
            print(
                "measuring the split model's verification cost, hops included (at every start)...",
                file=sys.stderr,
                flush=True,
            )
        return measure(redrafter, batch_size, beam_shape, step_costs=step_costs)
    key = curve_key(redrafter, batch_size)
    draft_key = _draft_key(redrafter, key, beam_shape)
    return cached_curve(
        key,
        draft_key,
        lambda sizes, steps: measure(
            redrafter, batch_size, beam_shape, sizes=sizes, step_costs=step_costs if steps else None
        ),
        refresh,
    )
