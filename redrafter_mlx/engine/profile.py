"""Where a step's time goes, for benchmarks.

A running step evaluates once (``Decoder.step``); its phases run lazily in
one graph, so their times cannot be read off it. A ``StepProfile`` given to
the ``Decoder`` evaluates at the end of each phase instead and adds the
seconds since the last one to that phase. The extra synchronisations cost
time of their own, so profiled runs are never the timed ones. A decoder
without one holds ``NO_PROFILE``, whose laps do nothing (and evaluate
nothing), so a step reads the same either way.
"""

import time
from dataclasses import dataclass, field
from typing import ClassVar

import mlx.core as mx

PHASES = ("prefill", "host", "packing", "pass", "choice", "drafting", "commit")


@dataclass
class StepProfile:
    """Seconds per phase, summed over the steps profiled:
    prefill: prompts fed and first tokens chosen; host: the plan (lookup,
    the datastore, tree building and pruning) and the bookkeeping after the
    step (what was accepted, the rows' tokens); packing: the trees as
    device arrays, with their masks; pass: the base model's pass over the
    tree (a plain step's pass, with its token choice); choice: token choice
    at every node and the acceptance walk; drafting: the RNN's beam search
    for the next step; commit: the accepted path's keys and values moved
    into place."""

    seconds: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: int = 0
    last: float = field(default_factory=time.perf_counter)

    # The steps synchronise at every phase: they read the beams they search
    # at once, and no plain step runs its pass ahead of the last token.
    enabled: ClassVar[bool] = True

    def lap(self, phase: str, *arrays) -> None:
        """Evaluate ``arrays`` and charge the time since the last lap to ``phase``."""
        mx.eval(*arrays)
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now

    def restart(self) -> None:
        """Start the next lap now (time between runs counts nowhere)."""
        self.last = time.perf_counter()

    def count_step(self) -> None:
        """A step ended (``per_step`` divides by the steps counted)."""
        self.steps += 1

    def per_step(self) -> dict:
        """Milliseconds a step per phase (the prefill left out)."""
        return {
            phase: 1000 * t / self.steps if self.steps else 0.0
            for phase, t in self.seconds.items()
            if phase != "prefill"
        }


class NoProfile:
    """A step not profiled: its laps evaluate nothing and time nothing, so
    the step keeps its one synchronisation; ``enabled`` False lets a plain
    step issue its next pass ahead."""

    enabled: ClassVar[bool] = False

    def lap(self, phase: str, *arrays) -> None:
        pass

    def restart(self) -> None:
        pass

    def count_step(self) -> None:
        pass


NO_PROFILE = NoProfile()
