"""Continuous batching for the server: one engine thread owns MLX and a
running ``Decoder``; requests join the batch between steps and leave it when
they finish or are cancelled.

Callers on other threads (the HTTP server's event loop) ``submit`` a
``Request`` and read its ``Ticket``: the events of its generation, in order,
delivered to the caller's asyncio loop. Each request samples with its own
settings and seed as if it were prompt 0 of a list of its own, so a seeded
request gives the same tokens whatever ran beside it, and the same as
``generate --seed`` with that prompt.
"""

import asyncio
import itertools
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.core as mx

from ..drafting.settings import DraftSettings
from ..engine.decoder import Decoder, Joining
from ..engine.prompt_cache import PromptCache
from ..engine.sampling import SamplingSettings, chooser_per_prompt, make_chooser
from ..engine.types import ReDrafter
from .cache_store import PromptCacheStore
from .metrics import Metrics
from .process import trim_heap


@dataclass
class Request:
    """prompt: token ids; max_tokens: at most this many new tokens."""

    prompt: list
    max_tokens: int
    sampling: SamplingSettings = field(default_factory=SamplingSettings)


@dataclass
class Event:
    """What one step gave a request.

    tokens: new token ids (cut at EOS, which is not included, and at
        max_tokens). num_accepted: drafted tokens accepted (None for the
        first token). num_nodes: tree nodes verified for it (None for the
        first). finish_reason: None while it goes on, "stop" or "length".
    cached_tokens: on the first event, prompt tokens taken from the cache.
    error: set (and nothing else) when the request failed.
    logprobs: per token, as ``StepOutput.logprobs`` (when asked for).
    """

    tokens: list = field(default_factory=list)
    num_accepted: Optional[int] = None
    num_nodes: Optional[int] = None
    finish_reason: Optional[str] = None
    cached_tokens: int = 0
    error: Optional[str] = None
    logprobs: Optional[list] = None


@dataclass
class Coming:
    """Requests being prefilled, on their way into the batch: their tickets,
    their prompt caches (None where none), and the decoder's ``Joining``."""

    tickets: list
    caches: list
    joining: Joining
    feeding: Optional[Iterator] = None  # the chunk being fed, a layer at a time (``Prefill.layers``)


PREFILL_SHARE = 0.2  # of the engine's time, a long prefill's at most while other requests decode
FED = object()  # what ``Prefill.layers`` gives once its chunk is fed
MIN_KEPT = 0.1  # the least part of the prefill share left where clients keep leaving (``PrefillShare.current``)
KEPT_DECAY = 0.8  # the weight of the prefills before, each time one ends
KEPT_PRIOR = 4.0  # kept prefills counted before any has ended

# Steps between two clears of MLX's cache of freed buffers, which would
# otherwise keep every size it has held (as mlx-lm's batch generator does).
CLEAR_EVERY = 512
# Seconds the engine waits idle before it gives memory back: a request that
# follows sooner, as a client's next one does, finds it still held.
IDLE_SECONDS = 2.0


def give_back_memory() -> None:
    """MLX's cache of freed buffers, then the C library's free pages, go
    back to the system, once the engine has been idle ``IDLE_SECONDS``.
    Under load the C library keeps what is freed for the next requests
    (``process.hold_freed_memory``), so resident memory levels off at what
    the work holds at most, rather than rising and falling with it."""
    mx.clear_cache()
    trim_heap()


class PrefillShare:
    """How much of the engine a long prompt's prefill takes while other
    requests decode. A chunk is fed a layer at a time
    (``Prefill.layers``), in turns of the engine's loop. Alone, the layers
    follow one another. Beside running requests, a turn feeds at least one
    layer, and more while they take less than the share's part of one of
    the running rows' steps; each turn is followed by enough of their
    steps that the prefill takes at most ``share`` of the engine's time (a
    fifth by default). So a long prompt, or a client that sends one and
    leaves, cannot starve the requests already answering, and one that
    leaves costs at most a layer's work; a short prompt, whose layers are
    each far cheaper than a step, is fed in a turn or two, not a layer a
    step. A lower share favours the answering requests, a higher one the
    long prompt's first token. A chunk is never cut into fewer tokens: its
    size decides the prompt's numbers, which must not depend on what ran
    beside it.

    Prefill whose clients leave before it ends is work thrown away. Where
    that is the fate of most recent prefills (clients that time out and
    send their long prompts again, or a hostile load), the share beside
    running requests falls with the part of them that were kept, to a
    tenth of it at least (``current``). Each prefill that ends counts
    once, and those before it count ``KEPT_DECAY`` times what they did; the
    count starts as if ``KEPT_PRIOR`` prefills had been kept. So one client
    that leaves (an agent's user who cancels a long turn) lowers the share
    by about a quarter, a run of them lowers it to the floor, and prefills
    that end with their requests joining raise it again. Alone, a prefill
    still takes the whole engine."""

    def __init__(self, share: float = PREFILL_SHARE):
        self.share = share
        self.next_layer = 0.0  # monotonic time before which running requests step instead
        self.step = 0.0  # seconds the running rows' last step took
        self.ended_count = KEPT_PRIOR  # recent prefills, each older one weighed down by KEPT_DECAY
        self.kept_count = KEPT_PRIOR  # those of them whose requests joined

    @property
    def current(self) -> float:
        """The share beside running requests: ``share`` times the part of
        recent prefills that were kept, at least a tenth of it."""
        if self.share >= 1:
            return self.share
        return self.share * max(self.kept_count / self.ended_count, MIN_KEPT)

    def allows(self, decoding: bool) -> bool:
        return not decoding or time.monotonic() >= self.next_layer

    def budget(self, decoding: bool) -> float:
        """Seconds of layers a turn may feed after its first: none when
        nothing decodes (turns follow one another, each one layer, so that
        a client that leaves is noticed and a short request joins)."""
        share = self.current
        if not decoding or share >= 1:
            return 0.0
        return self.step * share / (1 - share)

    def stepped(self, seconds: float) -> None:
        self.step = seconds

    def ran(self, seconds: float) -> None:
        self.next_layer = time.monotonic() + seconds * (1 / self.current - 1)

    def ended(self, joined: bool) -> None:
        """A prefill ended: its requests joined the batch, or their clients
        left first."""
        self.ended_count = self.ended_count * KEPT_DECAY + 1
        self.kept_count = self.kept_count * KEPT_DECAY + joined


class Refused(Exception):
    """A request the scheduler will not take: ``reason`` is "queue full" or
    "shutting down"."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


END = object()  # wakes the engine thread to end every request (shutdown)


class Ticket:
    """A submitted request: ``await ticket.events.get()`` gives its events;
    the last has a finish_reason or an error."""

    def __init__(self, id: int, request: Request, loop: asyncio.AbstractEventLoop):
        self.id, self.request, self.loop = id, request, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.row: Optional[int] = None  # its Decoder row once it has joined
        self.cancelled = False

    def post(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    """max_batch: requests decoded together (others wait their turn).
    cache_bytes: memory for finished requests' prompt caches (0: none).
    max_queue: requests that may wait at once (None: any number); more are
    refused. metrics: a ``Metrics`` the engine adds its counts to.
    prefill_share: the most of the engine's time a long prompt's prefill
    takes while other requests decode (``PrefillShare``)."""

    def __init__(
        self,
        redrafter: ReDrafter,
        eos_token_ids,
        draft: DraftSettings,
        max_batch: int = 8,
        cache_bytes: int = 0,
        max_queue: Optional[int] = None,
        metrics: Optional[Metrics] = None,
        prefill_share: float = PREFILL_SHARE,
    ):
        self.redrafter, self.eos, self.draft = redrafter, eos_token_ids, draft
        self.max_batch, self.max_queue = max_batch, max_queue
        self.metrics = metrics or Metrics()
        self.closed = False
        # A model split over ranks: the other ranks make the same decoder
        # calls (``follow``), told what they are at every iteration.
        self.ranks = redrafter.base.ranks
        self.reset_next = False
        self.store = PromptCacheStore(0 if self.ranks.several else cache_bytes)  # no prompt caches when split
        self.incoming: queue.Queue = queue.Queue()
        self.ids = itertools.count()
        self.choosers: dict = {}
        self.active: dict = {}  # Decoder row -> Ticket
        self.waiting: list = []  # tickets taken from `incoming`, not yet in the batch
        self.coming: Optional[Coming] = None  # the requests being prefilled
        self.share = PrefillShare(prefill_share)
        self.decoder = self._new_decoder()
        self.thread = threading.Thread(target=self._run, name="redrafter-engine", daemon=True)
        self.ready = threading.Event()
        self.startup_error: Optional[Exception] = None

    def _new_decoder(self) -> Decoder:
        # Trees are sized by the cost curve of the nearest batch size of these.
        return Decoder(
            self.redrafter, self.draft, chooser_per_prompt(self.choosers), self.eos, cost_batch_sizes=self.batch_sizes
        )

    @property
    def batch_sizes(self) -> list:
        return [b for b in (1, 2, 4, 8, 16, 32, 64) if b < self.max_batch] + [self.max_batch]

    def calibrate(self) -> None:
        """Measure (or read) the cost curve of one row, which the others
        start from (``engine.costs``); a model split over ranks, whose
        steps cannot correct a curve, measures every batch size."""
        for size in self.batch_sizes if self.ranks.several else [1]:
            self.decoder.costs.measure(size)

    def start(self) -> None:
        """Start the engine thread; it measures (or reads) the cost curves
        first, and this returns once it is ready."""
        self.thread.start()
        # Waited for in short slices: a SIGTERM the kernel hands to another
        # thread runs its Python handler only once this (the main) thread
        # runs Python again, which an untimed wait would put off until the
        # measurement ends.
        while not self.ready.wait(0.1):
            pass
        if self.startup_error is not None:
            raise self.startup_error

    def stop(self) -> None:
        self.incoming.put(None)
        self.thread.join()

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Ticket:
        """Queue a request; ``Refused`` when the queue is full or the server
        is shutting down."""
        if self.closed:
            raise Refused("shutting down")
        health = self.health()
        if self.max_queue is not None and health["running"] + health["waiting"] >= self.max_batch + self.max_queue:
            raise Refused("queue full")
        ticket = Ticket(next(self.ids), request, loop)
        self.incoming.put(ticket)
        return ticket

    def close(self) -> None:
        """Take no more requests (those queued and running go on)."""
        self.closed = True

    def end_all(self) -> None:
        """End every request now, running or waiting, with a final event
        (``finish_reason`` "length": the answer was cut short)."""
        self.closed = True
        self.incoming.put(END)

    def cancel(self, ticket: Ticket) -> None:
        """Stop a request (its client went away, or a stop string ended
        it); its row leaves the batch before the next step."""
        ticket.cancelled = True

    def health(self) -> dict:
        """Whether the engine thread runs; requests decoding (or being
        prefilled) and waiting."""
        coming = self.coming
        waiting = len(self.waiting) + self.incoming.qsize()
        running = len(self.active) + (len(coming.tickets) if coming is not None else 0)
        return {"status": "ok" if self.thread.is_alive() else "unavailable", "running": running, "waiting": waiting}

    def _run(self) -> None:
        """The engine thread. MLX keeps per-thread state (this thread's
        streams and its cache of compiled functions, which holds Python
        objects); it is freed here, while the thread still runs Python. Left
        to the thread's exit, it would be freed after ``join`` has returned,
        and releasing those Python objects while the main thread finalises
        the interpreter aborts the process."""
        try:
            self._serve()
        finally:
            mx.synchronize()  # a plain step may still be computing ahead
            mx.clear_streams()

    def _serve(self) -> None:
        try:
            self.calibrate()
        except Exception as e:
            self.startup_error = e
            return
        finally:
            self.ready.set()
        for steps in itertools.count(1):
            if not self.active and not self.waiting and self.coming is None:
                try:
                    self.waiting.append(self.incoming.get(timeout=IDLE_SECONDS))
                except queue.Empty:
                    give_back_memory()
                    self.waiting.append(self.incoming.get())
            elif steps % CLEAR_EVERY == 0:
                mx.clear_cache()
            while True:
                try:
                    self.waiting.append(self.incoming.get_nowait())
                except queue.Empty:
                    break
            if None in self.waiting:
                self._tell(stop=True)
                return
            if END in self.waiting:
                self._tell(reset=True)
                self._end_all()
                continue
            leaving = [row for row, t in self.active.items() if t.cancelled and row not in self.decoder.leaving]
            for row in leaving:  # a stop string ended it: the next turn may follow
                self._remember(row)
            self.decoder.leave(leaving)
            if self.coming is not None and all(t.cancelled for t in self.coming.tickets):
                self.share.ended(joined=False)
                for (
                    ticket
                ) in self.coming.tickets:  # their clients went away: the prefill stops here, and its memory goes
                    self.choosers.pop(ticket.id, None)
                self.coming = None
            self.waiting = [t for t in self.waiting if not t.cancelled]
            joining = self._next_joining()
            self._tell(
                leave=leaving,
                join=[(t.request.prompt, t.request.max_tokens, t.id, t.request.sampling) for t in joining],
            )
            try:
                if joining and self.coming is None:
                    self.coming = self._begin_join(joining)
                elif joining:  # short prompts, fed whole now, beside the long one under way
                    self._finish_join(self._begin_join(joining))
                decoding = not self.ranks.several and any(not t.cancelled for t in self.active.values())
                if self.coming is not None and self.share.allows(decoding):
                    self._prefill(decoding)
                tic = time.monotonic()
                outputs = self.decoder.step()
                self.share.stepped(time.monotonic() - tic)
                self._deliver(outputs)
            except Exception as e:  # one failure must not stop the server
                self._fail(f"{type(e).__name__}: {e}", joining)

    def _next_joining(self) -> list:
        """The waiting requests that start their prefill now, as many as the
        batch has room for. A prompt is short when at most one chunk of it
        is left to feed after what the prompt cache serves; a long one is
        prefilled alone, a layer at a time between the running rows' steps
        (``PrefillShare``). With no prefill under way: the first waiting
        request, and the short ones right after it. While a long prompt is
        prefilled: the short ones, wherever they wait, so that short
        requests never queue behind long prompts (or behind clients that
        send one and leave)."""
        coming = self.coming.tickets if self.coming is not None else []
        room = self.max_batch - sum(1 for t in self.active.values() if not t.cancelled) - len(coming)
        if room <= 0 or (coming and self.ranks.several):
            return []

        def short(ticket) -> bool:
            prompt = ticket.request.prompt
            return self.ranks.several or len(prompt) - self.store.reusable(prompt) <= self.decoder.prefill_step_size

        if coming:
            joining = [t for t in self.waiting if short(t)][:room]
        else:
            joining = []
            for ticket in self.waiting[:room]:
                if joining and not short(ticket):
                    break
                joining.append(ticket)
                if not short(ticket):
                    break
        chosen = {id(t) for t in joining}
        self.waiting = [t for t in self.waiting if id(t) not in chosen]
        return joining

    def _begin_join(self, tickets: list) -> Coming:
        caches = [self.store.find(t.request.prompt) for t in tickets]
        for t, c in zip(tickets, caches):
            if c is not None:
                self.metrics.add("prompt_cache_hits_total")
                self.metrics.add("prompt_cache_tokens_total", c.reusable(t.request.prompt))
        for t in tickets:
            self.choosers[t.id] = make_chooser(t.request.sampling)
        joining = self.decoder.begin_join(
            [t.request.prompt for t in tickets],
            [t.request.max_tokens for t in tickets],
            [t.id for t in tickets],
            caches,
        )
        return Coming(tickets, caches, joining)

    def _prefill(self, decoding: bool) -> None:
        """A turn of the coming requests' prefill, a layer or more of it
        (``PrefillShare``), or, once it is all fed, their first tokens:
        they join the batch. A model split over ranks is prefilled whole,
        as the other ranks' ``join`` feeds it."""
        coming = self.coming
        prefill = coming.joining.prefill
        if not prefill.done and not self.ranks.several:
            tic, budget = time.monotonic(), self.share.budget(decoding)
            while True:
                coming.feeding = coming.feeding or prefill.layers()
                if next(coming.feeding, FED) is FED:
                    coming.feeding = None  # that chunk is fed
                if prefill.done or time.monotonic() - tic >= budget:
                    break
            self.share.ran(time.monotonic() - tic)
            if coming.feeding is not None or not prefill.done:
                return
        self.coming = None
        self.share.ended(joined=any(not t.cancelled for t in coming.tickets))
        self._finish_join(coming)

    def _finish_join(self, coming: Coming) -> None:
        """Feed what is left of the coming requests' prompts and their first
        tokens: they join the batch."""
        outputs = self.decoder.finish_join(coming.joining)
        tickets, caches = coming.tickets, coming.caches
        joined = outputs[len(outputs) - len(tickets) :]  # before them: tokens of running rows that were ready
        for t, out in zip(tickets, joined):
            t.row = out.row
            self.active[out.row] = t
            if t.cancelled:  # its client went away while it was fed
                self.decoder.leave([out.row])
        self._deliver(
            outputs, {out.row: c.reusable(t.request.prompt) if c else 0 for t, c, out in zip(tickets, caches, joined)}
        )

    def _tell(self, stop: bool = False, reset: bool = False, leave=(), join=()) -> None:
        """What this iteration does, for the other ranks of a split model."""
        if self.ranks.several:
            self.ranks.broadcast(dict(stop=stop, reset=reset or self.reset_next, leave=list(leave), join=list(join)))
            self.reset_next = False

    def _end_all(self) -> None:
        coming = self.coming.tickets if self.coming is not None else []
        for ticket in list(self.active.values()) + coming + [t for t in self.waiting if t is not END]:
            ticket.post(Event(finish_reason="length"))
        self.active.clear()
        self.choosers.clear()
        self.waiting, self.coming = [], None
        self.decoder = self._new_decoder()

    def _deliver(self, outputs: list, cached: Optional[dict] = None) -> None:
        for out in outputs:
            ticket = self.active.get(out.row)
            if ticket is None:
                continue
            if out.finish_reason is not None:
                self._remember(out.row)
                del self.active[out.row]
                del self.choosers[ticket.id]
            cached_tokens = cached.get(out.row, 0) if cached else 0
            if out.num_accepted is not None:
                self.metrics.add("verification_steps_total")
                self.metrics.add("step_tokens_total", out.num_accepted + 1)
            self.metrics.add("completion_tokens_total", len(out.tokens))
            ticket.post(
                Event(
                    out.tokens, out.num_accepted, out.num_nodes, out.finish_reason, cached_tokens, logprobs=out.logprobs
                )
            )
        for row in [r for r in self.active if r not in self.decoder.rows]:  # cancelled rows have left
            ticket = self.active.pop(row)
            self.choosers.pop(ticket.id, None)

    def _remember(self, row: int) -> None:
        if self.store.max_bytes:
            self.store.add(PromptCache(*self.decoder.prompt_cache(row), self.redrafter.identity))

    def _fail(self, message: str, joining: list) -> None:
        print(f"error: the engine failed a step ({message}); its requests were ended", file=sys.stderr)
        coming = self.coming.tickets if self.coming is not None else []
        for ticket in set(self.active.values()) | set(joining) | set(coming):
            self.metrics.add("errors_total")
            ticket.post(Event(error=message))
        self.active.clear()
        self.choosers.clear()
        self.coming = None
        self.decoder = self._new_decoder()
        self.reset_next = True


def follow(redrafter: ReDrafter, eos_token_ids, draft: DraftSettings, max_batch: int) -> None:
    """``serve`` on a rank other than 0 of a split model: make the decoder
    calls rank 0's scheduler makes, as it tells them at every iteration,
    until it stops. Every rank then runs the same passes, and rank 0
    answers the requests. A failure here that rank 0 did not also have
    would leave the ranks apart: it ends this process (and, through the
    heartbeat, the others)."""
    ranks = redrafter.base.ranks
    scheduler = Scheduler(redrafter, eos_token_ids, draft, max_batch)
    scheduler.calibrate()
    rows, failed = {}, None  # decoder row -> request id
    while True:
        plan = ranks.broadcast()
        if plan["stop"]:
            mx.synchronize()
            return
        if plan["reset"]:
            scheduler.decoder, failed = scheduler._new_decoder(), None
            scheduler.choosers.clear()
            rows.clear()
        if failed is not None:
            raise RuntimeError(f"this rank failed a step that rank 0 did not ({failed})")
        decoder = scheduler.decoder
        try:
            decoder.leave(plan["leave"])
            if plan["join"]:
                for _, _, request_id, sampling in plan["join"]:
                    scheduler.choosers[request_id] = make_chooser(sampling)
                prompts, limits, ids, _ = zip(*plan["join"])
                joined = decoder.join(list(prompts), list(limits), list(ids), None)
                for request_id, out in zip(ids, joined[len(joined) - len(ids) :]):
                    rows[out.row] = request_id
            decoder.step()
        except Exception as e:  # rank 0 fails the same way, and says reset next
            failed = f"{type(e).__name__}: {e}"
            continue
        for row in [r for r in rows if r not in decoder.rows]:
            scheduler.choosers.pop(rows.pop(row), None)
