"""The OpenAI Responses dialect: ``POST /v1/responses``, the protocol of
the OpenAI SDK's ``client.responses`` and of agent clients built on it.

A request's ``instructions`` and ``input`` items become the same chat
messages the chat route renders: a message item a message (``developer``
as ``system``: chat templates know that role), ``function_call`` items an
assistant's ``tool_calls`` (consecutive calls, and a call right after the
assistant's text, join one assistant message), a ``function_call_output``
item a ``tool`` message. Tools come flat (``{"type": "function", "name",
"parameters"}``), in ``namespace`` tools, or as ``custom`` tools of one
text input, and go through the chat route's tool machinery in its nested
form (``ToolName``). The answer is a Response whose ``output`` lists a
message item for the text and a ``function_call`` item per call (with its
``namespace``), or a ``custom_tool_call`` item, in the order the model
wrote them, whole or as the Responses event stream.

The server keeps nothing: ``store`` is answered false, and a request that
refers to stored state (``previous_response_id``, ``conversation``,
``prompt``) or asks to run in the ``background`` is refused with a 400.
"""

import json
import secrets
import time
from dataclasses import dataclass
from itertools import count
from typing import Optional

from . import openai_api
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
)
from .requests import (
    tool_choice as chat_tool_choice,
)
from .requests import (
    tool_list as chat_tool_list,
)
from .scheduler import Request

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")
LOGPROBS = "message.output_text.logprobs"  # the ``include`` entry that asks for log-probabilities
STATELESS = {
    "previous_response_id": "this server keeps no responses, so 'previous_response_id' cannot be used; send the whole conversation in 'input'",
    "conversation": "this server keeps no conversations, so 'conversation' cannot be used; send the whole conversation in 'input'",
    "prompt": "this server keeps no prompt templates, so 'prompt' cannot be used; send 'instructions' and 'input'",
}


def error_body(message: str, status: int, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """The Responses API answers errors in OpenAI's shape,
    ``{"error": {"message", "type", "param", "code"}}``."""
    return openai_api.error_body(message, status, param, code)


@dataclass(frozen=True)
class ToolName:
    """What a tool name the model sees stands for: a function (in a
    ``namespace`` tool, or none), or a ``custom`` tool, whose one text
    input the model writes as the argument ``input``."""

    name: str
    namespace: Optional[str] = None
    custom: bool = False

    @property
    def shown(self) -> str:
        """The name the model calls it by: a namespace's functions as
        ``namespace.name`` (unique beside the flat functions)."""
        return f"{self.namespace}.{self.name}" if self.namespace else self.name


CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


def _text(content, where: str) -> str:
    """A string, or the text of a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(
            f'\'{where}\' must be a string or a list of {{"type": "input_text", "text": ...}} parts', "input"
        )
    text = ""
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            text += part["text"]
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            text += part["refusal"]
        elif isinstance(kind, str) and kind not in TEXT_PARTS:
            raise BadRequest(
                f"'{where}[{j}]' is a {kind!r} part; this server takes text only ({', '.join(TEXT_PARTS)})", "input"
            )
        else:
            raise BadRequest(f'\'{where}[{j}]\' must be {{"type": "input_text", "text": a string}}', "input")
    return text


def _string(item: dict, key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise BadRequest(f"'{where}.{key}' must be a string", "input")
    return item[key]


def _namespace(item: dict, where: str) -> Optional[str]:
    """A call item's ``namespace`` (None or empty: none)."""
    namespace = item.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise BadRequest(f"'{where}.namespace' must be a string", "input")
    return namespace or None


def _call(call: dict, out: list) -> None:
    """An assistant's tool call joins the assistant message before it (a
    call right after the assistant's text, or after another call)."""
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def conversation(body: dict) -> list:
    """The instructions (a system message first) and the input items as
    chat messages, in the form the chat route hands its chat template.
    Reasoning items are left out: the model does not reason (and their
    content is encrypted for another model)."""
    out = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", "instructions")
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(
                f"'{where}' must be an object (a message, function_call or function_call_output item)", "input"
            )
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES:
                raise BadRequest(f"'{where}' must be a message with a 'role' of {', '.join(ROLES)}", "input")
            if "content" not in item:
                raise BadRequest(f"'{where}' needs a 'content'", "input")
            out.append({"role": ROLES[item["role"]], "content": _text(item["content"], f"{where}.content")})
        elif kind == "function_call":
            shown = ToolName(_string(item, "name", where), _namespace(item, where)).shown
            _call(
                {
                    "id": _string(item, "call_id", where),
                    "type": "function",
                    "function": {"name": shown, "arguments": _string(item, "arguments", where)},
                },
                out,
            )
        elif kind == "custom_tool_call":
            arguments = json.dumps({"input": _string(item, "input", where)}, ensure_ascii=False)
            shown = ToolName(_string(item, "name", where), _namespace(item, where)).shown
            _call(
                {
                    "id": _string(item, "call_id", where),
                    "type": "function",
                    "function": {"name": shown, "arguments": arguments},
                },
                out,
            )
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if "output" not in item:
                raise BadRequest(f"'{where}' needs an 'output'", "input")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _text(item["output"], f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise BadRequest(
                f"'{where}' is an item of type {json.dumps(kind)}, which this server does not take; it takes message, "
                "function_call, function_call_output, custom_tool_call, custom_tool_call_output and reasoning items",
                "input",
            )
    return out


def _function(tool: dict, where: str, name: ToolName) -> dict:
    """One function or custom tool in the chat route's nested form, named as the model sees it."""
    if name.custom:
        description = tool.get("description") or ""
        return {
            "type": "function",
            "function": {"name": name.shown, "description": description, "parameters": CUSTOM_PARAMETERS},
        }
    if not isinstance(tool.get("parameters", {}), (dict, type(None))):
        raise BadRequest(f"'{where}.parameters' must be a JSON schema object", "tools")
    return {
        "type": "function",
        "function": {
            "name": name.shown,
            "description": tool.get("description") or "",
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
        },
    }


def tool_list(value) -> tuple[Optional[list], dict, list]:
    """The Responses API's tools in the chat route's nested form: flat
    function tools, the functions of ``namespace`` tools (named
    ``namespace.name``), and ``custom`` tools (one text input, written as
    the argument ``input``). Returns (those tools, what each name the model
    sees stands for, the tools left out of the prompt: hosted tools such as
    ``web_search``, which this server cannot run)."""
    if value is None:
        return None, {}, []
    if not isinstance(value, list):
        raise BadRequest(
            '\'tools\' must be a list of {"type": "function", "name", "description", "parameters"}', "tools"
        )
    out, names, left_out = [], {}, []

    def add(tool, where: str, namespace: Optional[str] = None) -> None:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in ("function", "custom") or not isinstance(tool.get("name"), str):
            raise BadRequest(
                f'\'{where}\' must be {{"type": "function", "name", "description", "parameters"}} '
                '(flat: not nested under "function" as in chat completions)',
                "tools",
            )
        name = ToolName(tool["name"], namespace, kind == "custom")
        if name.shown in names:
            raise BadRequest(f"'{where}' repeats the tool name {name.shown!r}", "tools")
        names[name.shown] = name
        out.append(_function(tool, where, name))

    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":
            if not isinstance(tool.get("name"), str) or not isinstance(tool.get("tools"), list):
                raise BadRequest(
                    f'\'{where}\' must be {{"type": "namespace", "name", "tools": [function tools]}}', "tools"
                )
            for j, inner in enumerate(tool["tools"]):
                add(inner, f"{where}.tools[{j}]", tool["name"])
        elif isinstance(kind, str) and kind not in ("function", "custom"):
            left_out.append(kind)
        else:
            add(tool, where)
    return chat_tool_list(out), names, left_out


def shown_name(name: str, names: dict) -> str:
    """The name the model sees for a function a client named: a flat
    function's own, else a namespace's function of that name."""
    if name in names:
        return name
    return next((shown for shown, c in names.items() if c.name == name), name)


def allowed_tools(choice, tools: Optional[list], names: dict) -> Optional[list]:
    """The tools offered to the model: with ``tool_choice`` of type
    ``allowed_tools``, only those it lists (a function by its name, as
    ``shown_name`` finds it, or with its ``namespace``; a whole namespace)."""
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools" or tools is None:
        return tools
    listed = choice.get("tools")
    if not isinstance(listed, list) or not all(isinstance(t, dict) for t in listed):
        raise BadRequest(
            '\'tool_choice.tools\' must be a list of tools, such as {"type": "function", "name": ...}', "tool_choice"
        )
    allowed = set()
    for t in listed:
        name, namespace = t.get("name"), t.get("namespace")
        if t.get("type") == "namespace":
            allowed |= {shown for shown, c in names.items() if c.namespace == name}
        elif isinstance(name, str):
            allowed.add(ToolName(name, namespace).shown if isinstance(namespace, str) else shown_name(name, names))
    kept = [t for t in tools if t["function"]["name"] in allowed]
    return kept or None


def tool_choice(value):
    """The Responses ``tool_choice`` in the chat route's form (a named
    function: ``{"type": "function", "name"}`` there nests the name)."""
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") in ("function", "custom") and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    if isinstance(value, dict) and value.get("type") == "allowed_tools" and value.get("mode") in ("auto", "required"):
        return value["mode"]
    raise BadRequest(
        '\'tool_choice\' must be "auto", "none", "required" or {"type": "function", "name": ...}', "tool_choice"
    )


def _refuse_state(body: dict) -> None:
    """One clear 400 for what needs a server that keeps responses."""
    for name, message in STATELESS.items():
        if body.get(name) is not None:
            raise BadRequest(message, name)
    if flag(body, "background"):
        raise BadRequest(
            "'background' responses are not supported: this server keeps no responses; send the request without it",
            "background",
        )
    flag(body, "store", True)  # taken, but nothing is kept: the answer says "store": false


def _text_format(value) -> None:
    if value is None:
        return
    form = value.get("format") if isinstance(value, dict) else None
    if not isinstance(value, dict) or not (form is None or isinstance(form, dict)):
        raise BadRequest('\'text\' must be an object such as {"format": {"type": "text"}}', "text")
    if form is not None and form.get("type", "text") != "text":
        raise BadRequest(
            f"'text.format' {json.dumps(form.get('type'))} is not supported: this server answers in plain text only",
            "text",
        )


def _options(body: dict) -> None:
    """Fields that change nothing for a model that does not reason, on a
    server that keeps nothing: ``reasoning`` (effort, summary),
    ``prompt_cache_key`` (the prompt cache finds shared prefixes by
    itself), ``client_metadata``; checked for their shape only."""
    for name in ("reasoning", "client_metadata"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise BadRequest(f"'{name}' must be an object", name)
    if body.get("prompt_cache_key") is not None and not isinstance(body["prompt_cache_key"], str):
        raise BadRequest("'prompt_cache_key' must be a string", "prompt_cache_key")


def _logprobs(body: dict) -> tuple[Optional[int], Optional[int]]:
    """(``top_logprobs`` as sent, the alternatives to report per token or
    None when ``include`` does not ask for log-probabilities)."""
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(s, str) for s in include):
        raise BadRequest("'include' must be a list of strings", "include")
    top = number(body, "top_logprobs", None, low=0, high=20, integer=True)
    return top, ((top or 0) if LOGPROBS in include else None)


def render_prompt(body: dict, ctx: Context) -> tuple:
    """(token ids, messages, tools in the chat form, what each tool name
    stands for, tools left out, (calls allowed, named function, required))."""
    _refuse_state(body)
    _options(body)
    messages = conversation(body)
    tools, names, left_out = tool_list(body.get("tools"))
    tools = allowed_tools(body.get("tool_choice"), tools, names)
    choice = tool_choice(body.get("tool_choice"))
    if isinstance(choice, dict):
        choice["function"]["name"] = shown_name(choice["function"]["name"], names)
    allowed, name, required = chat_tool_choice(choice, tools)
    _text_format(body.get("text"))
    prompt = render(ctx, messages, tools if allowed else None, template_kwargs(body, ctx), "input")
    return prompt, messages, tools if allowed else None, names, left_out, (allowed, name, required)


def parse_response(body: dict, ctx: Context) -> Job:
    """A Responses request as a ``Job``: the chat route's rendering, tool
    forcing and sampling fields, with ``max_output_tokens`` as the limit;
    ``stop`` is taken too. What a request leaves out is what OpenAI's
    Responses API takes for it, unlike the chat route (mlx_lm.server's
    defaults): ``temperature`` 1, and an answer that runs to the end of the
    model's context, within the server's ``--max-output-tokens``. Codex sends
    neither."""
    prompt, messages, tools, names, left_out, (allowed, name, required) = render_prompt(body, ctx)
    check_context(prompt, ctx, "input")
    top, logprobs = _logprobs(body)
    settings = sampling(
        body, ctx, temperature=1.0, logprobs=logprobs, forced=forcing(ctx, required, name), prompt_length=len(prompt)
    )
    limit = max_tokens(body, ctx, ("max_output_tokens",))
    if body.get("max_output_tokens") is None and ctx.max_context:
        limit = ctx.max_context  # the server's ``_fit`` ends it where the context does
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BadRequest("'metadata' must be an object of strings", "metadata")
    sent = [
        t
        for t in body.get("tools") or []
        if isinstance(t, dict) and t.get("type") in ("function", "custom", "namespace")
    ]
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata,
        "parallel_tool_calls": flag(body, "parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": sent,
        "top_logprobs": top,
        "names": names,
    }
    return Job(
        Request(prompt, limit, settings),
        "responses",
        stop_strings(body.get("stop")),
        flag(body, "stream"),
        False,
        messages,
        tools if allowed else None,
        logprobs,
        left_out=left_out,
        echo=echo,
    )


def input_tokens(body: dict, ctx: Context) -> dict:
    """``POST /v1/responses/input_tokens``: the prompt's length, as the request would render it."""
    return {"object": "response.input_tokens", "input_tokens": len(render_prompt(body, ctx)[0])}


class Output:
    """A Response's ``output`` items, built as an answer's parts come.

    Text goes to the open message item (one is opened when text comes);
    each tool call closes it and becomes a ``function_call`` item, so text
    written after a call opens a new message. Every change comes back as
    the stream events that announce it, (type, data) pairs; a whole answer
    builds the same items and drops them. The log-probabilities of tokens
    that showed no text yet (held back as a possible call marker) go with
    the next text; those of a call's own tokens are dropped, as a call has
    no place for them.
    """

    def __init__(self, tokenizer, logprobs: bool, names: dict):
        """names: what each tool name the model calls stands for (``ToolName``)."""
        self.decode, self.logprobs, self.names = tokenizer.decode, logprobs, names
        self.items: list = []
        self.open: Optional[int] = None  # the output index of the message item text goes to
        self.pending: list = []

    def add(self, part: Part) -> list:
        events = []
        self.pending += part.logprobs
        if part.text:
            events += self._text(part.text)
        for call in part.calls:
            events += self._close("completed") + self._call(call)
            self.pending = []
        return events

    def finish(self, status: str) -> list:
        """Close the open message ("incomplete" when the answer was cut
        short); an answer with no items gets an empty message."""
        events = [] if self.items else self._text("")
        return events + self._close("incomplete" if status == "incomplete" else "completed")

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    def _text(self, text: str) -> list:
        events = []
        if self.open is None:
            self.open = len(self.items)
            item = {
                "type": "message",
                "id": f"msg_{secrets.token_hex(12)}",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            self.items.append(item)
            events.append(("response.output_item.added", {"output_index": self.open, "item": dict(item, content=[])}))
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events.append(
                (
                    "response.content_part.added",
                    self._where(part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}),
                )
            )
        logprobs = []
        if self.logprobs:
            logprobs = [
                dict(self._entry(t, lp), top_logprobs=[self._entry(i, v) for i, v in top])
                for t, lp, top in self.pending
            ]
        self.pending = []
        content = self.items[self.open]["content"][0]
        content["text"] += text
        content["logprobs"] += logprobs
        if text:
            events.append(("response.output_text.delta", self._where(delta=text, logprobs=logprobs)))
        return events

    def _where(self, **data) -> dict:
        return dict(item_id=self.items[self.open]["id"], output_index=self.open, content_index=0, **data)

    def _close(self, status: str) -> list:
        if self.open is None:
            return []
        item = self.items[self.open]
        content = item["content"][0]
        item["status"] = status
        events = [
            ("response.output_text.done", self._where(text=content["text"], logprobs=list(content["logprobs"]))),
            ("response.content_part.done", self._where(part=dict(content, logprobs=list(content["logprobs"])))),
            ("response.output_item.done", {"output_index": self.open, "item": dict(item)}),
        ]
        self.open = None
        return events

    def _call(self, call: dict) -> list:
        """A ``function_call`` item (with its ``namespace`` when the function
        is in one), or a ``custom_tool_call`` item, under the names the
        client gave the tool."""
        index = len(self.items)
        tool = self.names.get(call["name"], ToolName(call["name"]))
        item = {
            "type": "function_call",
            "id": f"fc_{call['id'].removeprefix('call_')}",
            "call_id": call["id"],
            "name": tool.name,
            "arguments": call["arguments"],
            "status": "completed",
        }
        if tool.namespace:
            item["namespace"] = tool.namespace
        where = {"item_id": item["id"], "output_index": index}
        if tool.custom:
            try:
                parsed = json.loads(call["arguments"])
            except json.JSONDecodeError:
                parsed = None
            # The model's one text argument; arguments written otherwise come as they are.
            text = parsed["input"] if isinstance(parsed, dict) and "input" in parsed else call["arguments"]
            item = dict(item, type="custom_tool_call", id=f"ctc_{call['id'].removeprefix('call_')}", input=str(text))
            del item["arguments"]
            where["item_id"] = item["id"]
            self.items.append(item)
            return [
                (
                    "response.output_item.added",
                    {"output_index": index, "item": dict(item, input="", status="in_progress")},
                ),
                ("response.custom_tool_call_input.delta", dict(where, delta=item["input"])),
                ("response.custom_tool_call_input.done", dict(where, input=item["input"])),
                ("response.output_item.done", {"output_index": index, "item": dict(item)}),
            ]
        self.items.append(item)
        return [
            (
                "response.output_item.added",
                {"output_index": index, "item": dict(item, arguments="", status="in_progress")},
            ),
            ("response.function_call_arguments.delta", dict(where, delta=call["arguments"])),
            ("response.function_call_arguments.done", dict(where, arguments=call["arguments"])),
            ("response.output_item.done", {"output_index": index, "item": dict(item)}),
        ]


class ResponsesAnswer:
    """An ``Answer`` as a Response, whole or as the Responses event stream."""

    def __init__(self, answer: Answer, model: str):
        self.answer, self.model = answer, model
        self.id = f"resp_{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.output = Output(answer.tokenizer, answer.job.logprobs is not None, answer.job.echo["names"])

    def _usage(self) -> dict:
        a = self.answer
        # cache_write_tokens (what a provider bills for storing a prompt) is 0: the prompt cache here is free.
        return {
            "input_tokens": a.prompt_tokens,
            "input_tokens_details": {"cached_tokens": a.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": a.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": a.prompt_tokens + a.completion_tokens,
        }

    def _response(self, status: str, error: Optional[dict] = None) -> dict:
        """The Response object; its output, usage and ``redrafter`` figures
        once the answer has ended (``status`` not "in_progress")."""
        echo, settings, done = self.answer.job.echo, self.answer.job.request.sampling, status != "in_progress"
        response = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": echo["instructions"],
            "max_output_tokens": echo["max_output_tokens"],
            "max_tool_calls": None,
            "metadata": echo["metadata"],
            "model": self.model,
            "output": list(self.output.items) if done else [],
            "parallel_tool_calls": echo["parallel_tool_calls"],
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": settings.temp,
            "text": {"format": {"type": "text"}},
            "tool_choice": echo["tool_choice"],
            "tools": echo["tools"],
            "top_logprobs": echo["top_logprobs"],
            "top_p": settings.top_p,
            "truncation": "disabled",
            "usage": self._usage() if done else None,
            "user": None,
        }
        if done:
            response["redrafter"] = self.answer.extension()
        return response

    def _status(self) -> str:
        return "incomplete" if self.answer.finish_reason == "length" else "completed"

    async def whole(self, request) -> tuple[int, dict]:
        """(HTTP status, body)."""
        async for part in self.answer.parts(request):
            self.output.add(part)
        a = self.answer
        if a.error is not None:
            return 500, error_body(a.error, 500)
        if a.finish_reason is None:
            return 400, error_body("the client went away", 400)
        status = self._status()
        self.output.finish(status)
        return 200, self._response(status)

    async def stream(self, request, keep_alive: Optional[float]):
        """response.created and response.in_progress; per output item
        response.output_item.added, then for a message
        response.content_part.added, response.output_text.delta as the text
        comes, response.output_text.done and response.content_part.done, for
        a function call response.function_call_arguments.delta and .done,
        for a custom tool's call response.custom_tool_call_input.delta and
        .done, and response.output_item.done; finally response.completed (or
        response.incomplete) with the whole Response and its usage. An
        engine failure ends it with an error event and response.failed;
        comments keep the connection alive while nothing comes."""
        numbers = count()

        def event(kind: str, data: dict) -> str:
            return f"event: {kind}\ndata: {json.dumps(dict(type=kind, **data, sequence_number=next(numbers)))}\n\n"

        yield event("response.created", {"response": self._response("in_progress")})
        yield event("response.in_progress", {"response": self._response("in_progress")})
        async for part in self.answer.parts(request, keep_alive):
            if part is KEEP_ALIVE:
                yield ": keep-alive\n\n"
                continue
            for kind, data in self.output.add(part):
                yield event(kind, data)
        a = self.answer
        if a.error is not None:
            yield event("error", {"code": "server_error", "message": a.error, "param": None})
            yield event(
                "response.failed", {"response": self._response("failed", {"code": "server_error", "message": a.error})}
            )
            return
        if a.finish_reason is None:
            return  # the client went away
        status = self._status()
        for kind, data in self.output.finish(status):
            yield event(kind, data)
        yield event(f"response.{status}", {"response": self._response(status)})
