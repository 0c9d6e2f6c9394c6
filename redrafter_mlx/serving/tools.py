"""Tool calling: the syntax a model writes calls in, offering tools in it,
and finding the calls in what the model writes.

A model whose chat template renders tools writes calls in its family's
syntax, read with mlx-lm's parser for that family (``mlx_lm.tool_parsers``).
Any other model is offered tools in a generic syntax (``GENERIC_TOOLS``,
the one mlx-lm's ``json_tools`` parser reads): the tools are described in
the system message, and past calls and their results are written into the
conversation as text (``with_generic_tools``).

The model writes a call between its syntax's markers (``start`` and
``end``, for example ``<tool_call>`` and ``</tool_call>``).
``ToolCallText`` reads the answer as it streams: text outside the markers
is content, held back while it could be the start of a marker, so a call's
text never leaks into the content; each complete call is parsed and handed
over as ``{"name", "arguments"}``.
"""

import json
from dataclasses import dataclass
from typing import Callable, Optional

from mlx_lm.tool_parsers import json_tools

from ..errors import UserError
from .stop_strings import held_back


@dataclass(frozen=True)
class ToolFormat:
    """How the model writes a tool call: between ``start`` and ``end``
    (``end`` empty: the call runs to the end of the answer), read by
    ``parse(text, tools)``. family: mlx-lm's name for the syntax
    (``json_tools``, ``qwen3_coder``, ...)."""

    start: str
    end: str
    parse: Callable
    family: Optional[str]


GENERIC_TOOLS = ToolFormat(
    json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call, "json_tools"
)


def native_tools(tokenizer) -> Optional[ToolFormat]:
    """The tool syntax the tokenizer's chat template renders (as mlx-lm
    infers it), or None."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    parser = tokenizer.tool_parser
    return ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, parser, parser.__module__.rsplit(".", 1)[-1])


def tool_prelude(tools: list) -> str:
    """The system text that offers ``tools`` (OpenAI's nested form) in the
    generic syntax."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You can call the tools listed below. To call one, write the call and nothing after it:\n"
        f'{GENERIC_TOOLS.start}\n{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n{GENERIC_TOOLS.end}\n'
        "Several calls may follow one another. Each result comes back in a <tool_response> block. "
        "When no tool is needed, answer in plain text.\n\n"
        f"Tools, one JSON object each:\n{listed}"
    )


def _arguments(call: dict):
    arguments = (call.get("function") or {}).get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return arguments if arguments is not None else {}


def with_generic_tools(messages: list, tools: Optional[list]) -> list:
    """The conversation with tools in the generic syntax, as plain chat
    messages: the tools' description joins the leading system message (one
    is made), an assistant's calls are written into its text, and tool
    results become a user message of ``<tool_response>`` blocks (results in
    a row, and a user message right after them, join one message)."""
    out, results = [], False  # results: the last message is tool results, which more may join
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        if message.get("tool_calls"):
            calls = [
                json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)}, ensure_ascii=False)
                for c in message["tool_calls"]
            ]
            written = "\n".join(f"{GENERIC_TOOLS.start}\n{c}\n{GENERIC_TOOLS.end}" for c in calls)
            content = f"{content}\n{written}" if content else written
        if role == "user" and results:
            out[-1]["content"] += "\n\n" + content
        else:
            out.append({"role": role, "content": content})
        results = False
    if tools:
        prelude = tool_prelude(tools)
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{prelude}")
        else:
            out.insert(0, {"role": "system", "content": prelude})
    return out


def forced_opening(tokenizer, syntax: ToolFormat, name: Optional[str]) -> list:
    """The token ids an answer must begin with when a tool call is required
    (``tool_choice`` "required": the call's opening marker; a named function:
    the marker and, for the syntaxes whose calls name the function first,
    the text up to its arguments). One clear error where a named function
    cannot be forced in this syntax."""
    if name is None:
        text = syntax.start
    elif syntax.family == "json_tools":
        text = f'{syntax.start}\n{{"name": "{name}", "arguments": '
    elif syntax.family == "qwen3_coder":
        text = f"{syntax.start}\n<function={name}>\n"
    else:
        raise UserError(
            f'a named tool_choice is not supported for this model\'s tool-call format ({syntax.family}); use "required"'
        )
    return tokenizer.encode(text, add_special_tokens=False)


def template_messages(messages: list) -> list:
    """Chat messages as chat templates read them: a tool call's arguments as
    a mapping (OpenAI sends them as a JSON string)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = dict(
                message,
                tool_calls=[dict(c, function=dict(c.get("function") or {}, arguments=_arguments(c))) for c in calls],
            )
        out.append(message)
    return out


class ToolCallText:
    """Splits an answer's text, as it streams, into content and tool calls.

    ``add(text)`` returns the content that may be shown now, up to the end
    of the first call it completes (the rest waits for the next ``add``,
    which may be ``add("")``); complete calls gather in ``calls`` (each
    ``{"name", "arguments"}``, arguments a mapping or what the parser gave); ``finish()`` ends the answer, parsing a call
    left open (a family whose calls end with the answer). Text the parser
    cannot read as a call (one cut at the answer's length, or the markers
    written in prose) is content, as it was written.
    """

    def __init__(self, syntax: ToolFormat, tools: Optional[list]):
        self.start, self.end, self.parse = syntax.start, syntax.end, syntax.parse
        self.tools = tools
        self.pending = ""  # text not yet shown: a possible marker's start, or a call
        self.inside = False
        self.calls: list = []

    def add(self, text: str) -> str:
        self.pending += text
        shown = ""
        while True:
            if self.inside:
                if not self.end:
                    return shown
                at = self.pending.find(self.end)
                if at < 0:
                    return shown
                called = self._parse(self.pending[:at])
                if not called:  # not a call after all: shown as it was written
                    shown += self.start + self.pending[: at + len(self.end)]
                self.pending, self.inside = self.pending[at + len(self.end) :], False
                if called:  # what follows a call is read by the next ``add``, so the caller can keep the order
                    return shown
            else:
                at = self.pending.find(self.start)
                if at < 0:
                    hold = held_back(self.pending, [self.start])
                    shown += self.pending[: len(self.pending) - hold]
                    self.pending = self.pending[len(self.pending) - hold :]
                    return shown
                shown += self.pending[:at]
                self.pending, self.inside = self.pending[at + len(self.start) :], True

    def finish(self) -> str:
        """The content still held back. A call left open is parsed; one cut
        before it could be (the answer reached its length) is shown as text,
        so nothing the model wrote is lost."""
        if self.inside:
            if not self._parse(self.pending):
                self.pending = self.start + self.pending
            else:
                self.pending = ""
            self.inside = False
        shown, self.pending = self.pending, ""
        return shown

    def _parse(self, text: str) -> bool:
        """Adds the calls ``text`` holds; False when it holds none."""
        try:
            parsed = self.parse(text, self.tools)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return False
        found = [
            call
            for call in (parsed if isinstance(parsed, list) else [parsed])
            if isinstance(call, dict) and isinstance(call.get("name"), str)
        ]
        self.calls += [{"name": call["name"], "arguments": call.get("arguments", {})} for call in found]
        return bool(found)
