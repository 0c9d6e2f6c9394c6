"""The engine thread: requests join and leave a running batch, each gets
what it would alone, and a failing request does not stop the others."""

import asyncio
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, tiny_drafter, tiny_model
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.decoder import generate_steps
from redrafter_mlx.engine.types import ReDrafter
from redrafter_mlx.serving import scheduler as scheduler_module
from redrafter_mlx.serving.scheduler import PrefillShare, Request, Scheduler

PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9], [200, 3, 4, 5, 6, 7], [11]]


@pytest.fixture(scope="module")
def redrafter():
    return ReDrafter(BaseModel(tiny_model("llama", seed=8)), tiny_drafter(seed=9))


def alone(redrafter, prompt, max_tokens):
    return [t for (out,) in generate_steps(redrafter, [prompt], max_tokens=max_tokens) for t in out.tokens]


async def collect(ticket):
    tokens = []
    while True:
        event = await asyncio.wait_for(ticket.events.get(), 60)  # fail, never hang
        if event.error is not None:
            return event.error
        tokens += event.tokens
        if event.finish_reason is not None:
            return tokens


def serve(scheduler, requests, cancel_first=False):
    async def main():
        loop = asyncio.get_running_loop()
        tickets = [scheduler.submit(r, loop) for r in requests]
        if cancel_first:
            scheduler.cancel(tickets[0])
            return [None] + list(await asyncio.gather(*(collect(t) for t in tickets[1:])))
        return list(await asyncio.gather(*(collect(t) for t in tickets)))

    return asyncio.run(main())


def one_then_another(scheduler, running, later, events_first=1, before=lambda: None):
    """Submit ``running``, wait for its first ``events_first`` events (it
    runs), call ``before``, then submit ``later``: every token of each."""

    async def main():
        loop = asyncio.get_running_loop()
        ticket = scheduler.submit(running, loop)
        tokens = []
        for _ in range(events_first):
            tokens += (await asyncio.wait_for(ticket.events.get(), 60)).tokens
        before()
        second = scheduler.submit(later, loop)
        return tokens + await collect(ticket), await collect(second)

    return asyncio.run(main())


def test_requests_beyond_the_batch_wait_and_each_gets_what_it_would_alone(redrafter):
    scheduler = Scheduler(redrafter, (), DraftSettings(), max_batch=2, cache_bytes=1 << 20)
    scheduler.start()
    limits = [20, 7, 13, 9]
    results = serve(scheduler, [Request(p, n) for p, n in zip(PROMPTS, limits)])
    assert results == [alone(redrafter, p, n) for p, n in zip(PROMPTS, limits)]
    assert scheduler.health() == {"status": "ok", "running": 0, "waiting": 0}
    # A cancelled request never decodes; the others are not disturbed.
    results = serve(scheduler, [Request(PROMPTS[0], 50), Request(PROMPTS[1], 5)], cancel_first=True)
    assert results[1] == alone(redrafter, PROMPTS[1], 5)
    scheduler.stop()


def test_memory_is_given_back_once_the_engine_has_been_idle_not_between_requests(redrafter, monkeypatch):
    """A client's next request, sent as soon as its answer came, finds the
    memory still held; the engine gives it back only after it has been idle
    ``IDLE_SECONDS``, once, and again after the next request."""
    given = []
    monkeypatch.setattr(scheduler_module, "give_back_memory", lambda: given.append(time.monotonic()))
    monkeypatch.setattr(scheduler_module, "IDLE_SECONDS", 1.0)
    scheduler = Scheduler(redrafter, (), DraftSettings(), max_batch=2)
    scheduler.start()
    try:
        for prompt in PROMPTS:  # one after another, each sent once the one before has ended
            assert serve(scheduler, [Request(prompt, 4)]) == [alone(redrafter, prompt, 4)]
        ended = time.monotonic()
        assert given == []
        while not given and time.monotonic() < ended + 30:
            time.sleep(0.05)
        assert len(given) == 1 and given[0] - ended >= 0.5  # not at once: a second, less the answer's way back
        time.sleep(1.5)
        assert len(given) == 1  # idle still: nothing more to give back
        serve(scheduler, [Request(PROMPTS[0], 2)])
        deadline = time.monotonic() + 30
        while len(given) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(given) == 2
    finally:
        scheduler.stop()


def test_a_long_prompt_is_fed_a_chunk_at_a_time_between_steps_and_a_client_that_leaves_stops_it(redrafter, monkeypatch):
    """A prompt of several chunks is prefilled a chunk per iteration, and
    the running request steps between its chunks. Cancelled after its
    first chunk, the rest is never fed and the request never joins."""
    from redrafter_mlx.engine.decoder import Decoder
    from redrafter_mlx.engine.prefill import Prefill

    long = ([5, 17, 42, 99] * 100)[:300]
    expected = alone(redrafter, PROMPTS[1], 60), alone(redrafter, long, 4)
    # A share of 1: a layer every turn, so the running request cannot end before the prefill does
    scheduler = Scheduler(redrafter, (), DraftSettings(max_nodes=0), max_batch=4, prefill_share=1.0)
    scheduler.decoder.prefill_step_size = 64
    fed, timeline, cancel = [], [], []
    layers, step = Prefill.layers, Decoder.step

    def counted(self):
        fed.append(self.tokens_left)
        timeline.append("chunk")
        if cancel and len(fed) == 1:
            scheduler.cancel(cancel[0])
        yield from layers(self)

    def stepped(self):
        if self.tracker.rows:
            timeline.append("step")
        return step(self)

    monkeypatch.setattr(Prefill, "layers", counted)
    monkeypatch.setattr(Decoder, "step", stepped)
    scheduler.start()

    tokens, long_tokens = one_then_another(scheduler, Request(PROMPTS[1], 60), Request(long, 4))
    assert (tokens, long_tokens) == expected
    assert fed[1:] == [
        299 - 64 * i for i in range(5)
    ]  # after the short prompt's; the last token comes with the first answer
    chunks = [i for i, what in enumerate(timeline) if what == "chunk"][1:]
    assert all("step" in timeline[a:b] for a, b in zip(chunks, chunks[1:]))  # the running request stepped between them
    assert scheduler.share.kept_count == scheduler.share.ended_count  # every prefill was kept
    fed.clear()

    async def left():
        ticket = scheduler.submit(Request(long, 4), asyncio.get_running_loop())
        cancel.append(ticket)
        while scheduler.health()["running"] or scheduler.incoming.qsize():
            await asyncio.sleep(0.01)
        return ticket.events.qsize()

    assert asyncio.run(left()) == 0  # nothing came back, and nothing runs
    assert fed == [299] and scheduler.coming is None
    assert scheduler.share.kept_count < scheduler.share.ended_count  # the left one's was thrown away
    scheduler.stop()


def test_the_prefill_share_falls_where_clients_keep_leaving_and_comes_back_as_prefills_are_kept():
    """Beside running requests, a prefill takes the share it was given
    while prefills are kept. One client that leaves lowers it by about a
    quarter; where clients keep leaving before their prefills end, it falls
    to a tenth; prefills that join restore it."""
    share = PrefillShare(0.2)
    assert share.current == 0.2
    share.ended(joined=False)  # one user cancels a long turn
    assert share.current == pytest.approx(0.2 * 3.2 / 4.2)
    for _ in range(20):  # clients that send a long prompt and leave
        share.ended(joined=False)
    assert share.current == pytest.approx(0.02)
    assert share.budget(decoding=True) == 0.0 and share.budget(decoding=False) == 0.0  # no step timed yet
    share.stepped(1.0)
    assert share.budget(decoding=True) == pytest.approx(0.02 / 0.98)
    assert share.budget(decoding=False) == 0.0  # alone, a layer a turn at the whole engine's pace
    share.ran(0.1)
    assert share.next_layer - time.monotonic() == pytest.approx(0.1 * 49, abs=0.05)  # the others step 49 times as long
    for _ in range(20):
        share.ended(joined=True)
    assert share.current > 0.19
    whole = PrefillShare(1.0)  # no bound at all: nothing to lower
    whole.ended(joined=False)
    assert whole.current == 1.0


def test_a_request_that_fails_ends_with_an_error_and_the_engine_goes_on(redrafter):
    scheduler = Scheduler(redrafter, (), DraftSettings(), max_batch=4)
    scheduler.start()
    too_long = Request([1] * redrafter.base.max_context, 4)  # the server refuses these; the engine must survive them
    (failed,) = serve(scheduler, [too_long])
    assert "does not fit" in failed
    assert serve(scheduler, [Request(PROMPTS[2], 6)]) == [alone(redrafter, PROMPTS[2], 6)]
    scheduler.stop()


STOP_AND_EXIT = """
import asyncio, sys
sys.path.insert(0, "tests")
from conftest import CPU_CURVE, tiny_model
from redrafter_mlx.engine import calibrate
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.engine.types import ReDrafter
from redrafter_mlx.serving.scheduler import Request, Scheduler

calibrate.cost_curve = lambda *args, **kwargs: CPU_CURVE
scheduler = Scheduler(ReDrafter(BaseModel(tiny_model("llama")), None), (), DraftSettings(), max_batch=1)
scheduler.start()

async def main():
    ticket = scheduler.submit(Request([5, 17, 42], 8), asyncio.get_running_loop())
    while (await ticket.events.get()).finish_reason is None:
        pass

asyncio.run(main())
scheduler.stop()
"""


def test_a_process_that_stops_the_engine_and_exits_at_once_exits_cleanly():
    """The engine thread's MLX state holds Python objects (its compiled
    functions); freed only as the thread's OS thread ends, after ``stop``
    has returned, it raced the interpreter's finalisation and aborted the
    process ("terminate called without an active exception") about one
    exit in six on a 2-core CPU. Ten exits make a race like it show."""
    for _ in range(10):
        done = subprocess.run(
            [sys.executable, "-c", STOP_AND_EXIT],
            cwd=ROOT,
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]


def test_short_requests_join_while_a_long_prompt_is_prefilled(redrafter, monkeypatch):
    """A short request that comes while a long prompt is being fed chunk by
    chunk joins the batch at once, beside it, rather than waiting for it;
    each gets what it would alone."""
    from redrafter_mlx.engine.decoder import Decoder
    from redrafter_mlx.engine.prefill import Prefill

    long = ([5, 17, 42, 99] * 100)[:300]
    expected = alone(redrafter, long, 6), alone(redrafter, PROMPTS[2], 8)
    scheduler = Scheduler(redrafter, (), DraftSettings(max_nodes=0), max_batch=4)
    scheduler.decoder.prefill_step_size = 64
    joined, later, loops = [], [], []
    layers, finish_join = Prefill.layers, Decoder.finish_join

    def counted(self):
        if self.tokens_left > 64 and not later:  # the long prompt's first chunk: a short request comes
            later.append(scheduler.submit(Request(PROMPTS[2], 8), loops[0]))
        yield from layers(self)

    def finishing(self, coming):
        joined.append([len(p) for p in coming.prompts])
        return finish_join(self, coming)

    monkeypatch.setattr(Prefill, "layers", counted)
    monkeypatch.setattr(Decoder, "finish_join", finishing)
    scheduler.start()

    async def main():
        loops.append(asyncio.get_running_loop())
        ticket = scheduler.submit(Request(long, 6), loops[0])
        long_tokens = await collect(ticket)
        return long_tokens, await collect(later[0])

    assert asyncio.run(main()) == expected
    assert joined == [[len(PROMPTS[2])], [300]]  # the short one joined first, though it came later
    scheduler.stop()


def test_a_short_prompt_is_fed_in_one_turn_while_others_decode_not_a_layer_a_step(redrafter, monkeypatch):
    """With no long prompt under way, a short request that comes while
    another decodes is prefilled in the engine's next turn: its layers, far
    cheaper than a step, do not wait a step each (the model has more than
    one). It gets what it would alone."""
    from redrafter_mlx.engine.decoder import Decoder

    assert redrafter.base.num_layers > 1
    expected = alone(redrafter, PROMPTS[1], 40), alone(redrafter, PROMPTS[2], 4)
    scheduler = Scheduler(redrafter, (), DraftSettings(max_nodes=0), max_batch=4, prefill_share=0.9)
    timeline, step, finish_join = [], Decoder.step, Decoder.finish_join

    def stepped(self):
        if self.tracker.rows:
            timeline.append("step")
        return step(self)

    def finishing(self, coming):
        timeline.append(("join", len(coming.prompts[0])))
        return finish_join(self, coming)

    monkeypatch.setattr(Decoder, "step", stepped)
    monkeypatch.setattr(Decoder, "finish_join", finishing)
    scheduler.start()

    answers = one_then_another(
        scheduler, Request(PROMPTS[1], 40), Request(PROMPTS[2], 4), 2, lambda: timeline.append("submitted")
    )
    assert answers == expected
    after = timeline[timeline.index("submitted") :]
    assert after.index(("join", len(PROMPTS[2]))) <= 2, after  # at most the step under way, then its turn
    scheduler.stop()


def test_a_long_prefill_takes_at_most_a_fifth_of_the_engine_while_others_decode(redrafter, monkeypatch):
    """A long prompt is fed a layer at a time. Beside a running request,
    each layer's time is followed by four times as much of the running
    request's steps; alone, the layers follow one another. Both requests
    get what they would alone."""
    import time

    from redrafter_mlx.engine.decoder import Decoder
    from redrafter_mlx.engine.prefill import Prefill

    long = ([5, 17, 42, 99] * 100)[:300]
    expected = alone(redrafter, PROMPTS[1], 300), alone(redrafter, long, 4)
    scheduler = Scheduler(redrafter, (), DraftSettings(max_nodes=0), max_batch=4)
    scheduler.decoder.prefill_step_size = 64
    spans, layers = [], Prefill.layers

    def slow(self):  # a layer as slow as a long context's on a CPU, at this scale
        for _ in layers(self):
            tic = time.monotonic()
            time.sleep(0.02)
            spans.append((tic, time.monotonic(), bool(scheduler.active)))
            yield

    def slow_step(self):  # steps of a real model's length, so that the running request outlasts the prefill
        time.sleep(0.003)
        return step(self)

    step = Decoder.step
    monkeypatch.setattr(Prefill, "layers", slow)
    monkeypatch.setattr(Decoder, "step", slow_step)
    scheduler.start()

    assert one_then_another(scheduler, Request(PROMPTS[1], 300), Request(long, 4)) == expected
    beside = [(a, b) for a, b, decoding in spans if decoding][2:]  # after the short prompt's own layers
    assert len(beside) >= 6
    gaps = [(start - end) / (end - begin) for (begin, end), (start, _) in zip(beside, beside[1:])]
    assert min(gaps) >= 3.5, gaps
    spans.clear()
    asyncio.run(serve_one(scheduler, Request(long, 4)))
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    assert max(gaps) < 0.05, gaps  # alone: one layer after another
    scheduler.stop()


async def serve_one(scheduler, request):
    return await collect(scheduler.submit(request, asyncio.get_running_loop()))
