"""The Anthropic Messages dialect: ``POST /v1/messages`` and
``/v1/messages/count_tokens``, the protocol of Claude Code and other agent
clients. A conversation of text, ``tool_use`` and ``tool_result`` blocks is
rendered through the model's chat template as the equivalent OpenAI-style
conversation; the answer comes back as content blocks, whole or as
Anthropic's event stream."""

import json
import secrets
from typing import Optional

from .answer import KEEP_ALIVE, Answer
from .requests import BadRequest, Context, Job, check_context, flag, forcing, number, render, sampling, stop_strings, template_kwargs
from .scheduler import Request

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}


def error_body(message: str, status: int, tokens: Optional[int] = None, limit: Optional[int] = None) -> dict:
    """Anthropic's error shape; an over-long prompt in the words agent
    clients look for ("prompt is too long: N tokens > M maximum")."""
    if tokens is not None and limit is not None:
        message = f"prompt is too long: {tokens} tokens > {limit} maximum"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _text(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in value):
        return "".join(b["text"] for b in value)
    raise BadRequest(f"'{where}' must be a string or a list of text blocks", where.split(".")[0].split("[")[0])


def conversation(body: dict) -> list:
    """The request's system prompt and messages as OpenAI-style messages:
    ``tool_use`` blocks become an assistant's ``tool_calls``, each
    ``tool_result`` block a ``tool`` message."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text(body["system"], "system")})
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise BadRequest(f"'{where}' must be an object with a 'role' of user or assistant", "messages")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
            raise BadRequest(f"'{where}.content' must be a string or a list of content blocks", "messages")
        text, calls = "", []
        for block in content:
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                text += block["text"]
            elif kind == "tool_use" and message["role"] == "assistant" and isinstance(block.get("name"), str):
                calls.append({"id": str(block.get("id", "")), "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and message["role"] == "user":
                result = block.get("content", "")
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": _text(result, f"{where}.content")})
            else:
                raise BadRequest(f"'{where}.content' holds a block this server does not take ({kind!r}); text, tool_use and tool_result are taken", "messages")
        if text or calls:
            message_out = {"role": message["role"], "content": text}
            if calls:
                message_out["tool_calls"] = calls
            out.append(message_out)
    return out


def tool_list(value) -> Optional[list]:
    """Anthropic's ``tools`` ({"name", "description", "input_schema"}) in OpenAI's form."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in value):
        raise BadRequest("'tools' must be a list of {\"name\", \"description\", \"input_schema\"}", "tools")
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {"type": "object"})}} for t in value] or None


def tool_choice(value, tools: Optional[list]) -> tuple:
    """(calls allowed, required function or None, a call required)."""
    if value is None:
        return tools is not None, None, False
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "auto":
        return tools is not None, None, False
    if kind == "none":
        return False, None, False
    if kind == "any" and tools:
        return True, None, True
    if kind == "tool" and tools and value.get("name") in {t["function"]["name"] for t in tools}:
        return True, value["name"], True
    raise BadRequest("'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or {\"type\": \"tool\", \"name\": one of 'tools'}", "tool_choice")


def render_prompt(body: dict, ctx: Context) -> tuple[list, list, Optional[list], tuple]:
    """(token ids, messages, the tools calls may be made to, the forced opening)."""
    messages = conversation(body)
    tools = tool_list(body.get("tools"))
    allowed, name, required = tool_choice(body.get("tool_choice"), tools)
    prompt = render(ctx, messages, tools if allowed else None, template_kwargs(body))
    return prompt, messages, tools if allowed else None, forcing(ctx, required, name)


def parse_messages(body: dict, ctx: Context) -> Job:
    if body.get("max_tokens") is None:
        raise BadRequest("'max_tokens' is required", "max_tokens")
    prompt, messages, tools, forced = render_prompt(body, ctx)
    check_context(prompt, ctx, "messages")
    # Anthropic's default temperature is 1; its stop sequences are "stop_sequences".
    settings = sampling(body, ctx, temperature=1.0, forced=forced, prompt_length=len(prompt))
    limit = number(body, "max_tokens", ctx.max_tokens, low=1, integer=True)
    return Job(Request(prompt, limit, settings), "messages", stop_strings(body.get("stop_sequences"), "stop_sequences"),
               flag(body, "stream"), False, messages, tools)


def count_tokens(body: dict, ctx: Context) -> dict:
    prompt, _, _, _ = render_prompt(body, ctx)
    return {"input_tokens": len(prompt)}


class AnthropicAnswer:
    """An ``Answer`` as a Message, whole or as Anthropic's event stream."""

    def __init__(self, answer: Answer, model: str):
        self.answer, self.model = answer, model
        self.id = f"msg_{secrets.token_hex(12)}"

    def _message(self, content: list, stop_reason=None, stop_sequence=None, output_tokens: int = 0) -> dict:
        a = self.answer
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": a.prompt_tokens, "output_tokens": output_tokens,
                          "cache_read_input_tokens": a.cached_tokens}}

    @staticmethod
    def _tool_block(call: dict) -> dict:
        try:
            arguments = json.loads(call["arguments"]) if call["arguments"] else {}
        except json.JSONDecodeError:
            arguments = {"arguments": call["arguments"]}
        return {"type": "tool_use", "id": f"toolu_{call['id'][5:]}", "name": call["name"], "input": arguments}

    def _stop(self) -> tuple:
        a = self.answer
        if a.finish_reason == "stop" and a.stop_sequence is not None:
            return "stop_sequence", a.stop_sequence
        return STOP_REASONS.get(a.finish_reason, "end_turn"), None

    async def whole(self, request) -> tuple[int, dict]:
        part, failure = await self.answer.whole_or_failure(request)
        if failure is not None:
            return failure[0], error_body(failure[1], failure[0])
        a = self.answer
        content = ([{"type": "text", "text": part.text}] if part.text or not a.calls else []) + [self._tool_block(c) for c in a.calls]
        return 200, self._message(content, *self._stop(), a.completion_tokens)

    async def stream(self, request, keep_alive: Optional[float]):
        """message_start, then per content block content_block_start,
        content_block_delta (text_delta or input_json_delta) and
        content_block_stop, with pings while nothing comes; message_delta
        with the stop reason and usage; message_stop."""

        def event(kind: str, data: dict) -> str:
            return f"event: {kind}\ndata: {json.dumps(dict(data, type=kind))}\n\n"

        yield event("message_start", {"message": self._message([])})
        index, text_open = 0, False
        async for part in self.answer.parts(request, keep_alive):
            if part is KEEP_ALIVE:
                yield event("ping", {})
                continue
            if part.text:
                if not text_open:
                    yield event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                    text_open = True
                yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": part.text}})
            for call in part.calls:
                if text_open:
                    yield event("content_block_stop", {"index": index})
                    index, text_open = index + 1, False
                block = self._tool_block(call)
                yield event("content_block_start", {"index": index, "content_block": dict(block, input={})})
                yield event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
                yield event("content_block_stop", {"index": index})
                index += 1
        a = self.answer
        if a.error is not None:
            yield event("error", {"error": error_body(a.error, 500)["error"]})
            return
        if a.finish_reason is None:
            return  # the client went away
        if text_open:
            yield event("content_block_stop", {"index": index})
        stop_reason, stop_sequence = self._stop()
        yield event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                      "usage": {"output_tokens": a.completion_tokens}})
        yield event("message_stop", {})
