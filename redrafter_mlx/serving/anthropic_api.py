"""The Anthropic Messages dialect: ``POST /v1/messages`` and
``/v1/messages/count_tokens``, the protocol of Claude Code and other agent
clients, with the beta API's system messages among ``messages``. A
conversation of text, ``tool_use`` and ``tool_result`` blocks becomes the
equivalent OpenAI-style conversation, which ``ChatRenderer`` renders (the
model's chat template, or a turn format); the answer comes back as content
blocks, whole or as Anthropic's event stream."""

import json
import secrets
from typing import Optional

from .answer import KEEP_ALIVE, Answer
from .requests import (
    BadRequest,
    Context,
    Job,
    check_context,
    flag,
    forcing,
    number,
    render,
    sampling,
    stop_strings,
    template_kwargs,
)
from .scheduler import Request

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "overloaded_error",
}


def error_body(message: str, status: int, tokens: Optional[int] = None, limit: Optional[int] = None) -> dict:
    """Anthropic's error shape; an over-long prompt in the words agent
    clients look for ("prompt is too long: N tokens > M maximum")."""
    if tokens is not None and limit is not None:
        message = f"prompt is too long: {tokens} tokens > {limit} maximum"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _text(value, where: str) -> str:
    """A string, or the text of a list of text blocks (their
    ``cache_control`` and ``citations`` change nothing here)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) for b in value):
        kinds = {b.get("type") for b in value} - {"text"}
        if kinds:
            raise BadRequest(
                f"'{where}' holds a {sorted(map(str, kinds))[0]!r} block; this model reads text only", "messages"
            )
        if all(isinstance(b.get("text"), str) for b in value):
            return "".join(b["text"] for b in value)
    raise BadRequest(f"'{where}' must be a string or a list of text blocks", where.split(".")[0].split("[")[0])


def _shown(messages: list, i: int) -> bool:
    """Whether system message ``i`` is still shown to the model: one with
    ``clear_at`` "next_user_message" is shown only until a user message
    follows it."""
    message = messages[i]
    if message.get("clear_at") not in (None, "never", "next_user_message"):
        raise BadRequest(f'\'messages[{i}].clear_at\' must be "never" or "next_user_message"', "messages")
    return message.get("clear_at") != "next_user_message" or not any(
        isinstance(m, dict) and m.get("role") == "user" for m in messages[i + 1 :]
    )


def conversation(body: dict) -> list:
    """The request's system prompt and messages as OpenAI-style messages:
    system messages among ``messages`` (the beta Messages API) stay where
    they are, ``tool_use`` blocks become an assistant's ``tool_calls``, each
    ``tool_result`` block a ``tool`` message; the thinking of earlier turns
    is left out, as the API leaves it out."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text(body["system"], "system")})
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise BadRequest(f"'{where}' must be an object with a 'role' of user, assistant or system", "messages")
        role, content = message["role"], message.get("content")
        if role == "system":
            if _shown(messages, i):
                out.append({"role": "system", "content": _text(content, f"{where}.content")})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
            raise BadRequest(f"'{where}.content' must be a string or a list of content blocks", "messages")
        text, calls = "", []
        for block in content:
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                text += block["text"]
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
                calls.append(
                    {
                        "id": str(block.get("id", "")),
                        "type": "function",
                        "function": {"name": block["name"], "arguments": block.get("input") or {}},
                    }
                )
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": str(block.get("tool_use_id", "")),
                        "content": _text(result, f"{where}.content"),
                    }
                )
            elif kind in ("image", "document"):
                raise BadRequest(f"'{where}.content' holds a {kind!r} block; this model reads text only", "messages")
            else:
                raise BadRequest(
                    f"'{where}.content' holds a block this server does not take ({kind!r}); "
                    "text, tool_use, tool_result and thinking are taken",
                    "messages",
                )
        if text or calls:
            message_out = {"role": role, "content": text}
            if calls:
                message_out["tool_calls"] = calls
            out.append(message_out)
    return out


def tool_list(value) -> tuple[Optional[list], list]:
    """Anthropic's ``tools`` ({"name", "description", "input_schema"}, the
    ``type`` "custom" or none) in OpenAI's form, and the names of those left
    out of the prompt: tools the API runs itself or defines itself (a
    ``type`` such as "web_search_20250305", with no ``input_schema``),
    which this server cannot run, and tools whose loading is deferred
    (``defer_loading``), which the API does not show the model either."""
    if value is None:
        return None, []
    if not isinstance(value, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in value):
        raise BadRequest('\'tools\' must be a list of {"name", "description", "input_schema"}', "tools")
    kept, left_out = [], []
    for i, tool in enumerate(value):
        if tool.get("type", "custom") != "custom" or tool.get("defer_loading") is True:
            left_out.append(tool["name"])
            continue
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict) or not isinstance(tool.get("description", ""), str):
            raise BadRequest(f"'tools[{i}]' needs an object 'input_schema' and a string 'description'", "tools")
        kept.append(
            {
                "type": "function",
                "function": {"name": tool["name"], "description": tool.get("description", ""), "parameters": schema},
            }
        )
    return kept or None, left_out


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
    raise BadRequest(
        '\'tool_choice\' must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or {"type": "tool", "name": one of \'tools\'}',
        "tool_choice",
    )


def render_prompt(body: dict, ctx: Context) -> tuple[list, list, Optional[list], tuple, list]:
    """(token ids, messages, the tools calls may be made to, the forced
    opening, the tools left out of the prompt)."""
    messages = conversation(body)
    tools, left_out = tool_list(body.get("tools"))
    allowed, name, required = tool_choice(body.get("tool_choice"), tools)
    prompt = render(ctx, messages, tools if allowed else None, template_kwargs(body, ctx))
    return prompt, messages, tools if allowed else None, forcing(ctx, required, name), left_out


THINKING = ("enabled", "adaptive", "disabled")
EDITS = ("clear_thinking_20251015", "clear_tool_uses_20250919")
CLEAR_TOOL_USES_TRIGGER = 100_000  # input tokens: the API's default trigger of clear_tool_uses


def check_options(body: dict, ctx: Context) -> None:
    """The fields that ask for a capability. Thinking (``thinking``), effort
    (``output_config.effort``), ``metadata`` and clearing earlier turns'
    thinking are served as the API serves a model that does not think: the
    answer is the same without them. What would change the answer if it
    were ignored is refused: a response format (structured output), MCP
    servers the server would have to call, and clearing tool results at a
    trigger the prompt can reach."""
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") not in THINKING):
        raise BadRequest(f"'thinking' must be {{\"type\": one of {', '.join(THINKING)}}}", "thinking")
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise BadRequest("'output_config' must be an object", "output_config")
    if (config or {}).get("format") is not None or body.get("output_format") is not None:
        raise BadRequest(
            "structured output ('output_config.format') is not supported: this server answers in free text",
            "output_config",
        )
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise BadRequest("'metadata' must be an object", "metadata")
    if body.get("mcp_servers"):
        raise BadRequest(
            "'mcp_servers' is not supported: this server calls no MCP servers; give their tools in 'tools'",
            "mcp_servers",
        )
    management = body.get("context_management")
    if management is None:
        return
    edits = management.get("edits", []) if isinstance(management, dict) else None
    if not isinstance(edits, list) or not all(isinstance(e, dict) and e.get("type") in EDITS for e in edits):
        raise BadRequest(
            f"'context_management.edits' must be a list of edits of type {' or '.join(EDITS)}", "context_management"
        )
    for edit in edits:
        trigger = edit.get("trigger") or {"type": "input_tokens", "value": CLEAR_TOOL_USES_TRIGGER}
        value = trigger.get("value") if isinstance(trigger, dict) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise BadRequest(
                '\'context_management.edits[].trigger\' must be {"type": ..., "value": a number}', "context_management"
            )
        if edit["type"] == "clear_tool_uses_20250919" and not (
            trigger.get("type") == "input_tokens" and ctx.max_context and value >= ctx.max_context
        ):
            raise BadRequest(
                "clearing tool results ('clear_tool_uses') before the model's context is full is not supported",
                "context_management",
            )


def parse_messages(body: dict, ctx: Context) -> Job:
    if body.get("max_tokens") is None:
        raise BadRequest("'max_tokens' is required", "max_tokens")
    check_options(body, ctx)
    prompt, messages, tools, forced, left_out = render_prompt(body, ctx)
    check_context(prompt, ctx, "messages")
    # Anthropic's default temperature is 1; its stop sequences are "stop_sequences".
    settings = sampling(body, ctx, temperature=1.0, forced=forced, prompt_length=len(prompt))
    limit = number(body, "max_tokens", ctx.max_tokens, low=1, integer=True)
    return Job(
        Request(prompt, limit, settings),
        "messages",
        stop_strings(body.get("stop_sequences"), "stop_sequences"),
        flag(body, "stream"),
        False,
        messages,
        tools,
        left_out=left_out,
        echo={"context_management": body.get("context_management")},
    )


def count_tokens(body: dict, ctx: Context) -> dict:
    check_options(body, ctx)
    prompt = render_prompt(body, ctx)[0]
    return {"input_tokens": len(prompt)}


class AnthropicAnswer:
    """An ``Answer`` as a Message, whole or as Anthropic's event stream."""

    def __init__(self, answer: Answer, model: str):
        self.answer, self.model = answer, model
        self.id = f"msg_{secrets.token_hex(12)}"

    def _message(self, content: list, stop_reason=None, stop_sequence=None, output_tokens: int = 0) -> dict:
        """The Message; ``input_tokens`` counts the prompt tokens not read
        from the prompt cache, as the API counts them (``cache_read_input_tokens``
        the others; the cache here costs nothing to write)."""
        a = self.answer
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": a.prompt_tokens - a.cached_tokens,
                "output_tokens": output_tokens,
                "cache_read_input_tokens": a.cached_tokens,
                "cache_creation_input_tokens": 0,
            },
        }
        if a.job.echo.get("context_management") is not None:
            message["context_management"] = {"applied_edits": []}
        if stop_reason is not None:
            message["redrafter"] = a.extension()
        return message

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
        content = ([{"type": "text", "text": part.text}] if part.text or not a.calls else []) + [
            self._tool_block(c) for c in a.calls
        ]
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
                yield event(
                    "content_block_delta",
                    {"index": index, "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
                )
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
        usage = self._message([], output_tokens=a.completion_tokens)["usage"]
        yield event(
            "message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": usage}
        )
        yield event("message_stop", {})
