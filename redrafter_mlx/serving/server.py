"""The HTTP server (Starlette on uvicorn) over the continuous-batching
``Scheduler``: the OpenAI dialect (``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``), OpenAI's Responses dialect
(``/v1/responses``), the Anthropic Messages dialect (``/v1/messages``,
``/v1/messages/count_tokens``), ``/health`` and ``/metrics``.

Every route but ``/health`` and the connectivity checks (``/``,
``/api/hello``) needs the API key when one is set
(``Authorization: Bearer KEY`` or ``x-api-key: KEY``). Bad input gets an
error body in the route's dialect (400; 413 for a body over the limit;
429 with ``Retry-After`` when the waiting queue is full). A streamed
answer sends keep-alive comments (pings, in the Anthropic dialect) while
it waits or its prompt is prefilled. On SIGTERM the server takes no new
requests, lets running ones finish for ``shutdown_timeout`` seconds, then
ends the rest with a final event and exits.

No client can starve the others (``Limits``): a request's head and its
body must each arrive within ``read_timeout`` (a late body gets 408, a late
head has its connection closed), so a slow client holds no connection for
long, and none holds an engine slot before its body is in and parsed. A
head over ``max_header_bytes`` gets 431. At most ``max_connections`` are
open, idle ones included; a request on one beyond gets 503, and uvicorn
closes a connection idle ``IDLE_CONNECTION_SECONDS`` after an answer.
"""

import asyncio
import dataclasses
import functools
import hmac
import json
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Optional
from urllib.parse import unquote

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from . import anthropic_api, openai_api, responses_api
from .answer import Answer
from .chat_format import ChatRenderer
from .metrics import Metrics
from .process import allow_open_files
from .prompts import PromptLog
from .requests import BadRequest, Context
from .scheduler import PREFILL_SHARE, Refused, Scheduler

MAX_BODY_BYTES = 4 << 20
READ_TIMEOUT_SECONDS = 30.0  # for a request's head, then for its body
MAX_HEADER_BYTES = 64 << 10  # a request's line and headers
MAX_CONNECTIONS = 2048  # open connections, idle ones included
IDLE_CONNECTION_SECONDS = 30  # uvicorn closes a connection idle this long after an answer (its timeout_keep_alive)
REFUSED_HEAD_SECONDS = 1.0  # the time a connection beyond the bound has to send the request its 503 answers
SPARE_FILES = 256  # descriptors the process needs besides its connections (the listening socket, files, pipes)
KEEP_ALIVE_SECONDS = 5.0
MAX_NOTED_TOOLS = 256  # tools named on the log as left out of prompts
RETRY_AFTER_SECONDS = 1
ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/chat/completions",
    "/completions",
    "/v1/responses",
    "/responses",
    "/v1/responses/input_tokens",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/models",
    "/health",
    "/metrics",
    "/",
    "/api/hello",
)
OPEN = ("/health", "/", "/api/hello")  # routes that need no API key: health and connectivity checks
RESPONSES = ("/v1/responses", "/responses", "/v1/responses/input_tokens")


@dataclass(frozen=True)
class Limits:
    """What one client may take of the server.

    max_body_bytes: the largest request body (413 above). read_timeout:
    seconds a client has to send a request's head (its line and headers),
    counted from the connection's opening or the end of the previous answer,
    and then as long again for its body; a late body gets 408 and the
    connection is closed, a late head has its connection closed.
    max_header_bytes: the largest head (431 above). max_connections: open
    connections, idle ones included; a request on a connection beyond them
    gets 503 (and the connection is closed)."""

    max_body_bytes: int = MAX_BODY_BYTES
    read_timeout: float = READ_TIMEOUT_SECONDS
    max_header_bytes: int = MAX_HEADER_BYTES
    max_connections: int = MAX_CONNECTIONS


def anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(
    path: str,
    message: str,
    status: int,
    param: Optional[str] = None,
    code: Optional[str] = None,
    tokens: Optional[int] = None,
    limit: Optional[int] = None,
    headers: Optional[dict] = None,
) -> JSONResponse:
    """An error in the dialect of the route it answers; its machine code,
    when it has one, also in the ``x-error-code`` header (the access log
    notes it)."""
    if code:
        headers = dict(headers or {}, **{"x-error-code": code})
    if anthropic(path):
        body = anthropic_api.error_body(message, status, tokens, limit)
    elif path in RESPONSES:
        body = responses_api.error_body(message, status, param, code)
    else:
        body = openai_api.error_body(message, status, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


def endpoint(path: str) -> str:
    """The label a request is counted under in ``requests_total``."""
    return path if path in ROUTES else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


def head_bytes(scope) -> int:
    """The size of a request's head as it came: its line and its headers."""
    line = len(scope["method"]) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 12
    return line + sum(len(name) + len(value) + 4 for name, value in scope.get("headers") or ())


class Guard:
    """ASGI middleware: the bounds of ``Limits`` a request's head can be
    checked against (431 for a head over ``max_header_bytes``; 503 when
    more than ``max_connections`` are open, as ``connections()`` counts
    them), the API key (compared in constant time) on every route but the
    open ones, the count of requests by endpoint and status, and the access
    log: one line per request once it has been answered (``log``; None:
    none). A refused request's connection is closed after its answer."""

    def __init__(
        self,
        app,
        api_key: Optional[str],
        metrics: Metrics,
        log: Optional[Callable[[str], None]],
        limits: Limits = Limits(),
        connections: Callable[[], int] = lambda: 0,
    ):
        self.app, self.key, self.metrics, self.log = app, api_key.encode() if api_key else None, metrics, log
        self.limits, self.connections = limits, connections

    def _allowed(self, scope) -> bool:
        headers = dict(scope.get("headers") or ())
        given = headers.get(b"x-api-key")
        authorization = headers.get(b"authorization", b"")
        if given is None and authorization[:7].lower() == b"bearer ":
            given = authorization[7:].strip()
        return given is not None and hmac.compare_digest(given, self.key)

    def _refusal(self, scope) -> Optional[JSONResponse]:
        """The answer to a request refused before it is read, else None."""
        path, limits = scope["path"], self.limits
        if head_bytes(scope) > limits.max_header_bytes:
            return error_response(
                path, f"request headers over {limits.max_header_bytes} bytes", 431, headers={"Connection": "close"}
            )
        if self.connections() > limits.max_connections:
            self.metrics.add("rejected_total", reason="too many connections")
            return error_response(
                path,
                f"over {limits.max_connections} connections are open; retry shortly",
                503,
                headers={"Retry-After": str(RETRY_AFTER_SECONDS), "Connection": "close"},
            )
        if self.key and path not in OPEN and scope["method"] != "OPTIONS" and not self._allowed(scope):
            return error_response(path, "a valid API key is needed (Authorization: Bearer KEY, or x-api-key: KEY)", 401)
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, status, code, tic = scope["path"], [500], [""], time.monotonic()

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                code[0] = dict(message.get("headers", [])).get(b"x-error-code", b"").decode("latin-1")
                # Every answer names itself, as the APIs' answers do (clients log it).
                request_id = f"req_{secrets.token_hex(12)}".encode()
                message = dict(
                    message,
                    headers=[*message.get("headers", []), (b"request-id", request_id), (b"x-request-id", request_id)],
                )
            await send(message)

        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, sending)
        else:
            await self.app(scope, receive, sending)
        self.metrics.add("requests_total", endpoint=endpoint(path), status=status[0])
        if self.log is not None:
            query = scope.get("query_string") or b""
            target = path + ("?" + query.decode("latin-1") if query else "")
            client = (scope.get("client") or ("-",))[0]
            note = f" ({code[0]})" if code[0] else ""
            self.log(f'{client} "{scope["method"]} {target}" {status[0]} {time.monotonic() - tic:.2f}s{note}')


class Connection(H11Protocol):
    """uvicorn's HTTP/1.1 connection (h11; uvicorn's httptools parser,
    when installed, is not used, so that these bounds hold whatever is
    installed), with the bounds of ``Limits`` that only a connection can
    keep:

    - A request's head must arrive within ``read_timeout`` of the
      connection's opening or of the end of the previous answer, else the
      connection is closed. uvicorn closes a connection left idle after an
      answer, but sets no bound before the first request, and each byte
      that arrives restarts its wait: without this, a client that opens
      connections and sends nothing, or sends its headers a byte a second,
      would hold them forever. A connection opened while more than
      ``max_connections`` are open gets ``REFUSED_HEAD_SECONDS`` instead:
      its request can only be refused (``Guard``), and a flood of them
      holds few descriptors for long.
    - A head still incomplete at ``max_header_bytes`` (h11 buffers no more:
      its ``max_incomplete_event_size``) gets 431 in the dialect of the
      path on its request line, where uvicorn answers a plain 400. A head
      that arrives whole in one read is not bounded by h11; ``Guard``
      answers it 431.

    server: the ``Server`` whose limits, counters and access log it keeps."""

    def __init__(self, *args, server: "Server", **kwargs):
        super().__init__(*args, **kwargs)
        self.handler = server
        self.head_deadline: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        limits = self.handler.limits
        beyond = len(self.connections) > limits.max_connections
        self._await_head(min(limits.read_timeout, REFUSED_HEAD_SECONDS) if beyond else limits.read_timeout)

    def connection_lost(self, exc) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's head has arrived
            self._stop_waiting()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if self.cycle is cycle and not self.transport.is_closing():  # no request sent ahead (pipelined) has begun
            self._await_head(self.handler.limits.read_timeout)

    def _await_head(self, seconds: float) -> None:
        self._stop_waiting()
        self.head_deadline = self.loop.call_later(seconds, self._head_late)

    def _stop_waiting(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _head_late(self) -> None:
        self.head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head h11 cannot read: 431, in the route's
        dialect, when h11 stopped at its bound (the bytes it holds are over
        it), else uvicorn's 400."""
        limits, buffered = self.handler.limits, self.conn.trailing_data[0]
        if len(buffered) <= limits.max_header_bytes:
            return super().send_400_response(msg)
        line = buffered.split(b"\r\n", 1)[0].split(b" ")
        method = line[0].decode("latin-1")
        path = unquote(line[1].split(b"?", 1)[0].decode("latin-1")) if len(line) > 1 else "/"
        response = error_response(
            path, f"request headers over {limits.max_header_bytes} bytes", 431, headers={"Connection": "close"}
        )
        event = h11.Response(status_code=431, headers=response.raw_headers, reason=b"Request Header Fields Too Large")
        self.transport.write(
            self.conn.send(event) + self.conn.send(h11.Data(data=response.body)) + self.conn.send(h11.EndOfMessage())
        )
        self.transport.close()
        self.handler.metrics.add("requests_total", endpoint=endpoint(path), status=431)
        if self.handler.access_log is not None:
            self.handler.access_log(f'{(self.client or ("-",))[0]} "{method} {path[:200]}" 431 0.00s')


def bad_request(path: str, e: BadRequest) -> JSONResponse:
    """A ``BadRequest``'s answer; after a body that came too slowly (408),
    the connection is closed (the rest of the body may still be coming)."""
    headers = {"Connection": "close"} if e.status == 408 else None
    return error_response(path, str(e), e.status, e.param, e.code, e.tokens, e.limit, headers=headers)


class Server:
    """The request handlers, for one loaded model.

    renderer: how its conversations become prompts (``ChatRenderer``).
    max_tokens: the default when a request names none. max_context: the
    model's context (prompts must be shorter), None if unknown. prompt_log:
    where each valid request's prompt is appended (chat requests as their
    conversation, completions as token ids), or None. api_key: the key
    every route but /health and the connectivity checks (``/``,
    ``/api/hello``) needs (None: none). keep_alive: seconds between
    keep-alive comments of a streamed answer that has nothing to send.
    access_log: where each request's line goes once answered (None: nowhere).
    max_output_tokens: the most tokens any answer gets (None: up to the context).
    limits: what one client may take (``Limits``).

    connections: the open connections, which the connection bound counts;
    ``run_server`` hands it uvicorn's own set once that exists.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        renderer: ChatRenderer,
        model_name: str,
        max_tokens: int,
        max_context: Optional[int],
        limits: Limits = Limits(),
        prompt_log: Optional[PromptLog] = None,
        api_key: Optional[str] = None,
        keep_alive: float = KEEP_ALIVE_SECONDS,
        access_log: Optional[Callable[[str], None]] = None,
        max_output_tokens: Optional[int] = None,
    ):
        self.scheduler, self.tokenizer, self.model_name, self.prompt_log = (
            scheduler,
            renderer.tokenizer,
            model_name,
            prompt_log,
        )
        self.access_log, self.max_output_tokens = access_log, max_output_tokens
        self.context = Context(
            renderer.tokenizer, scheduler.redrafter.base.vocab_size, max_context, max_tokens, renderer
        )
        self.limits, self.api_key, self.keep_alive = limits, api_key, keep_alive
        self.connections: set = set()
        self.metrics = scheduler.metrics
        self.created = int(time.time())
        self.left_out: set = set()  # tools the log has named as left out

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/responses", self.responses, methods=["POST"]),
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/responses/input_tokens", self.input_tokens, methods=["POST"]),
            Route("/", self.hello, methods=["GET", "HEAD"]),
            Route("/api/hello", self.hello, methods=["GET", "HEAD"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_page, methods=["GET"]),
        ]

        async def http_error(request, exc: HTTPException):
            return error_response(request.url.path, exc.detail or "error", exc.status_code)

        # As mlx_lm.server does, any web page may call it (it listens on
        # loopback unless told otherwise).
        cors = Middleware(
            CORSMiddleware, allow_origins=["*"], allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"]
        )
        guard = Middleware(
            Guard,
            api_key=self.api_key,
            metrics=self.metrics,
            log=self.access_log,
            limits=self.limits,
            connections=lambda: len(self.connections),
        )
        return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, middleware=[cors, guard])

    def _model(self) -> dict:
        """The served model as both APIs describe one (OpenAI: ``object``,
        ``created``, ``owned_by``; Anthropic: ``type``, ``display_name``,
        ``created_at``); each client reads its own fields."""
        created = datetime.fromtimestamp(self.created, timezone.utc).isoformat().replace("+00:00", "Z")
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "redrafter-mlx",
            "type": "model",
            "display_name": self.model_name,
            "created_at": created,
            "context_length": self.context.max_context,
        }

    async def models(self, request: HTTPRequest) -> JSONResponse:
        """The model list, in OpenAI's shape and Anthropic's (a page of one)."""
        return JSONResponse(
            {
                "object": "list",
                "data": [self._model()],
                "has_more": False,
                "first_id": self.model_name,
                "last_id": self.model_name,
            }
        )

    async def model(self, request: HTTPRequest) -> JSONResponse:
        """One model by its id: this server answers requests naming any
        model with the one it serves, so it describes that one under any id."""
        return JSONResponse(dict(self._model(), id=request.path_params["model"]))

    async def hello(self, request: HTTPRequest) -> JSONResponse:
        """Clients' connectivity checks (``HEAD /``, Claude Code's ``HEAD /api/hello``)."""
        return JSONResponse({"status": "ok"})

    async def health(self, request: HTTPRequest) -> JSONResponse:
        health = self.scheduler.health()
        return JSONResponse(health, status_code=200 if health["status"] == "ok" else 503)

    async def metrics_page(self, request: HTTPRequest) -> PlainTextResponse:
        def gauges() -> dict:
            health = self.scheduler.health()
            return {
                "requests_running": health["running"],
                "requests_waiting": health["waiting"],
                "prompt_cache_bytes": self.scheduler.store.nbytes,
                "connections_open": len(self.connections),
                "prefill_share": self.scheduler.share.current,
            }

        return PlainTextResponse(self.metrics.text(gauges), media_type="text/plain; version=0.0.4")

    async def chat_completions(self, request: HTTPRequest):
        return await self._handle(request, openai_api.parse_chat, openai_api.OpenAIAnswer)

    async def completions(self, request: HTTPRequest):
        return await self._handle(request, openai_api.parse_completion, openai_api.OpenAIAnswer)

    async def responses(self, request: HTTPRequest):
        return await self._handle(request, responses_api.parse_response, responses_api.ResponsesAnswer)

    async def messages(self, request: HTTPRequest):
        return await self._handle(request, anthropic_api.parse_messages, anthropic_api.AnthropicAnswer)

    async def count_tokens(self, request: HTTPRequest):
        return await self._count(request, anthropic_api.count_tokens)

    async def input_tokens(self, request: HTTPRequest):
        return await self._count(request, responses_api.input_tokens)

    async def _count(self, request: HTTPRequest, count):
        path = request.url.path
        try:
            return JSONResponse(await asyncio.to_thread(count, await self._body(request), self.context))
        except BadRequest as e:
            return bad_request(path, e)
        except ClientDisconnect:
            return error_response(path, "the client went away", 400)

    async def _handle(self, request: HTTPRequest, parse, dialect):
        path = request.url.path
        try:
            # Rendered and tokenized on a worker thread: a prompt of megabytes
            # takes a second or more (the tokenizer lets go of the GIL), which
            # on the event loop would stall every other client's stream.
            job = await asyncio.to_thread(parse, await self._body(request), self.context)
        except BadRequest as e:
            return bad_request(path, e)
        except ClientDisconnect:
            return error_response(path, "the client went away", 400)
        self._fit(job)
        try:
            ticket = self.scheduler.submit(job.request, asyncio.get_running_loop())
        except Refused as e:
            self.metrics.add("rejected_total", reason=e.reason)
            if e.reason == "queue full":
                return error_response(
                    path,
                    "too many requests are waiting; retry shortly",
                    429,
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                )
            return error_response(path, "the server is shutting down", 503)
        if self.prompt_log is not None:
            self.prompt_log.add(job.logged)
        self.metrics.add("prompt_tokens_total", len(job.request.prompt))
        answer = dialect(
            Answer(self.tokenizer, job, ticket, self.scheduler, self.context.renderer.tools), self.model_name
        )
        if job.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                answer.stream(request, self.keep_alive), media_type="text/event-stream", headers=headers
            )
        status, body = await answer.whole(request)
        return JSONResponse(body, status_code=status)

    def _fit(self, job) -> None:
        """What every request gets alike: an answer that ends where the
        model's context does (a client may ask for more tokens than are
        left, as agents do) and at ``max_output_tokens``, the turn format's
        stop string (plain turns), and one note on the server's log per
        tool left out of prompts."""
        renderer, limit = self.context.renderer, self.context.max_context
        if limit:
            job.request.max_tokens = min(job.request.max_tokens, limit - len(job.request.prompt))
        if self.max_output_tokens:
            job.request.max_tokens = min(job.request.max_tokens, self.max_output_tokens)
        if job.kind != "completion":
            job.turn_ends = list(renderer.stop_strings)
        for name in job.left_out:
            if (
                name not in self.left_out and len(self.left_out) < MAX_NOTED_TOOLS
            ):  # clients name tools: the set is bounded
                self.left_out.add(name)
                print(
                    f"note: the tool {name!r} is left out of prompts: a hosted or deferred tool this server cannot run",
                    file=sys.stderr,
                )

    async def _body(self, request: HTTPRequest) -> dict:
        """The request's JSON object; a body over the limit (413), not in
        within the read timeout (408: a client sending a byte a second is
        cut off, having held no engine slot, as nothing is submitted before
        its body is parsed), not JSON, nested too deeply, or holding text
        that is not Unicode is a ``BadRequest``."""
        limit, timeout = self.limits.max_body_bytes, self.limits.read_timeout
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(f"request body over {limit} bytes", status=413)

        async def read() -> bytes:
            raw = bytearray()
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > limit:
                    raise BadRequest(f"request body over {limit} bytes", status=413)
            return bytes(raw)

        try:
            raw = await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            raise BadRequest(f"the request body did not arrive within {timeout:g} seconds", status=408) from None
        try:
            body = json.loads(raw)
            json.dumps(body, ensure_ascii=False).encode("utf-8")  # an unpaired surrogate escape ("\\ud800") cannot be
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON ({e})") from None
        except UnicodeEncodeError:
            raise BadRequest(
                "the request body holds a string that is not valid Unicode (an unpaired surrogate escape)"
            ) from None
        except RecursionError:
            raise BadRequest("the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body


def run_server(
    redrafter,
    tokenizer,
    draft,
    sock,
    model_name: str,
    *,
    max_batch: int = 8,
    max_tokens: int = 512,
    max_output_tokens: Optional[int] = None,
    cache_bytes: int = 0,
    limits: Limits = Limits(),
    prompt_log: Optional[PromptLog] = None,
    api_key: Optional[str] = None,
    max_queue: Optional[int] = None,
    shutdown_timeout: float = 30.0,
    keep_alive: float = KEEP_ALIVE_SECONDS,
    announce=print,
    access_log: bool = True,
    prefill_share: float = PREFILL_SHARE,
) -> None:
    """``redrafter-mlx serve``: start the engine thread (it measures or reads
    the cost curves first), then serve on the bound socket ``sock`` until
    interrupted or terminated; ``announce`` is told where, and each
    request's line of the access log (``access_log``).

    Each connection is a file descriptor: the process's soft limit on open
    files is raised to hold ``limits.max_connections`` of them and some to
    spare (macOS starts processes at 256); where its hard limit allows
    fewer, the connection bound is lowered to fit, and ``announce`` says so."""
    renderer = ChatRenderer(tokenizer)
    if renderer.describe():
        announce(f"note: {renderer.describe()}")
    files = allow_open_files(limits.max_connections + SPARE_FILES)
    if files < limits.max_connections + SPARE_FILES:
        bound = max(1, files - SPARE_FILES)
        announce(
            f"note: this process may open {files} files, so at most {bound} connections are served at once, not {limits.max_connections}"
        )
        limits = dataclasses.replace(limits, max_connections=bound)
    scheduler = Scheduler(
        redrafter, renderer.eos_token_ids, draft, max_batch, cache_bytes, max_queue, Metrics(), prefill_share
    )
    scheduler.start()
    server = Server(
        scheduler,
        renderer,
        model_name,
        max_tokens,
        redrafter.base.max_context,
        limits,
        prompt_log,
        api_key,
        keep_alive,
        announce if access_log else None,
        max_output_tokens,
    )
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    announce(
        f"serving {model_name} at http://{where}:{port} (/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models; /health, /metrics); Ctrl-C stops"
    )
    graceful = Graceful(uvicorn_config(server, shutdown_timeout + 5), scheduler, shutdown_timeout)
    server.connections = graceful.server_state.connections
    # uvicorn raises the signal again once it has shut down; answered by a
    # handler that does nothing, a SIGTERM ends the process with status 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        graceful.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        scheduler.stop()


def uvicorn_config(server: Server, graceful_seconds: float) -> uvicorn.Config:
    """uvicorn's settings for ``server``: its connections are ``Connection``
    (h11, whose buffer for a head stops at the head bound), closed idle
    ``IDLE_CONNECTION_SECONDS`` after an answer; ``graceful_seconds``: how
    long uvicorn waits for running requests on shutdown."""
    return uvicorn.Config(
        server.app(),
        log_level="warning",
        timeout_graceful_shutdown=graceful_seconds,
        http=functools.partial(Connection, server=server),
        timeout_keep_alive=IDLE_CONNECTION_SECONDS,
        h11_max_incomplete_event_size=server.limits.max_header_bytes,
    )


class Graceful(uvicorn.Server):
    """uvicorn's server, whose shutdown first closes the scheduler to new
    requests and, ``timeout`` seconds later, ends those still running."""

    def __init__(self, config, scheduler: Scheduler, timeout: float):
        super().__init__(config)
        self.scheduler, self.timeout = scheduler, timeout

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.scheduler.close()
            timer = threading.Timer(self.timeout, self.scheduler.end_all)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)
