"""Cutting generated text at stop strings, also while it streams: text that
could be the start of a stop string is held back until the next piece
shows whether it is one."""

from typing import Optional, Sequence


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins one of ``markers``:
    what must wait for the next piece of text before it can be shown."""
    for n in range(min(len(text), max((len(m) for m in markers), default=1) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class StopStrings:
    """Feed text as it is decoded; ``add`` returns what may be shown now and
    sets ``stopped`` once a stop string appeared (it and everything after it
    are never shown)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False
        self.matched: Optional[str] = None  # the stop string that ended the text

    def add(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        found = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if found:
            at, self.matched = min(found)
            shown, self.pending, self.stopped = self.pending[:at], "", True
            return shown
        hold = held_back(self.pending, self.stops)
        shown, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold :]
        return shown

    def flush(self) -> str:
        """The held-back text, once generation has ended without a stop."""
        shown, self.pending = ("" if self.stopped else self.pending), ""
        return shown
