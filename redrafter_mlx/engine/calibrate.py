"""Measuring the machine's cost curve: the engine runs verification passes of
each size (and one beam search) and times them; ``drafting.cost`` keeps the
result on disk, keyed by machine, model, dtype, batch size and beam shape."""

import statistics
import time
from typing import Optional

import mlx.core as mx

from ..drafting.beam_search import beam_search
from ..drafting.cost import SIZES, CostCurve, cached_curve, machine_key
from .prefill import prefill
from .types import ReDrafter

CONTEXT = 128  # committed tokens behind the measured passes


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


def measure(redrafter, batch_size: int, beam_shape: Optional[tuple] = None, repeats: int = 5, sizes=SIZES, tree: bool = True) -> CostCurve:
    """Time tree passes of every size in ``sizes`` (a chain tree: per-token
    positions and a tree mask, as verification runs; with ``tree`` False, a
    plain causal chunk of as many tokens instead) after CONTEXT committed
    tokens, and one beam search of ``beam_shape`` (``beam_search``'s
    beam_width, beam_length and later_rows) when there is a drafter; all of
    them in turn, ``repeats`` times."""

    base = redrafter.base
    prompt = [(17 * i + 3) % base.vocab_size for i in range(CONTEXT)]
    layout, cache, hidden, _ = prefill(base, [prompt] * batch_size)

    def tree_pass(n):
        tokens = mx.array([prompt[:n]] * batch_size, mx.int32)
        depths = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (batch_size, n))
        mask = mx.broadcast_to(mx.tril(mx.ones((n, n), mx.bool_)), (batch_size, n, n))

        def run():
            if tree:
                layout.begin_tree(depths, mask)
            else:
                layout.begin_chunk()
            mx.eval(base(tokens, cache))

        return run

    runs = [tree_pass(n) for n in sizes]
    if redrafter.drafter is not None and beam_shape:
        first = mx.zeros((batch_size,), mx.int32)
        runs.append(lambda: mx.eval(beam_search(redrafter.drafter, base.embed, hidden, first, *beam_shape)))
    times = _timed(runs, repeats)
    seconds = times[: len(sizes)]
    seconds = [max(seconds[: i + 1]) for i in range(len(seconds))]  # more nodes never cost less
    return CostCurve(list(sizes), seconds, times[len(sizes)] if len(times) > len(sizes) else 0.0)


def cost_curve(redrafter: ReDrafter, batch_size: int, beam_shape: Optional[tuple] = None, refresh: bool = False) -> CostCurve:
    """The cached curve for this machine, model, dtype and batch size, with
    the beam search's cost for ``beam_shape`` and this drafter; measured
    when missing (or unreadable) and whenever ``refresh``."""
    key = f"{machine_key()}|model {redrafter.identity}|{redrafter.base.dtype}|batch {batch_size}"
    draft_key = None
    if beam_shape and redrafter.drafter is not None:
        draft_key = f"{key}|drafter {redrafter.drafter_identity}|beams {'x'.join(map(str, beam_shape))}"
    return cached_curve(key, draft_key, lambda sizes: measure(redrafter, batch_size, beam_shape, sizes=sizes), refresh)
