"""What a step costs on this machine, as the measured curve says and as the
steps themselves show it.

A cost curve (``drafting.cost.CostCurve``) is measured once per machine,
model, dtype and batch size, behind two short contexts (``calibrate``), and
kept on disk. Real steps then show what they cost where they run. A pass's
attention reads every committed key, so far past the measured contexts the
curve's line through them is a guess, and a machine that got busier, or a
batch size never measured, make the curve wrong too. So each step's
seconds, over what the measured curve gives it, are kept as a running ratio
per context (buckets that double from 256 tokens) and per kind of step (a
pipelined plain token, and steps of up to 1, 2, 4, 8, 16 and more nodes per
row), and a step is sized by the measured curve scaled by those ratios at
its context. Nothing stops to measure again: a longer context, a busier
machine and a wrong curve are all corrected by the steps that meet them.

What the steps taught is kept for the process (``LEARNED``), for every
decoder of the same model and batch size. A model split over ranks learns
nothing: every rank must size its trees alike, and the ranks' clocks differ.
"""

import math
import time
from bisect import bisect_left
from typing import Optional

from ..drafting.cost import CONTEXT_STEP, CostCurve
from . import calibrate
from .calibrate import StepCostMeter
from .types import ReDrafter

NODE_BUCKETS = (1, 2, 4, 8, 16)  # a step of n nodes per row is kept with the first bucket >= n, or after the last
PLAIN = -1  # the kind of a pipelined plain token
CONTEXT_BUCKET = 256  # contexts up to this share a bucket; each bucket after it doubles
MEMORY = 0.7  # weight of the past in a running ratio
CLIP = (0.1, 10.0)  # a step's ratio is taken within these bounds (a pause of the process is not the machine)
REACH = 1.5  # one step's ratio counts at most this factor away from the running ratio
MEASURED_BATCH = 1  # the batch size measured when a decoder starts; others start from it
SHORT_GAP = 0.25  # a pipelined plain token is timed when the caller's work between two steps was under this share of it


def node_kind(nodes: int) -> int:
    """The kind of a step that verified ``nodes`` nodes per row (1: a plain
    step that waited for its own pass)."""
    return bisect_left(NODE_BUCKETS, nodes)


def context_bucket(context: int) -> int:
    return max(0, math.ceil(math.log2(max(context, 1) / CONTEXT_BUCKET)))


class Learned:
    """Running ratios of real seconds over the measured curve's, by
    (context bucket, kind); a ratio not seen yet is its context's nearest
    kind's (the larger on a tie), else the nearest shorter context's, else 1."""

    def __init__(self):
        self.ratios: dict = {}  # (context bucket, kind) -> running log-ratio
        self.version = 0  # bumped on every change: curves made from older ratios are made again

    def add(self, context: int, kind: int, ratio: float) -> None:
        """One step's seconds over the curve's. A step unlike the ones before
        it (a pipelined token whose pass ran while the step before it waited,
        a step that met another process's burst) moves the running ratio by
        a bounded factor: steps that keep showing a new cost still reach it
        within a few steps, and one odd step cannot halve a price."""
        key = (context_bucket(context), kind)
        value = math.log(min(max(ratio, CLIP[0]), CLIP[1]))
        past = self.ratios.get(key)
        if past is not None:
            reach = math.log(REACH)
            value = MEMORY * past + (1 - MEMORY) * min(max(value, past - reach), past + reach)
        self.ratios[key] = value
        self.version += 1

    def seen_trees(self, context: int) -> bool:
        """Whether a step of more than one node ran in this context's bucket."""
        bucket = context_bucket(context)
        return any(b == bucket and k > node_kind(1) for b, k in self.ratios)

    def ratio(self, context: int, kind: int) -> float:
        bucket = context_bucket(context)
        for c in range(bucket, -1, -1):
            seen = {k: v for (b, k), v in self.ratios.items() if b == c}
            if seen:
                nearest = min(seen, key=lambda k: (abs(k - kind), -seen[k]))
                return math.exp(seen[nearest])
        return 1.0


LEARNED: dict = {}  # cost key (machine, model, dtype, batch size) -> Learned, for this process


def learning(redrafter: ReDrafter) -> bool:
    """Whether steps teach this model's curves (not in a split: each rank's
    clock is its own, and every rank must size its trees alike)."""
    return not redrafter.base.ranks.several


class StepCosts:
    """The cost curves one decoder sizes its steps by, and what its steps
    teach them.

    ``curve(batch_size, context)`` is the curve of the smallest of
    ``batch_sizes`` at least ``batch_size`` (else the largest): the measured
    one (batch 1 is measured when missing; another batch size is measured
    only if asked, ``measure``, else it starts from batch 1's as one row of
    that many times the nodes), at the context, scaled by what steps have
    shown. ``observe`` tells it a tree step's seconds, ``plain_step`` a
    plain step's, ``step_returned`` when a step returned to the caller.
    ``fixed``: one curve used as it is, for every batch size and context
    (tests that must not depend on the machine); None with ``sized`` False
    (a fixed node count: no curve is used). ``step_costs``: measures what
    the engine's steps cost besides their passes when a curve is
    measured."""

    def __init__(
        self,
        redrafter: ReDrafter,
        batch_sizes=(1,),
        beam_shape: Optional[tuple] = None,
        fixed: Optional[CostCurve] = None,
        sized: bool = True,
        step_costs: Optional[StepCostMeter] = None,
    ):
        self.redrafter, self.beam_shape, self.fixed, self.sized = redrafter, beam_shape, fixed, sized
        self.batch_sizes = sorted(batch_sizes)
        self.step_costs = step_costs
        self.measured: dict = {}  # batch size -> its measured (or derived) curve
        self.made: dict = {}  # (batch size, context step) -> (learned version, the curve there)
        self.keys: dict = {}  # batch size -> its cost key (read from the process's state: made once a size)
        self.learns = fixed is None and sized and learning(redrafter)
        self.plain_since: Optional[tuple] = (
            None  # (when, batch size) the last plain step that issued the next pass read its token
        )
        self.returned = 0.0  # when the last step returned to the caller

    def size(self, batch_size: int) -> int:
        """The batch size whose curve a batch of this many rows uses."""
        return next((b for b in self.batch_sizes if b >= batch_size), self.batch_sizes[-1])

    def measure(self, batch_size: int) -> None:
        """Measure (or read from disk) the curve of this batch size now, not
        at a step (announced on stderr when it is measured)."""
        if self.fixed is None and self.sized:
            size = self.size(batch_size)
            self.measured[size] = calibrate.cost_curve(
                self.redrafter, size, self.beam_shape, step_costs=self.step_costs
            )

    def _base(self, size: int) -> CostCurve:
        if size not in self.measured:
            if size == MEASURED_BATCH or self.redrafter.base.ranks.several:
                self.measure(size)
            else:
                if MEASURED_BATCH not in self.measured:
                    self.measured[MEASURED_BATCH] = calibrate.cost_curve(
                        self.redrafter, MEASURED_BATCH, self.beam_shape, step_costs=self.step_costs
                    )
                self.measured[size] = calibrate.stored_curve(self.redrafter, size, self.beam_shape) or widened(
                    self.measured[MEASURED_BATCH], size
                )
        return self.measured[size]

    def learned(self, size: int) -> Learned:
        key = self.keys.get(size)
        if key is None:
            key = self.keys[size] = calibrate.curve_key(self.redrafter, size)
        return LEARNED.setdefault(key, Learned())

    def curve(self, batch_size: int, context: int) -> Optional[CostCurve]:
        """The curve a step of ``batch_size`` rows after ``context``
        committed tokens is sized by (None when no curve sizes steps)."""
        if not self.sized:
            return None
        if self.fixed is not None:
            return self.fixed.at(context)
        size = self.size(batch_size)
        base = self._base(size).at(context)
        if not self.learns:
            return base
        learned = self.learned(size)
        key = (size, -(-context // CONTEXT_STEP))
        made = self.made.get(key)
        if made is None or made[0] != learned.version:
            curve = corrected(base, learned, context)
            curve.guessed = context > self._base(size).long_context and not learned.seen_trees(context)
            made = self.made[key] = (learned.version, curve)
        return made[1]

    def observe(self, batch_size: int, context: int, nodes: int, seconds: float, searched: bool = False) -> None:
        """A step of ``nodes`` nodes per row (1: a plain step that waited for
        its pass) after ``context`` tokens took ``seconds``, its search
        included when it ran one."""
        if not self.learns:
            return
        size = self.size(batch_size)
        base = self._base(size).at(context)
        spent = seconds - (base.draft_seconds if searched else 0.0)
        self.learned(size).add(context, node_kind(nodes), spent / (base(nodes) + base.step_seconds))

    def plain_step(
        self, batch_size: int, context: int, tic: float, seconds: float, searched: bool, consumed: bool, ahead: bool
    ) -> None:
        """A plain step that began at ``tic`` read its token ``seconds``
        later (now). consumed: its pass was issued by the step before;
        ahead: it issued the next step's. A pipelined step's wall time is
        not its pass's: a step that waits for its own pass (neither) is
        timed as a step, and pipelined ones from one token read to the
        next, when the caller's work between the two steps was short beside
        the pass."""
        read = time.perf_counter()
        if not consumed and not ahead:
            self.observe(batch_size, context, 1, seconds, searched)
        elif consumed and self.plain_since is not None:
            since, rows = self.plain_since
            if rows == batch_size and tic - self.returned < SHORT_GAP * (read - since):
                self.observe_plain(batch_size, context, read - since)
        self.plain_since = (read, batch_size) if ahead else None

    def step_returned(self) -> None:
        """A step returns to the caller now (the caller's work until the
        next step is no pass's)."""
        self.returned = time.perf_counter()

    def observe_plain(self, batch_size: int, context: int, seconds: float) -> None:
        """A pipelined plain token took ``seconds`` (from one token to the next)."""
        if self.learns:
            size = self.size(batch_size)
            self.learned(size).add(context, PLAIN, seconds / self._base(size).at(context).plain)


def corrected(curve: CostCurve, learned: Learned, context: int) -> CostCurve:
    """``curve`` (at ``context``) with each size's pass and fixed cost, and
    the plain token, scaled by what the steps showed there; the search as
    a step of two nodes is (a small piece of work, slowed as such work is).
    A step faster than the curve's (a ratio below 1) is taken as its pass
    and its fixed cost both faster, so a pass never comes out free."""
    step = curve.step_seconds
    seconds = [
        max(r * (s + step) - step, r * s)
        for r, s in ((learned.ratio(context, node_kind(n)), s) for n, s in zip(curve.sizes, curve.seconds))
    ]
    seconds = [max(seconds[: i + 1]) for i in range(len(seconds))]  # more nodes never cost less
    plain = learned.ratio(context, PLAIN) * curve.plain
    draft = learned.ratio(context, node_kind(2)) * curve.draft_seconds
    return CostCurve(curve.sizes, seconds, draft, step, plain, curve.context)


def widened(curve: CostCurve, batch_size: int) -> CostCurve:
    """A first guess at the curve of ``batch_size`` rows from one row's: a
    pass of n nodes per row as one row's pass of ``batch_size * n`` nodes,
    the search as many times one row's (the steps correct both)."""
    seconds = [curve(batch_size * n) for n in curve.sizes]
    long_seconds = (
        [_interpolated(curve.long_sizes, curve.long_seconds, batch_size * n) for n in curve.long_sizes]
        if curve.long_seconds
        else None
    )
    plain = None if curve.plain_seconds is None else curve.plain_seconds * curve(batch_size) / curve(1)
    return CostCurve(
        curve.sizes,
        seconds,
        curve.draft_seconds * batch_size,
        curve.step_seconds,
        plain,
        curve.context,
        curve.long_context,
        curve.long_sizes,
        long_seconds,
    )


def _interpolated(sizes: list, seconds: list, n: int) -> float:
    return CostCurve(sizes, seconds)(n)
