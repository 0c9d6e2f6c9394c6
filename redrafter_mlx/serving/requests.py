"""Request bodies, checked and turned into what the engine runs: the prompt's
token ids (a conversation rendered through the chat template, with its
tools), the sampling settings, and how the answer is to be returned.

Both API dialects (OpenAI's and Anthropic's) end in a ``Job``; each checks
its own fields and shares the checks here. A bad field is a ``BadRequest``
naming it, which the server answers with a 400 in the dialect's error shape.
"""

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Optional

from ..engine.sampling import MASK64, SamplingSettings
from ..errors import UserError
from .chat_format import ChatRenderer
from .scheduler import Request
from .tools import forced_opening


class BadRequest(Exception):
    """status: the HTTP status; param: the field at fault; code: a machine
    code (OpenAI's ``context_length_exceeded``); tokens, limit: with it, the
    prompt's length and the model's context."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400, code: Optional[str] = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code
        self.tokens = self.limit = None


@dataclass
class Job:
    """A checked request: what to generate and how to answer.

    kind: "chat", "completion", "responses" or "messages" (Anthropic). logged: what a
    prompt log keeps. tools: the request's tools in OpenAI's form (None:
    none, or ``tool_choice`` "none"); their calls are then read from the
    answer. logprobs: None, or how many alternatives to report per token.
    left_out: the tools left out of the prompt, by name or type (hosted tools
    this server cannot run, and tools whose loading the client deferred).
    echo: what the answer repeats of the request.
    turn_ends: text that ends the model's turn where the turn format has no
    token for it (plain turns): the answer stops there as at its end, not
    as at a client's stop sequence.
    """

    request: Request
    kind: str
    stops: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logged: list = field(default_factory=list)
    tools: Optional[list] = None
    logprobs: Optional[int] = None
    left_out: list = field(default_factory=list)
    echo: dict = field(default_factory=dict)
    turn_ends: list = field(default_factory=list)


@dataclass
class Context:
    """What parsing needs from the server: the tokenizer and how it renders
    conversations, the vocabulary's size, the model's context (None:
    unknown) and the default answer length."""

    tokenizer: object
    vocab_size: int
    max_context: Optional[int]
    max_tokens: int
    renderer: ChatRenderer


def number(body: dict, name: str, default, low=None, high=None, integer=False, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(value)}", name)
    if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
        bounds = (
            f"{'>' if low_open else '>='} {low}" if high is None else f"in {'(' if low_open else '['}{low}, {high}]"
        )
        raise BadRequest(f"'{name}' must be {bounds}, got {value}", name)
    return value


def flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false", name)
    return value


def stop_strings(value, name: str = "stop") -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise BadRequest(f"'{name}' must be a string or a list of strings", name)


def logit_bias(value, vocab_size: int) -> dict:
    if value is None:
        return {}
    try:
        if not isinstance(value, dict):
            raise ValueError
        table = {int(k): float(v) for k, v in value.items()}
    except (TypeError, ValueError):
        raise BadRequest("'logit_bias' must map token ids to numbers", "logit_bias") from None
    if any(not 0 <= k < vocab_size for k in table):
        raise BadRequest(f"'logit_bias' token ids must be in [0, {vocab_size})", "logit_bias")
    return table


def sampling(
    body: dict,
    ctx: Context,
    temperature: float = 0.0,
    logprobs: Optional[int] = None,
    forced: tuple = (),
    prompt_length: int = 0,
) -> SamplingSettings:
    """The sampling fields mlx_lm.server takes (``temperature``: its default
    here), as ``SamplingSettings``."""
    seed = number(body, "seed", None, integer=True)
    penalty = number(body, "repetition_penalty", None, low=0)
    try:
        return SamplingSettings(
            temp=number(body, "temperature", temperature, low=0),
            top_p=number(body, "top_p", 1.0, low=0, high=1, low_open=True),
            top_k=number(body, "top_k", 0, low=0, integer=True),
            min_p=number(body, "min_p", 0.0, low=0, high=1),
            repetition_penalty=penalty or None,  # 0, as mlx_lm.server takes it, is off
            repetition_context_size=number(body, "repetition_context_size", 20, low=1, integer=True),
            presence_penalty=number(body, "presence_penalty", 0.0),
            presence_context_size=number(body, "presence_context_size", 20, low=1, integer=True),
            frequency_penalty=number(body, "frequency_penalty", 0.0),
            frequency_context_size=number(body, "frequency_context_size", 20, low=1, integer=True),
            xtc_probability=number(body, "xtc_probability", 0.0, low=0, high=1),
            xtc_threshold=number(body, "xtc_threshold", 0.1, low=0, high=0.5),
            xtc_special_tokens=tuple(ctx.tokenizer.encode("\n", add_special_tokens=False))
            + tuple(ctx.renderer.eos_token_ids),
            logit_bias=logit_bias(body.get("logit_bias"), ctx.vocab_size),
            forced=tuple(forced),
            forced_at=prompt_length,
            logprobs=logprobs,
            seed=secrets.randbits(64) if seed is None else seed & MASK64,
        )
    except UserError as e:
        raise BadRequest(str(e)) from None


def max_tokens(body: dict, ctx: Context, names=("max_completion_tokens", "max_tokens")) -> int:
    for name in names:
        if body.get(name) is not None:
            return number(body, name, ctx.max_tokens, low=0, integer=True)
    return ctx.max_tokens


def check_context(prompt: list, ctx: Context, param: str) -> None:
    """One prompt that fills the model's context is refused in the form agent
    clients recognise (they shorten the conversation and retry)."""
    if not prompt:
        raise BadRequest("the prompt is empty", param)
    if ctx.max_context and len(prompt) >= ctx.max_context:
        error = BadRequest(
            f"This model's maximum context length is {ctx.max_context} tokens. However, your messages resulted in {len(prompt)} tokens.",
            param,
            code="context_length_exceeded",
        )
        error.tokens, error.limit = len(prompt), ctx.max_context
        raise error


MAX_TEMPLATE_KWARGS_BYTES = 16 << 10  # as JSON
MAX_TEMPLATE_KWARGS_DEPTH = 8  # {"a": [1]} is 2 deep
TEMPLATE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def depth(value) -> int:
    """How deeply a JSON value nests objects and lists (a scalar: 0),
    measured without recursion."""
    deepest, level = 0, [(value, 0)]
    while level:
        item, d = level.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, d + 1)
            level += [(v, d + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def template_kwargs(body: dict, ctx: Context) -> dict:
    """``chat_template_kwargs``: variables the chat template reads (such as
    ``enable_thinking``). Their names must be plain identifiers, none that
    the server sets itself (``ChatRenderer.reserved``: the conversation,
    the tools, the template itself); their values at most
    ``MAX_TEMPLATE_KWARGS_BYTES`` as JSON and ``MAX_TEMPLATE_KWARGS_DEPTH``
    deep. A value the template cannot use fails rendering: a 400 too."""
    param = "chat_template_kwargs"
    value = body.get(param)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", param)
    for name in value:
        if not TEMPLATE_NAME.fullmatch(name):
            raise BadRequest(
                f"'chat_template_kwargs' names must be identifiers (letters, digits, _), got {json.dumps(name)[:100]}",
                param,
            )
        if name in ctx.renderer.reserved:
            raise BadRequest(
                f"'chat_template_kwargs' may not set {name!r}, which the server gives the chat template itself", param
            )
    if depth(value) > MAX_TEMPLATE_KWARGS_DEPTH:
        raise BadRequest(f"'chat_template_kwargs' nests over {MAX_TEMPLATE_KWARGS_DEPTH} levels deep", param)
    if len(json.dumps(value, ensure_ascii=False).encode()) > MAX_TEMPLATE_KWARGS_BYTES:
        raise BadRequest(f"'chat_template_kwargs' is over {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON", param)
    return value


def render(ctx: Context, messages: list, tools: Optional[list], extra: dict, param: str = "messages") -> list:
    """Token ids of a conversation (``chat_format.ChatRenderer``), with the
    tools calls may be made to and the request's template arguments."""
    try:
        return ctx.renderer.encode(messages, tools, extra)
    except UserError as e:
        raise BadRequest(str(e), param) from None


def tool_list(value) -> Optional[list]:
    """OpenAI's ``tools``: a list of {"type": "function", "function": {"name", ...}}."""
    if value is None:
        return None
    ok = isinstance(value, list) and all(
        isinstance(t, dict)
        and t.get("type", "function") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in value
    )
    if not ok:
        raise BadRequest(
            '\'tools\' must be a list of {"type": "function", "function": {"name": ..., "parameters": ...}}', "tools"
        )
    return value or None


def tool_choice(value, tools: Optional[list]) -> tuple:
    """(calls allowed, the function a call must be to or None, a call
    required) from OpenAI's ``tool_choice``."""
    if value is None or value == "auto":
        return tools is not None, None, False
    if value == "none":
        return False, None, False
    if value == "required":
        if not tools:
            raise BadRequest("'tool_choice' \"required\" needs 'tools'", "tool_choice")
        return True, None, True
    if (
        isinstance(value, dict)
        and isinstance(value.get("function"), dict)
        and isinstance(value["function"].get("name"), str)
    ):
        name = value["function"]["name"]
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise BadRequest(f"'tool_choice' names {name!r}, which is not among 'tools'", "tool_choice")
        return True, name, True
    raise BadRequest(
        '\'tool_choice\' must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def forcing(ctx: Context, required: bool, name: Optional[str]) -> tuple:
    """The tokens a required call must open the answer with."""
    if not required:
        return ()
    try:
        return tuple(forced_opening(ctx.tokenizer, ctx.renderer.tools, name))
    except UserError as e:
        raise BadRequest(str(e), "tool_choice") from None
