"""Tool calling: rendering a conversation with tools through the model's own
chat template, and finding the tool calls in what the model writes, with
mlx-lm's parser for the model's family (``mlx_lm.tool_parsers``).

The model writes a call between its family's markers (``tool_call_start``
and ``tool_call_end``, for example ``<tool_call>`` and ``</tool_call>``).
``ToolCallText`` reads the answer as it streams: text outside the markers
is content, held back while it could be the start of a marker, so a call's
text never leaks into the content; each complete call is parsed and handed
over as ``{"name", "arguments"}``.
"""

import json
from typing import Optional

from ..errors import UserError
from .stop_strings import held_back


def supports_tools(tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_tool_calling", False))


def family(tokenizer) -> Optional[str]:
    parser = getattr(tokenizer, "tool_parser", None)
    return parser.__module__.rsplit(".", 1)[-1] if parser is not None else None


def forced_opening(tokenizer, name: Optional[str]) -> list:
    """The token ids an answer must begin with when a tool call is required
    (``tool_choice`` "required": the call's opening marker; a named function:
    the marker and, for the families whose calls name the function first,
    the text up to its arguments). One clear error where a named function
    cannot be forced for this family."""
    start = tokenizer.tool_call_start
    if name is None:
        text = start
    elif family(tokenizer) == "json_tools":
        text = f'{start}\n{{"name": "{name}", "arguments": '
    elif family(tokenizer) == "qwen3_coder":
        text = f"{start}\n<function={name}>\n"
    else:
        raise UserError(f"a named tool_choice is not supported for this model's tool-call format ({family(tokenizer)}); use \"required\"")
    return tokenizer.encode(text, add_special_tokens=False)


def template_messages(messages: list) -> list:
    """Chat messages as chat templates read them: a tool call's arguments as
    a mapping (OpenAI sends them as a JSON string)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = dict(message, tool_calls=[_template_call(c) for c in calls])
        out.append(message)
    return out


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # left as the string it is
    return dict(call, function=function)


class ToolCallText:
    """Splits an answer's text, as it streams, into content and tool calls.

    ``add(text)`` returns the content that may be shown now; complete calls
    gather in ``calls`` (each ``{"name", "arguments"}``, arguments a mapping
    or what the parser gave); ``finish()`` ends the answer, parsing a call
    left open (a family whose calls end with the answer). A call the parser
    cannot read is dropped, as mlx-lm's server drops it.
    """

    def __init__(self, tokenizer, tools: Optional[list]):
        self.start = tokenizer.tool_call_start
        self.end = tokenizer.tool_call_end
        self.parse = tokenizer.tool_parser
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
                self._parse(self.pending[:at])
                self.pending, self.inside = self.pending[at + len(self.end) :], False
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
        """The content still held back; a call left open is parsed."""
        if self.inside:
            self._parse(self.pending)
            self.pending, self.inside = "", False
        shown, self.pending = self.pending, ""
        return shown

    def _parse(self, text: str) -> None:
        try:
            parsed = self.parse(text, self.tools)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                self.calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
