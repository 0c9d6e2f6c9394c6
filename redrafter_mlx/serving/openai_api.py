"""The OpenAI dialect: ``/v1/chat/completions`` and ``/v1/completions``,
their request fields (those of the OpenAI API and of mlx_lm.server) and
their responses, whole or streamed as server-sent events."""

import json
import secrets
import time
from typing import Optional

from ..engine.sampling import SamplingSettings
from .answer import KEEP_ALIVE, Answer, Part
from .requests import (
    BadRequest,
    Context,
    Job,
    check_context,
    flag,
    forcing,
    max_tokens,
    number,
    render,
    sampling,
    stop_strings,
    template_kwargs,
    tool_choice,
    tool_list,
)
from .scheduler import Request

ROLES = ("system", "user", "assistant", "tool", "developer")


def error_body(message: str, status: int, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    kind = {401: "authentication_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(status, kind)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _text(content, where: str) -> Optional[str]:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"'{where}.content' must be a string or a list of text parts", "messages")


def conversation(body: dict) -> list:
    """The messages, checked: roles, text content, an assistant's
    ``tool_calls`` and a tool's result (``role`` "tool")."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRequest(f"'{where}' must be an object with a 'role' of {', '.join(ROLES)}", "messages")
        checked = {"role": message["role"], "content": _text(message.get("content"), where) or ""}
        calls = message.get("tool_calls")
        if calls is not None:
            ok = isinstance(calls, list) and all(
                isinstance(c, dict)
                and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                for c in calls
            )
            if not ok or message["role"] != "assistant":
                raise BadRequest(
                    f'\'{where}.tool_calls\' must be an assistant\'s list of {{"id", "type", "function": {{"name", "arguments"}}}}',
                    "messages",
                )
            checked["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                checked[key] = message[key]
        out.append(checked)
    return out


def parse_chat(body: dict, ctx: Context) -> Job:
    messages = conversation(body)
    tools = tool_list(body.get("tools"))
    allowed, name, required = tool_choice(body.get("tool_choice"), tools)
    prompt = render(ctx, messages, tools if allowed else None, template_kwargs(body, ctx))
    check_context(prompt, ctx, "messages")
    top = None
    if flag(body, "logprobs"):
        top = number(body, "top_logprobs", 0, low=0, high=20, integer=True)
    settings = sampling(body, ctx, logprobs=top, forced=forcing(ctx, required, name), prompt_length=len(prompt))
    return _job(body, ctx, prompt, settings, "chat", messages, tools if allowed else None, top)


def parse_completion(body: dict, ctx: Context) -> Job:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        prompt = ctx.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < ctx.vocab_size for t in prompt):
            raise BadRequest(f"'prompt' token ids must be in [0, {ctx.vocab_size})", "prompt")
        prompt = list(prompt)
    else:
        raise BadRequest("'prompt' must be a string, a list of one string, or a list of token ids", "prompt")
    check_context(prompt, ctx, "prompt")
    top = number(body, "logprobs", None, low=0, high=20, integer=True)
    settings = sampling(body, ctx, logprobs=top)
    return _job(body, ctx, prompt, settings, "completion", prompt, None, top)


def _job(
    body: dict, ctx: Context, prompt: list, settings: SamplingSettings, kind: str, logged: list, tools, top
) -> Job:
    if number(body, "n", 1, integer=True) != 1:
        raise BadRequest("only 'n' = 1 is supported", "n")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    return Job(
        Request(prompt, max_tokens(body, ctx), settings),
        kind,
        stop_strings(body.get("stop")),
        flag(body, "stream"),
        options.get("include_usage", False),
        logged,
        tools,
        top,
    )


class OpenAIAnswer:
    """An ``Answer`` in the OpenAI dialect, whole or as a stream."""

    def __init__(self, answer: Answer, model: str):
        self.answer, self.model = answer, model
        self.id = f"{'chatcmpl' if answer.job.kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}"
        self.chat = answer.job.kind == "chat"

    def usage(self) -> dict:
        a = self.answer
        return {
            "prompt_tokens": a.prompt_tokens,
            "completion_tokens": a.completion_tokens,
            "total_tokens": a.prompt_tokens + a.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": a.cached_tokens},
        }

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": int(time.time()), "model": self.model}

    def _logprobs(self, part: Part) -> Optional[dict]:
        if self.answer.job.logprobs is None:
            return None
        decode = self.answer.tokenizer.decode
        if self.chat:

            def entry(token, logprob):
                text = decode([token])
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

            return {
                "content": [
                    dict(entry(t, lp), top_logprobs=[entry(i, v) for i, v in top]) for t, lp, top in part.logprobs
                ]
            }
        return {
            "tokens": [decode([t]) for t, _, _ in part.logprobs],
            "token_logprobs": [lp for _, lp, _ in part.logprobs],
            "top_logprobs": [{decode([i]): v for i, v in top} for _, _, top in part.logprobs],
        }

    def _calls(self, calls: list, streaming: bool, first: int = 0) -> list:
        made = []
        for index, call in enumerate(calls, first):
            entry = {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            made.append(dict(entry, index=index) if streaming else entry)
        return made

    async def whole(self, request) -> tuple[int, dict]:
        """(HTTP status, body)."""
        part, failure = await self.answer.whole_or_failure(request)
        if failure is not None:
            return failure[0], error_body(failure[1], failure[0])
        a = self.answer
        if self.chat:
            message = {"role": "assistant", "content": part.text or (None if a.calls else "")}
            if a.calls:
                message["tool_calls"] = self._calls(a.calls, False)
            choice = {
                "index": 0,
                "message": message,
                "finish_reason": a.finish_reason,
                "logprobs": self._logprobs(part),
            }
        else:
            choice = {"index": 0, "text": part.text, "finish_reason": a.finish_reason, "logprobs": self._logprobs(part)}
        return 200, dict(self._envelope(False), choices=[choice], usage=self.usage(), redrafter=a.extension())

    async def stream(self, request, keep_alive: Optional[float]):
        """Server-sent events: the text as it comes (tool calls as deltas
        with their id and name, then their arguments), the finish reason,
        the usage when asked for, and [DONE]; comments keep a connection
        alive while the request waits or prefills."""

        def event(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"

        if self.chat:
            yield event(
                dict(
                    self._envelope(True),
                    choices=[
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                            "logprobs": None,
                        }
                    ],
                )
            )
        calls = 0
        async for part in self.answer.parts(request, keep_alive):
            if part is KEEP_ALIVE:
                yield ": keep-alive\n\n"
                continue
            if not self.chat:
                yield event(
                    dict(
                        self._envelope(True),
                        choices=[
                            {"index": 0, "text": part.text, "finish_reason": None, "logprobs": self._logprobs(part)}
                        ],
                    )
                )
                continue
            if part.text or part.logprobs:
                delta = {"content": part.text} if part.text else {}
                yield event(
                    dict(
                        self._envelope(True),
                        choices=[{"index": 0, "delta": delta, "finish_reason": None, "logprobs": self._logprobs(part)}],
                    )
                )
            for call in self._calls(part.calls, True, calls):
                opening = dict(call, function={"name": call["function"]["name"], "arguments": ""})
                yield event(
                    dict(
                        self._envelope(True),
                        choices=[
                            {"index": 0, "delta": {"tool_calls": [opening]}, "finish_reason": None, "logprobs": None}
                        ],
                    )
                )
                arguments = {"index": call["index"], "function": {"arguments": call["function"]["arguments"]}}
                yield event(
                    dict(
                        self._envelope(True),
                        choices=[
                            {"index": 0, "delta": {"tool_calls": [arguments]}, "finish_reason": None, "logprobs": None}
                        ],
                    )
                )
            calls += len(part.calls)
        a = self.answer
        if a.error is not None:
            yield event(error_body(a.error, 500))
            return
        if a.finish_reason is None:
            return  # the client went away
        final = (
            {"index": 0, "delta": {}, "finish_reason": a.finish_reason, "logprobs": None}
            if self.chat
            else {"index": 0, "text": "", "finish_reason": a.finish_reason, "logprobs": None}
        )
        yield event(dict(self._envelope(True), choices=[final], redrafter=a.extension()))
        if a.job.include_usage:
            yield event(dict(self._envelope(True), choices=[], usage=self.usage()))
        yield "data: [DONE]\n\n"
