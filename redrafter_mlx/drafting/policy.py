"""The running parts of the drafting policy (``speculator.Speculator``):
whether the RNN drafts (``RnnSwitch``), when a run that does not gain decodes
plainly instead (``Backoff``), and how deep the RNN's search drafts
(``SearchDepth``). Each holds its own state and the methods that change it;
the speculator calls them only while it plans a step or observes one.

None of them reads a clock: they count tokens and curve seconds, so every
rank of a split model decides alike.
"""

from collections import deque
from typing import Optional

RNN_RETRY_STEPS = 16  # with the RNN turned off, run it again every this many steps
RATE_MEMORY = 0.8  # weight of the past in the running estimate of lookup alone
MEASURED_MEMORY = 0.7  # weight of the past in the running measured tokens and seconds
WINDOW = 32  # drafting steps whose rate is held against plain decoding's
RETRY_WINDOW = 8  # drafting steps after which a retry is judged
IDLE_STEPS = 3  # steps in a row that verified nothing before a run turns plain (one on a retry)
PLAIN_STEPS = 16  # plain steps before drafting is tried again, at first
MAX_PLAIN_STEPS = 4096  # the longest interval the doubling reaches
RESHAPE_STEPS = 16  # every this many searches, one of the whole beam length
KEPT_SHARE = 0.5  # a depth is searched while this share of full searches' trees kept an RNN node there


class RnnSwitch:
    """Whether the RNN's beams join the step's drafts.

    The RNN is turned off while the steps without its beams produce more
    tokens per curve second (tokens really produced, not estimated), and
    tried again every ``RNN_RETRY_STEPS`` drafting steps. Before any step
    ran without it, the rate without it is estimated from the cheap drafts
    of the steps that ran with it (the RNN runs first, so it is always
    measured first).

    present: the run has a drafter; usable: and its search can pay on the
    curve (``judge``); on: drafting steps search; steps_off: drafting steps
    planned while it was off; measured: per mode (``rnn``, ``lookup``) the
    running (tokens, curve seconds) of its steps; lookup_estimate: the
    running estimated tokens per curve second without the RNN."""

    def __init__(self, present: bool):
        self.present = self.usable = self.on = present
        self.steps_off = 0
        self.measured: dict = {"rnn": None, "lookup": None}
        self.lookup_estimate: Optional[float] = None

    def judge(self, pays: bool) -> None:
        """Whether the search can pay at all on the curve (once per curve)."""
        self.usable = self.present and pays
        if not self.usable:
            self.on = False

    def wanted(self) -> bool:
        """Whether the next drafting step searches: the RNN is on, or off
        and due a retry."""
        return self.usable and (self.on or (self.steps_off + 1) % RNN_RETRY_STEPS == 0)

    def drafted(self, lookup_rate: Optional[float], without_rnn: bool) -> None:
        """A drafting step was planned. lookup_rate: the tokens per curve
        second its cheap drafts alone were estimated to bring (None: not
        judged); without_rnn: its beams were dropped as not worth their
        search, and the RNN stays off until its next retry."""
        if self.usable and not self.on:
            self.steps_off += 1
        if lookup_rate is not None:
            past = self.lookup_estimate
            self.lookup_estimate = lookup_rate if past is None else RATE_MEMORY * past + (1 - RATE_MEMORY) * lookup_rate
        if without_rnn:
            self.on = False

    def retry(self) -> None:
        """Drafting starts again (after a rest of plain steps, or for a new
        prompt): the RNN drafts with it, judged afresh by the steps that
        follow. A run that turned the RNN off and then rested would
        otherwise retry with the cheap drafts alone, which may be the very
        drafts that were not accepted, and never search again: its retries
        are counted in drafting steps, which a resting run does not plan."""
        if self.usable:
            self.on, self.steps_off = True, 0
            self.measured["rnn"] = None

    def rate(self, mode: str) -> Optional[float]:
        """Tokens per curve second of the steps verified with (``"rnn"``) or
        without (``"lookup"``) the RNN's beams: measured once such steps
        ran, else (without the RNN) estimated."""
        if self.measured[mode] is not None:
            tokens, seconds = self.measured[mode]
            return tokens / seconds
        return self.lookup_estimate if mode == "lookup" else None

    def observe(self, mode: str, tokens: float, seconds: float, cheap_drafts: bool) -> None:
        """A drafting step of ``mode`` produced ``tokens`` in ``seconds``
        curve seconds. With cheap drafts to fall back on, the RNN stays on
        while its steps' rate is at least theirs."""
        past, m = self.measured[mode], MEASURED_MEMORY
        self.measured[mode] = (
            (tokens, seconds) if past is None else (m * past[0] + (1 - m) * tokens, m * past[1] + (1 - m) * seconds)
        )
        if self.usable and cheap_drafts and None not in (self.rate("rnn"), self.rate("lookup")):
            self.on = self.rate("rnn") >= self.rate("lookup")


class Backoff:
    """When a run that does not gain decodes plainly, and when it drafts
    again.

    A run turns plain when the budget verified nothing for ``IDLE_STEPS``
    steps in a row, or when the last ``WINDOW`` drafting steps produced
    fewer tokens per curve second than plain steps would. The window is
    long because a step's accepted length varies widely: a run that gains
    on average still has stretches of a few steps that do not, which a
    short window, checked at every step, would take for a loss. It drafts
    again after an interval of plain steps that doubles after each retry
    that does not gain (so retries stay a small share of the time) and
    shrinks back after one that does; a retry is judged after its first
    ``RETRY_WINDOW`` drafting steps (or its first step that verifies
    nothing).

    idle: steps in a row that verified nothing; plain_left: plain steps
    still to run before drafting is tried again; interval: plain steps
    before the next retry; retrying: drafting again after plain steps, not
    yet shown to gain; window: (tokens, curve seconds, curve seconds of a
    plain token, rows) of recent drafting steps."""

    def __init__(self):
        self.window: deque = deque(maxlen=WINDOW)
        self.restart()

    def restart(self) -> None:
        """Start over (a prompt joins: a new chance for drafting)."""
        self.interval, self.plain_left, self.retrying, self.idle = PLAIN_STEPS, 0, False, 0
        self.window.clear()

    @property
    def resting(self) -> bool:
        """Whether steps decode plainly until the next retry."""
        return self.plain_left > 0

    @property
    def testing(self) -> bool:
        """Whether the next drafting step is a retry's first (it verifies
        something whatever the budget says: a retry is a test)."""
        return self.retrying and not self.plain_left and not self.window and not self.idle

    def plain_step(self) -> bool:
        """A plain step was planned: one fewer before the next retry.
        Returns whether the rest ends with it (the next step retries)."""
        if not self.plain_left:
            return False
        self.plain_left -= 1
        return self.plain_left == 0

    def verified(self, anything: bool) -> None:
        """A drafting step was planned; ``anything``: the budget kept nodes
        to verify (else the step decodes plainly)."""
        if anything:
            self.idle = 0
            return
        self.idle += 1
        if self.idle >= (1 if self.retrying else IDLE_STEPS):
            self._turn_plain()

    def observe(self, tokens: float, seconds: float, one_node: float, rows: int) -> None:
        """A drafting step of ``rows`` rows produced ``tokens`` in
        ``seconds`` curve seconds, where a plain token costs ``one_node``."""
        self.window.append((tokens, seconds, one_node, rows))
        if len(self.window) >= (RETRY_WINDOW if self.retrying else WINDOW):
            if self._losing():
                self._turn_plain()
            elif self.retrying:  # a retry that gains: the next one comes soon again
                self.retrying, self.interval = False, PLAIN_STEPS

    def _turn_plain(self) -> None:
        """Plain steps for the current interval; a retry that did not gain
        doubles it (one that gains starts it over: ``observe``)."""
        if self.retrying:
            self.interval = min(2 * self.interval, MAX_PLAIN_STEPS)
        self.plain_left, self.idle, self.retrying = self.interval, 0, True
        self.window.clear()

    def _losing(self) -> bool:
        """Whether the drafting steps in the window produced fewer tokens
        per curve second than plain steps would (one token per row each
        ``one_node`` seconds)."""
        tokens, seconds, one_node, rows = (sum(column) for column in zip(*self.window))
        return tokens * one_node < rows * seconds


class SearchDepth:
    """How deep the RNN's search drafts: as deep as the budget keeps its
    nodes. Its nodes beyond a depth or two rarely make the tree, and each
    depth of the search costs as much as the first few. Every
    ``RESHAPE_STEPS``-th search (and the first few) runs the whole beam
    length; the others stop at the deepest depth whose RNN nodes those full
    searches' trees kept often enough.

    kept_depths: per full-length search, the depths its trees kept RNN
    nodes at (a deque shared with the run's history, which earlier runs of
    this model and drafter filled); searches: the searches planned."""

    def __init__(self, beam_length: int, kept_depths: deque):
        self.beam_length, self.kept_depths, self.searches = beam_length, kept_depths, 0

    def keep(self, trees, length: int) -> None:
        """A step's trees, drafted from beams ``length`` long (the root
        included): where these were a full-length search's, the depths at
        which the trees kept RNN nodes."""
        if length == self.beam_length:
            self.kept_depths.append(
                {
                    t.depths[i]
                    for t in trees
                    for i in range(1, t.num_nodes)
                    if any(key[0] == "rnn" for key, _ in t.judged[i])
                }
            )

    def next_length(self) -> int:
        """The length (the root included) of the search a step plans: the
        whole beam length every ``RESHAPE_STEPS``-th search and until enough
        full searches were seen, else one past the deepest depth their trees
        kept RNN nodes at in at least ``KEPT_SHARE`` of them."""
        full, kept_depths, earlier = self.beam_length, self.kept_depths, self.searches
        self.searches += 1
        if len(kept_depths) < kept_depths.maxlen // 2 or earlier % RESHAPE_STEPS == 0:
            return full
        kept = [sum(d in depths for depths in kept_depths) / len(kept_depths) for d in range(1, full)]
        deepest = max((d + 1 for d, share in enumerate(kept) if share >= KEPT_SHARE), default=1)
        return max(2, deepest + 1)
