"""One request's answer, as the scheduler's events arrive: its text cut at
stop strings, the tool calls found in it, each token's log-probabilities,
and its usage figures. The API dialects format what it yields."""

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Optional

from .requests import Job
from .scheduler import Event
from .stop_strings import StopStrings
from .tools import ToolCallText, ToolFormat

POLL_SECONDS = 0.25  # how often a waiting request checks that its client is still there


@dataclass
class Part:
    """What one event added: content text, tool calls completed (each
    ``{"id", "name", "arguments"}``), and per token (token id,
    log-probability, [(id, log-probability)] of the alternatives)."""

    text: str = ""
    calls: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)


KEEP_ALIVE = Part()  # yielded while nothing came for a while (a streamed answer sends a comment)


class Answer:
    def __init__(self, tokenizer, job: Job, ticket, scheduler, syntax: ToolFormat):
        """syntax: how the model writes tool calls (read when the job has tools)."""
        self.tokenizer, self.job, self.ticket, self.scheduler = tokenizer, job, ticket, scheduler
        self.detokenizer = tokenizer.detokenizer
        self.stops = StopStrings(job.stops + job.turn_ends)
        self.tools = ToolCallText(syntax, job.tools) if job.tools else None
        self.completion_tokens = self.cached_tokens = self.steps = self.step_tokens = self.step_nodes = 0
        self.finish_reason: Optional[str] = None
        self.stop_sequence: Optional[str] = None
        self.error: Optional[str] = None
        self.calls: list = []

    @property
    def prompt_tokens(self) -> int:
        return len(self.job.request.prompt)

    async def parts(self, request, keep_alive: Optional[float] = None):
        """The answer's parts as they are decoded, and ``KEEP_ALIVE`` every
        ``keep_alive`` seconds without one (None: never). Ends when the
        request does; cancels it when the client goes away."""
        done, last = False, time.monotonic()
        try:
            while not done:
                try:
                    event: Event = await asyncio.wait_for(self.ticket.events.get(), POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    if keep_alive is not None and time.monotonic() - last >= keep_alive:
                        last = time.monotonic()
                        yield KEEP_ALIVE
                    continue
                if event.error is not None:
                    self.error, done = event.error, True
                    return
                parts = self._add(event)
                done = self.finish_reason is not None
                for part in parts:
                    if part.text or part.calls or part.logprobs:
                        last = time.monotonic()
                        yield part
        finally:
            if not done:
                self.scheduler.cancel(self.ticket)

    async def whole(self, request) -> Optional[Part]:
        """All parts together, or None when the client went away."""
        whole = Part()
        async for part in self.parts(request):
            whole.text += part.text
            whole.calls += part.calls
            whole.logprobs += part.logprobs
        return whole if self.finish_reason is not None or self.error is not None else None

    async def whole_or_failure(self, request) -> tuple[Optional[Part], Optional[tuple]]:
        """(all parts, None), or (None, (HTTP status, message)) when the
        engine failed (500) or the client went away (400)."""
        part = await self.whole(request)
        if self.error is not None:
            return None, (500, self.error)
        if part is None:
            return None, (400, "the client went away")
        return part, None

    def _add(self, event: Event) -> list:
        """The parts one event gives, in the order the model wrote them: a
        part's text comes before its calls, so text written after a call
        starts the next part."""
        if event.num_accepted is None:
            self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
        else:
            self.steps += 1
            self.step_tokens += event.num_accepted + 1
            self.step_nodes += event.num_nodes
        parts = [Part()]
        for i, token in enumerate(event.tokens):
            self.completion_tokens += 1
            if event.logprobs is not None:
                logprob, top = event.logprobs[i]
                parts[-1].logprobs.append((token, logprob, top))
            self.detokenizer.add_token(token)
            self._show(parts, self.stops.add(self.detokenizer.last_segment))
            if self.stops.stopped:
                self._finish(parts, "stop", self.stops.matched)
                self.scheduler.cancel(self.ticket)
                return parts
        if event.finish_reason is not None:
            self.detokenizer.finalize()
            self._show(parts, self.stops.add(self.detokenizer.last_segment))
            self._show(parts, self.stops.flush())
            self._finish(parts, "stop" if self.stops.stopped else event.finish_reason, self.stops.matched)
        return parts

    def _show(self, parts: list, text: str) -> None:
        if self.tools is None:
            parts[-1].text += text
            return
        while True:
            called = len(self.tools.calls)
            self._append(parts, self.tools.add(text))
            text = ""
            if len(self.tools.calls) == called:
                return

    def _append(self, parts: list, text: str) -> None:
        """Text, then the calls completed with it, to the last part (a new
        one when the last holds calls already and text comes)."""
        if text and parts[-1].calls:
            parts.append(Part())
        parts[-1].text += text
        self._take_calls(parts[-1])

    def _finish(self, parts: list, reason: str, stop_sequence: Optional[str]) -> None:
        if self.tools is not None:
            self._show(parts, "")
            self._append(parts, self.tools.finish())
        self.finish_reason = "tool_calls" if self.calls and reason == "stop" else reason
        self.stop_sequence = None if stop_sequence in self.job.turn_ends else stop_sequence

    def _take_calls(self, part: Part) -> None:
        for call in self.tools.calls[len(self.calls) :]:
            arguments = call["arguments"]
            made = {
                "id": f"call_{secrets.token_hex(12)}",
                "name": call["name"],
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
            }
            self.calls.append(made)
            part.calls.append(made)

    def extension(self) -> dict:
        """The ``redrafter`` field: verification steps and what they gave,
        and the tools left out of the prompt (hosted tools), if any."""
        extension = {
            "steps": self.steps,
            "tokens_per_step": self.step_tokens / self.steps if self.steps else 0.0,
            "nodes_per_step": self.step_nodes / self.steps if self.steps else 0.0,
        }
        if self.job.left_out:
            extension["tools_left_out"] = list(self.job.left_out)
        return extension
