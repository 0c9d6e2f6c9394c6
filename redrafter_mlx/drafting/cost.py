"""The machine's cost of verifying N tree nodes: measured once per machine,
model, dtype and batch size in a few seconds (by the engine, which knows how
to run a pass: ``engine.calibrate``), then cached on disk.

The cost of one forward pass over N new tokens is far from flat on some
machines (a CPU, a quantized model on a GPU) and nearly flat on others, so
the tree's size is chosen from this curve (``budget``), not fixed.
"""

import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from ..blas import blas_name

# Node counts measured; the curve is linear between them.
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CACHE_ENV = "REDRAFTER_MLX_CACHE"


@dataclass
class CostCurve:
    """sizes: node counts per row; seconds: one verification pass of that
    many new tokens per row; draft_seconds: one RNN beam search of the beam
    shape in use (0 without a drafter); step_seconds: what a drafting step
    costs besides its pass and its search (building, packing and choosing
    over the tree, committing the path, the host's bookkeeping);
    plain_seconds: one token of pipelined plain decoding (None: a pass of
    one token). A step of n nodes costs ``curve(n) + step_seconds`` (plus
    ``draft_seconds`` with the RNN); plain decoding ``plain`` a token."""

    sizes: list
    seconds: list
    draft_seconds: float = 0.0
    step_seconds: float = 0.0
    plain_seconds: Optional[float] = None

    @property
    def plain(self) -> float:
        """Seconds of one plain token."""
        return self.seconds[0] if self.plain_seconds is None else self.plain_seconds

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


def cached_curve(key: str, draft_key: Optional[str], measure: Callable[[tuple, bool], CostCurve], refresh: bool = False) -> CostCurve:
    """The curve cached under ``key`` (and the beam search's seconds under
    ``draft_key``, None without a drafter), measured with ``measure(sizes,
    steps)`` when missing, unreadable, or ``refresh``; ``measure`` times a
    pass of each size, the beam search when there is one, and with
    ``steps`` what the engine's steps cost besides their passes."""
    path = cache_path()
    data = _read_cache(path)
    curve = draft = None
    if not refresh:
        try:
            entry = data.get(key)
            # (an entry from before steps were measured lacks their costs: measured again)
            if entry is not None and not entry.get("stale") and "step_seconds" in entry:
                plain = entry.get("plain_seconds")
                curve = CostCurve([int(n) for n in entry["sizes"]], [float(t) for t in entry["seconds"]],
                                  step_seconds=float(entry["step_seconds"]), plain_seconds=None if plain is None else float(plain))
                if len(curve.sizes) != len(curve.seconds) or len(curve.sizes) < 2:
                    raise ValueError("sizes and seconds differ")
            if draft_key in data:
                draft = float(data[draft_key]["draft_seconds"])
        except (KeyError, TypeError, ValueError) as e:
            print(f"warning: the cost cache {path} has a bad entry ({e}); measuring again", file=sys.stderr)
            curve = draft = None
    if curve is None or (draft_key and draft is None):
        what = "this machine's verification cost" if curve is None else "the drafter's search cost"
        print(f"measuring {what} for this model (a few seconds; cached in {path})...", file=sys.stderr, flush=True)
        measured = measure(SIZES if curve is None else (1,), curve is None)
        if curve is None:
            curve = CostCurve(measured.sizes, measured.seconds, step_seconds=measured.step_seconds, plain_seconds=measured.plain_seconds)
            data[key] = {"sizes": curve.sizes, "seconds": curve.seconds, "step_seconds": curve.step_seconds,
                         "plain_seconds": curve.plain_seconds}
        if draft_key:
            draft = measured.draft_seconds
            data[draft_key] = {"draft_seconds": draft}
        _write_cache(path, data)
    curve.draft_seconds = draft or 0.0
    return curve


def mark_stale(key: str) -> None:
    """Mark a cached curve as no longer true: its next use measures it again."""
    path = cache_path()
    data = _read_cache(path)
    if isinstance(data.get(key), dict):
        data[key]["stale"] = True
        _write_cache(path, data)
