"""An OpenAI-compatible HTTP server (Starlette on uvicorn) over the
continuous-batching ``Scheduler``.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions``
(streamed as server-sent events, or whole), ``GET /v1/models`` and
``GET /health``. Request fields follow the OpenAI API and mlx_lm.server;
unknown fields are ignored, and ``model`` never loads anything. Bad input
gets an OpenAI-style JSON error (400, or 413 for a body over the limit).
"""

import asyncio
import json
import secrets
import time
from dataclasses import dataclass
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..engine.sampling import MASK64, SamplingSettings
from ..errors import UserError
from .api import encode_prompt
from .prompts import PromptLog
from .scheduler import Event, Request, Scheduler
from .stop_strings import StopStrings

MAX_BODY_BYTES = 4 << 20
POLL_SECONDS = 0.25  # how often a waiting request checks that its client is still there


class BadRequest(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_response(message: str, status: int, param: Optional[str] = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


@dataclass
class Job:
    """A parsed request: what to generate and how to answer."""

    request: Request
    stops: list
    stream: bool
    include_usage: bool
    chat: bool
    logged: list  # what a prompt log keeps: the conversation, or the token ids


def _number(body: dict, name: str, default, low=None, high=None, integer=False, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(value)}", name)
    if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
        bounds = f"{'>' if low_open else '>='} {low}" if high is None else f"in {'(' if low_open else '['}{low}, {high}]"
        raise BadRequest(f"'{name}' must be {bounds}, got {value}", name)
    return value


def _text_content(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"'messages[{index}].content' must be a string or a list of text parts", "messages")


class Server:
    """The request handlers, for one loaded model.

    max_tokens: the default when a request names none. max_context: the
    model's context (prompts must be shorter), None if unknown. prompt_log:
    where each valid request's prompt is appended (chat requests as their
    conversation, completions as token ids), or None.
    """

    def __init__(
        self, scheduler: Scheduler, tokenizer, model_name: str, max_tokens: int, max_context: Optional[int],
        max_body_bytes: int = MAX_BODY_BYTES, prompt_log: Optional[PromptLog] = None,
    ):
        self.scheduler, self.tokenizer, self.model_name, self.prompt_log = scheduler, tokenizer, model_name, prompt_log
        self.max_tokens, self.max_context, self.max_body_bytes = max_tokens, max_context, max_body_bytes
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]

        async def http_error(request, exc: HTTPException):
            return error_response(exc.detail or "error", exc.status_code)

        # As mlx_lm.server does, any web page may call it (it listens on
        # loopback unless told otherwise).
        cors = Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])
        return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, middleware=[cors])

    async def models(self, request: HTTPRequest) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "redrafter-mlx"}]})

    async def health(self, request: HTTPRequest) -> JSONResponse:
        health = self.scheduler.health()
        return JSONResponse(health, status_code=200 if health["status"] == "ok" else 503)

    async def chat_completions(self, request: HTTPRequest):
        return await self._handle(request, chat=True)

    async def completions(self, request: HTTPRequest):
        return await self._handle(request, chat=False)

    async def _handle(self, request: HTTPRequest, chat: bool):
        try:
            body = await self._body(request)
            job = self.parse(body, chat)
        except BadRequest as e:
            return error_response(str(e), e.status, e.param)
        except ClientDisconnect:
            return error_response("the client went away", 400)
        if self.prompt_log is not None:
            self.prompt_log.add(job.logged)
        ticket = self.scheduler.submit(job.request, asyncio.get_running_loop())
        name = "chatcmpl" if chat else "cmpl"
        answer = Answer(self, job, ticket, f"{name}-{secrets.token_hex(12)}")
        if job.stream:
            return StreamingResponse(answer.stream(request), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        result = await answer.whole(request)
        if result is None:
            return error_response("the client went away", 400)
        return JSONResponse(result, status_code=500 if "error" in result else 200)

    async def _body(self, request: HTTPRequest) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise BadRequest(f"request body over {self.max_body_bytes} bytes", status=413)
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                raise BadRequest(f"request body over {self.max_body_bytes} bytes", status=413)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    def parse(self, body: dict, chat: bool) -> Job:
        """Validate a request body; raises BadRequest naming the problem."""
        if chat:
            prompt, logged = self._chat_prompt(body)
        else:
            prompt = logged = self._completion_prompt(body)
        if not prompt:
            raise BadRequest("the prompt is empty", "messages" if chat else "prompt")
        if self.max_context and len(prompt) >= self.max_context:
            raise BadRequest(f"the prompt has {len(prompt)} tokens; the model's context is {self.max_context}", "messages" if chat else "prompt")
        if _number(body, "n", 1, integer=True) != 1:
            raise BadRequest("only 'n' = 1 is supported", "n")
        limit = body.get("max_completion_tokens")
        max_tokens = _number(body, "max_completion_tokens" if limit is not None else "max_tokens", self.max_tokens, low=0, integer=True)
        seed = _number(body, "seed", None, integer=True)
        penalty = _number(body, "repetition_penalty", None, low=0)
        try:
            sampling = SamplingSettings(
                temp=_number(body, "temperature", 0.0, low=0),
                top_p=_number(body, "top_p", 1.0, low=0, high=1, low_open=True),
                top_k=_number(body, "top_k", 0, low=0, integer=True),
                min_p=_number(body, "min_p", 0.0, low=0, high=1),
                repetition_penalty=penalty or None,  # 0, as mlx_lm.server takes it, is off
                repetition_context_size=_number(body, "repetition_context_size", 20, low=1, integer=True),
                logit_bias=self._logit_bias(body.get("logit_bias")),
                seed=secrets.randbits(64) if seed is None else seed & MASK64,
            )
        except UserError as e:
            raise BadRequest(str(e)) from None
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise BadRequest("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
        return Job(Request(prompt, max_tokens, sampling), self._stops(body.get("stop")), stream, options.get("include_usage", False), chat, logged)

    def _chat_prompt(self, body: dict) -> tuple[list, list]:
        """(token ids, the conversation as a list of text messages)"""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of messages", "messages")
        conversation = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'", "messages")
            conversation.append({"role": message["role"], "content": _text_content(message.get("content"), i)})
        if not getattr(self.tokenizer, "has_chat_template", False):
            raise BadRequest("this model has no chat template; use /v1/completions", "messages")
        try:
            return encode_prompt(self.tokenizer, conversation), conversation
        except UserError as e:
            raise BadRequest(str(e), "messages") from None

    def _completion_prompt(self, body: dict) -> list:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.scheduler.redrafter.base.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise BadRequest(f"'prompt' token ids must be in [0, {vocab})", "prompt")
            return list(prompt)
        raise BadRequest("'prompt' must be a string, a list of one string, or a list of token ids", "prompt")

    def _logit_bias(self, bias) -> dict:
        if bias is None:
            return {}
        vocab = self.scheduler.redrafter.base.vocab_size
        try:
            if not isinstance(bias, dict):
                raise ValueError
            table = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise BadRequest("'logit_bias' must map token ids to numbers", "logit_bias") from None
        if any(not 0 <= k < vocab for k in table):
            raise BadRequest(f"'logit_bias' token ids must be in [0, {vocab})", "logit_bias")
        return table

    @staticmethod
    def _stops(stop) -> list:
        if stop is None:
            return []
        if isinstance(stop, str):
            return [stop]
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            return stop
        raise BadRequest("'stop' must be a string or a list of strings", "stop")


class Answer:
    """One request's response: its text as the scheduler's events arrive,
    cut at stop strings, and its usage figures."""

    def __init__(self, server: Server, job: Job, ticket, id: str):
        self.server, self.job, self.ticket, self.id = server, job, ticket, id
        self.detokenizer = server.tokenizer.detokenizer
        self.stops = StopStrings(job.stops)
        self.completion_tokens = self.cached_tokens = self.steps = self.step_tokens = self.step_nodes = 0
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None

    async def _events(self, request: HTTPRequest):
        """Text pieces as they are decoded; ends when the request does, or
        cancels it when the client goes away."""
        done = False
        try:
            while not done:
                try:
                    event: Event = await asyncio.wait_for(self.ticket.events.get(), POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if event.error is not None:
                    self.error, done = event.error, True
                    return
                text = self._add(event)
                done = self.finish_reason is not None
                if text:
                    yield text
        finally:
            if not done:
                self.server.scheduler.cancel(self.ticket)

    def _add(self, event: Event) -> str:
        if event.num_accepted is None:
            self.cached_tokens = event.cached_tokens
        else:
            self.steps += 1
            self.step_tokens += event.num_accepted + 1
            self.step_nodes += event.num_nodes
        shown = ""
        for token in event.tokens:
            self.completion_tokens += 1
            self.detokenizer.add_token(token)
            shown += self.stops.add(self.detokenizer.last_segment)
            if self.stops.stopped:
                self.finish_reason = "stop"
                self.server.scheduler.cancel(self.ticket)
                return shown
        if event.finish_reason is not None:
            self.detokenizer.finalize()
            shown += self.stops.add(self.detokenizer.last_segment)
            shown += self.stops.flush()
            self.finish_reason = "stop" if self.stops.stopped else event.finish_reason
        return shown

    def usage(self) -> dict:
        prompt = len(self.job.request.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def redrafter(self) -> dict:
        """The extension field: verification steps and what they gave."""
        return {
            "steps": self.steps,
            "tokens_per_step": self.step_tokens / self.steps if self.steps else 0.0,
            "nodes_per_step": self.step_nodes / self.steps if self.steps else 0.0,
        }

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.job.chat else "text_completion") + (".chunk" if chunk and self.job.chat else "")
        return {"id": self.id, "object": kind, "created": int(time.time()), "model": self.server.model_name}

    def _choice(self, text: str, finish_reason, chunk: bool) -> dict:
        if not self.job.chat:
            return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        if chunk:
            return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish_reason, "logprobs": None}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason, "logprobs": None}

    async def whole(self, request: HTTPRequest) -> Optional[dict]:
        """The whole response, or None when the client went away."""
        text = "".join([piece async for piece in self._events(request)])
        if self.error is not None:
            return {"error": {"message": self.error, "type": "server_error", "param": None, "code": None}}
        if self.finish_reason is None:
            return None
        return dict(self._envelope(False), choices=[self._choice(text, self.finish_reason, False)], usage=self.usage(), redrafter=self.redrafter())

    async def stream(self, request: HTTPRequest):
        """Server-sent events: the text as it comes, then the finish reason,
        the usage when asked for, and [DONE]."""

        def event(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"

        if self.job.chat:
            first = dict(self._envelope(True), choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}])
            yield event(first)
        async for piece in self._events(request):
            yield event(dict(self._envelope(True), choices=[self._choice(piece, None, True)]))
        if self.error is not None:
            yield event({"error": {"message": self.error, "type": "server_error", "param": None, "code": None}})
            return
        if self.finish_reason is None:
            return  # the client went away
        yield event(dict(self._envelope(True), choices=[self._choice("", self.finish_reason, True)], redrafter=self.redrafter()))
        if self.job.include_usage:
            yield event(dict(self._envelope(True), choices=[], usage=self.usage()))
        yield "data: [DONE]\n\n"


def run_server(
    redrafter, tokenizer, draft, sock, model_name: str, *, max_batch: int = 8, max_tokens: int = 512, cache_bytes: int = 0,
    max_body_bytes: int = MAX_BODY_BYTES, prompt_log: Optional[PromptLog] = None, announce=print,
) -> None:
    """``redrafter-mlx serve``: start the engine thread (it measures or reads
    the cost curves first), then serve on the bound socket ``sock`` until
    interrupted; ``announce`` is told where."""
    import uvicorn

    scheduler = Scheduler(redrafter, tokenizer.eos_token_ids, draft, max_batch, cache_bytes)
    scheduler.start()
    server = Server(scheduler, tokenizer, model_name, max_tokens, redrafter.base.max_context, max_body_bytes, prompt_log)
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    announce(f"serving {model_name} at http://{where}:{port}/v1 (chat/completions, completions, models; /health); Ctrl-C stops")
    config = uvicorn.Config(server.app(), log_level="warning", timeout_graceful_shutdown=3)
    uvicorn.Server(config).run(sockets=[sock])
    scheduler.stop()
