"""The machine's cost of verifying N tree nodes: measured once per machine,
model, dtype and batch size, in as many passes as it takes to time each size
three times (by the engine, which knows how to run a pass:
``engine.calibrate``), then cached on disk.

The cost of one forward pass over N new tokens is far from flat on some
machines (a CPU, a quantized model on a GPU) and nearly flat on others, so
the tree's size is chosen from this curve (``budget``), not fixed. Nor is
it flat in the context: a block of several tokens reads every committed key
in each attention layer, which on some machines costs as much as a few more
tokens would. So the passes are measured behind two contexts, and a step's
curve is the one for its context (``CostCurve.at``).
"""

import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from ..blas import blas_name

# Node counts measured; the curve is linear between them.
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# Committed tokens behind the measured passes, and behind the second,
# longer-context measurement of some of the sizes.
CONTEXT = 128
LONG_CONTEXT = 4096  # (or half the model's context, if shorter)
LONG_SIZES = (1, 8, 32)
CONTEXT_STEP = 32  # a step's context is rounded up to this many tokens (one curve per step of it)
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
    ``draft_seconds`` with the RNN); plain decoding ``plain`` a token.

    context: the committed tokens per row behind ``seconds``;
    long_sizes, long_seconds: passes of some sizes behind ``long_context``
    tokens (None: not measured, the curve holds for any context). Far past
    them this line is a guess, which the engine's steps correct
    (``engine.costs``). guessed: this curve's trees, at the context it is
    for, are such a guess: no tree step has run near it."""

    sizes: list
    seconds: list
    draft_seconds: float = 0.0
    step_seconds: float = 0.0
    plain_seconds: Optional[float] = None
    context: int = CONTEXT
    long_context: int = LONG_CONTEXT
    long_sizes: Optional[list] = None
    long_seconds: Optional[list] = None
    guessed: bool = False
    _at: dict = field(default_factory=dict, repr=False, compare=False)  # context -> the curve there

    @property
    def plain(self) -> float:
        """Seconds of one plain token."""
        return self.seconds[0] if self.plain_seconds is None else self.plain_seconds

    def __call__(self, nodes: int) -> float:
        """Seconds for ``nodes`` new tokens per row, interpolated linearly
        (and extrapolated from the last two sizes)."""
        return _interpolate(self.sizes, self.seconds, nodes)

    def at(self, context: int) -> "CostCurve":
        """This curve for passes behind ``context`` committed tokens per row.

        A pass's attention reads every committed key, so each size's
        seconds move along the line through the two measured contexts
        (extrapolated past the longer; never below the shorter's, and more
        nodes never cost less); a plain token moves as a pass of one token
        does. Contexts are rounded up to ``CONTEXT_STEP`` tokens, and each
        one's curve is made once."""
        if not self.long_seconds or context <= self.context:
            return self
        context = -(-context // CONTEXT_STEP) * CONTEXT_STEP
        curve = self._at.get(context)
        if curve is None:
            share = (context - self.context) / (self.long_context - self.context)
            seconds = []
            for n, short in zip(self.sizes, self.seconds):
                moved = short + share * max(_interpolate(self.long_sizes, self.long_seconds, n) - short, 0.0)
                seconds.append(max([moved, *seconds[-1:]]))
            plain = None if self.plain_seconds is None else self.plain_seconds + seconds[0] - self.seconds[0]
            curve = self._at[context] = CostCurve(
                self.sizes, seconds, self.draft_seconds, self.step_seconds, plain, context
            )
        return curve

    def entry(self) -> dict:
        """What the disk cache keeps of a measured curve (the search's
        seconds are kept apart, per drafter and beam shape)."""
        return {
            "sizes": self.sizes,
            "seconds": self.seconds,
            "step_seconds": self.step_seconds,
            "plain_seconds": self.plain_seconds,
            "context": self.context,
            "long_context": self.long_context,
            "long_sizes": self.long_sizes,
            "long_seconds": self.long_seconds,
        }

    @classmethod
    def from_entry(cls, entry: dict) -> "CostCurve":
        """A cached ``entry()``; ``ValueError`` (or ``KeyError``, ``TypeError``) when it is not one."""
        plain = entry.get("plain_seconds")
        curve = cls(
            [int(n) for n in entry["sizes"]],
            [float(t) for t in entry["seconds"]],
            step_seconds=float(entry["step_seconds"]),
            plain_seconds=None if plain is None else float(plain),
            context=int(entry["context"]),
            long_context=int(entry["long_context"]),
            long_sizes=[int(n) for n in entry["long_sizes"]],
            long_seconds=[float(t) for t in entry["long_seconds"]],
        )
        if (
            len(curve.sizes) != len(curve.seconds)
            or len(curve.sizes) < 2
            or len(curve.long_sizes) != len(curve.long_seconds)
            or not curve.long_sizes
            or curve.long_context <= curve.context
        ):
            raise ValueError("sizes and seconds differ")
        return curve

    def relative(self) -> list:
        """Each size's cost over the cost of one token."""
        return [s / self.seconds[0] for s in self.seconds]


def _interpolate(sizes: list, seconds: list, nodes: int) -> float:
    """``seconds`` at ``nodes``, linear between ``sizes`` (and past the last two)."""
    if len(sizes) == 1:
        return seconds[0]
    for i in range(1, len(sizes)):
        if nodes <= sizes[i] or i == len(sizes) - 1:
            a, b = sizes[i - 1], sizes[i]
            return seconds[i - 1] + (seconds[i] - seconds[i - 1]) * (nodes - a) / (b - a)
    return seconds[0]


def machine_key() -> str:
    device = "metal" if mx.metal.is_available() else str(mx.default_device())
    return (
        f"{platform.machine()}|{platform.processor()}|{os.cpu_count()} cpus|{device}|{blas_name()}|mlx {mx.__version__}"
    )


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


def _write_cache(path: Path, entries: dict) -> None:
    """Add ``entries`` to the cache on disk, as it is now: another process
    (a server, a benchmark) may have added its own while this one measured."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data.update(entries)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        print(f"warning: cannot write the cost cache {path} ({e})", file=sys.stderr)


def _entries(data: dict, key: str, draft_key: Optional[str], path: Path) -> tuple:
    """(the curve under ``key``, the search's seconds under ``draft_key``),
    each None when missing or unreadable."""
    entry = data.get(key)
    try:
        # (an entry from before steps, or a longer context, were measured lacks them: measured again)
        curve = CostCurve.from_entry(entry) if isinstance(entry, dict) and "long_seconds" in entry else None
        draft = float(data[draft_key]["draft_seconds"]) if draft_key in data else None
    except (KeyError, TypeError, ValueError) as e:
        print(f"warning: the cost cache {path} has a bad entry ({e}); measuring again", file=sys.stderr)
        return None, None
    return curve, draft


def stored(key: str, draft_key: Optional[str]) -> Optional[CostCurve]:
    """The curve cached under ``key`` with the search's seconds under
    ``draft_key`` (None: no drafter), or None when either is missing."""
    path = cache_path()
    curve, draft = _entries(_read_cache(path), key, draft_key, path)
    if curve is None or (draft_key and draft is None):
        return None
    curve.draft_seconds = draft or 0.0
    return curve


def cached_curve(
    key: str, draft_key: Optional[str], measure: Callable[[tuple, bool], CostCurve], refresh: bool = False
) -> CostCurve:
    """The curve cached under ``key`` (and the beam search's seconds under
    ``draft_key``, None without a drafter), measured with ``measure(sizes,
    steps)`` when missing, unreadable, or ``refresh``; ``measure`` times a
    pass of each size, the beam search when there is one, and with
    ``steps`` what the engine's steps cost besides their passes."""
    path = cache_path()
    data = _read_cache(path)
    curve, draft = (None, None) if refresh else _entries(data, key, draft_key, path)
    if curve is None or (draft_key and draft is None):
        what = "this machine's verification cost" if curve is None else "the drafter's search cost"
        print(f"measuring {what} for this model (once; cached in {path})...", file=sys.stderr, flush=True)
        measured = measure(SIZES if curve is None else (1,), curve is None)
        entries = {}
        if curve is None:
            curve = measured
            entries[key] = curve.entry()
        if draft_key:
            draft = measured.draft_seconds
            entries[draft_key] = {"draft_seconds": draft}
        _write_cache(path, entries)
    curve.draft_seconds = draft or 0.0
    return curve
