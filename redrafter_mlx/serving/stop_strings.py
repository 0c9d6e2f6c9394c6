"""Cutting generated text at stop strings, also while it streams: text that
could be the start of a stop string is held back until the next piece
shows whether it is one."""

from typing import Sequence


class StopStrings:
    """Feed text as it is decoded; ``add`` returns what may be shown now and
    sets ``stopped`` once a stop string appeared (it and everything after it
    are never shown)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def add(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            shown, self.pending, self.stopped = self.pending[: min(found)], "", True
            return shown
        hold = self._held()
        shown, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold :]
        return shown

    def _held(self) -> int:
        """Length of the longest end of the pending text that begins a stop string."""
        pending = self.pending
        for n in range(min(len(pending), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(pending[-n:]) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        """The held-back text, once generation has ended without a stop."""
        shown, self.pending = ("" if self.stopped else self.pending), ""
        return shown
