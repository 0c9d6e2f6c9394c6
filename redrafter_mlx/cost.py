"""The machine's cost of verifying N tree nodes: measured once per machine,
model, dtype and batch size in a few seconds, then cached on disk.

The cost of one forward pass over N new tokens is far from flat on some
machines (a CPU, a quantized model on a GPU) and nearly flat on others, so
the tree's size is chosen from this curve (``budget``), not fixed.
"""

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx

from .blas import blas_name

# Node counts measured; the curve is linear between them.
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CONTEXT = 128  # committed tokens behind the measured passes
CACHE_ENV = "REDRAFTER_MLX_CACHE"


@dataclass
class CostCurve:
    """sizes: node counts per row; seconds: one verification pass of that
    many new tokens per row; draft_seconds: one RNN beam search of the beam
    shape in use (0 without a drafter)."""

    sizes: list
    seconds: list
    draft_seconds: float = 0.0

    def __call__(self, nodes: int) -> float:
        """Seconds for ``nodes`` new tokens per row, interpolated linearly
        (and extrapolated from the last two sizes)."""
        sizes, seconds = self.sizes, self.seconds
        for i in range(1, len(sizes)):
            if nodes <= sizes[i] or i == len(sizes) - 1:
                a, b = sizes[i - 1], sizes[i]
                return seconds[i - 1] + (seconds[i] - seconds[i - 1]) * (nodes - a) / (b - a)
        return seconds[0]

    def relative(self) -> list:
        """Each size's cost over the cost of one token."""
        return [s / self.seconds[0] for s in self.seconds]


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
    from .beam_search import beam_search
    from .generate import prefill

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


def machine_key() -> str:
    device = "metal" if mx.metal.is_available() else str(mx.default_device())
    return f"{platform.machine()}|{platform.processor()}|{os.cpu_count()} cpus|{device}|{blas_name()}|mlx {mx.__version__}"


def cache_path() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "redrafter-mlx"
    return Path(root) / "cost.json"


def _read_cache(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not an object")
        return data
    except (OSError, ValueError) as e:
        print(f"warning: the cost cache {path} is unreadable ({e}); measuring again", file=sys.stderr)
        return {}


def _write_cache(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        print(f"warning: cannot write the cost cache {path} ({e})", file=sys.stderr)


def cost_curve(redrafter, batch_size: int, beam_shape: Optional[tuple] = None, refresh: bool = False) -> CostCurve:
    """The cached curve for this machine, model, dtype and batch size, with
    the beam search's cost for ``beam_shape`` and this drafter; measured
    when missing (or unreadable) and whenever ``refresh``."""
    base = redrafter.base
    key = f"{machine_key()}|model {redrafter.identity}|{base.dtype}|batch {batch_size}"
    draft_key = None
    if beam_shape and redrafter.drafter is not None:
        draft_key = f"{key}|drafter {redrafter.drafter_identity}|beams {'x'.join(map(str, beam_shape))}"
    path = cache_path()
    data = _read_cache(path)
    curve = draft = None
    if not refresh:
        try:
            if key in data:
                curve = CostCurve([int(n) for n in data[key]["sizes"]], [float(t) for t in data[key]["seconds"]])
                if len(curve.sizes) != len(curve.seconds) or len(curve.sizes) < 2:
                    raise ValueError("sizes and seconds differ")
            if draft_key in data:
                draft = float(data[draft_key]["draft_seconds"])
        except (KeyError, TypeError, ValueError) as e:
            print(f"warning: the cost cache {path} has a bad entry ({e}); measuring again", file=sys.stderr)
            curve = draft = None
    if curve is None or (draft_key and draft is None):
        measured = measure(redrafter, batch_size, beam_shape, sizes=SIZES if curve is None else (1,))
        if curve is None:
            curve = CostCurve(measured.sizes, measured.seconds)
            data[key] = {"sizes": curve.sizes, "seconds": curve.seconds}
        if draft_key:
            draft = measured.draft_seconds
            data[draft_key] = {"draft_seconds": draft}
        _write_cache(path, data)
    curve.draft_seconds = draft or 0.0
    return curve
