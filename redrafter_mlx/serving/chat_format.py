"""A conversation as the model's prompt, whatever its tokenizer can render.

Most chat models carry a chat template, and many templates render tools and
tool calls in the model's own syntax. Agent clients send more than that:
tools to a model whose template has no tool syntax, system messages in the
middle of a conversation, and conversations to a pretrained model with no
template at all. ``ChatRenderer`` renders them all, the same way each time
(so that each turn's prompt begins with the previous turn's, and its
prefix comes from the prompt cache):

- a template that takes the conversation renders it as it is;
- a template that refuses system messages after the first message (many
  do) gets them joined to the leading system message;
- tools, where the template has no tool syntax, are described in a system
  message, and calls are written ``<tool_call>{"name": ..., "arguments":
  ...}</tool_call>``, which mlx-lm's ``json_tools`` parser reads (the
  generic format, as llama.cpp has one); past calls and their results are
  written into the conversation as text in that same syntax;
- a tokenizer with no template renders turns in the format its vocabulary
  shows it was made for (``TurnFormat``: Gemma's turns, ChatML), else as
  plain "User:" / "Assistant:" text.
"""

from dataclasses import dataclass
from typing import Optional

from ..errors import UserError
from .tools import GENERIC_TOOLS, ToolFormat, native_tools, template_messages, with_generic_tools


@dataclass(frozen=True)
class TurnFormat:
    """Turns of a conversation for a tokenizer without a chat template:
    each message is ``opening`` (with its role's name), its text, and
    ``closing``; the prompt ends with the assistant's opening.

    roles: the name each message role is written with; a role without one
    (system, in Gemma's turns) joins its text to the next user turn.
    stop: what ends a turn when the model writes it; ``stop_is_token``: it
    is one token of the vocabulary (an end of sequence), else a stop string.
    needs: the vocabulary tokens the format is recognised by."""

    name: str
    opening: str
    closing: str
    roles: dict
    stop: str
    stop_is_token: bool
    needs: tuple = ()

    def render(self, messages: list) -> str:
        text, waiting = "", []
        for message in messages:
            role = self.roles.get(message["role"])
            if role is None:
                waiting.append(message["content"])
                continue
            content = message["content"]
            if waiting and message["role"] == "user":
                content, waiting = "\n\n".join(waiting + [content]), []
            text += self.opening.format(role=role) + content + self.closing
        if waiting:  # system text with no user turn after it
            text += self.opening.format(role=self.roles["user"]) + "\n\n".join(waiting) + self.closing
        return text + self.opening.format(role=self.roles["assistant"])


GEMMA_TURNS = TurnFormat(
    "Gemma turns",
    "<start_of_turn>{role}\n",
    "<end_of_turn>\n",
    {"user": "user", "assistant": "model"},
    "<end_of_turn>",
    True,
    ("<start_of_turn>", "<end_of_turn>"),
)
CHATML = TurnFormat(
    "ChatML",
    "<|im_start|>{role}\n",
    "<|im_end|>\n",
    {"system": "system", "user": "user", "assistant": "assistant"},
    "<|im_end|>",
    True,
    ("<|im_start|>", "<|im_end|>"),
)
PLAIN_TURNS = TurnFormat(
    "plain User:/Assistant: text",
    "{role}: ",
    "\n\n",
    {"system": "System", "user": "User", "assistant": "Assistant"},
    "\nUser:",
    False,
)
TURN_FORMATS = (GEMMA_TURNS, CHATML)


# Names a request's template arguments (``chat_template_kwargs``) may not
# take: what the renderer gives the template itself, the other parameters
# of transformers' ``apply_chat_template`` and ``render_jinja_template``
# (``chat_template`` among them, which would render the client's own
# template text), the tokenizer's special tokens, and the globals of
# transformers' template environment and of Jinja's. The arguments are
# only values the template reads; none of their text is ever rendered as
# a template.
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "conversation",
        "conversations",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
        "kwargs",
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "extra_special_tokens",
        "raise_exception",
        "strftime_now",
        "dict",
        "namespace",
        "range",
        "lipsum",
        "cycler",
        "joiner",
        "loop",
        "self",
    }
)


def turn_format(tokenizer) -> TurnFormat:
    """The turn format a tokenizer without a chat template was made for,
    known by its vocabulary; plain text when none is known."""
    vocab = tokenizer.get_vocab()
    return next((f for f in TURN_FORMATS if all(t in vocab for t in f.needs)), PLAIN_TURNS)


def fold_system(messages: list) -> list:
    """System messages joined into one leading system message, in order."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def system_in_first_user(messages: list) -> list:
    """System messages written at the head of the first user message (for
    templates that have no system role)."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [dict(m) for m in messages if m["role"] != "system"]
    first = next((m for m in rest if m["role"] == "user" and isinstance(m.get("content"), str)), None)
    if first is None:
        return [{"role": "user", "content": "\n\n".join(system)}] + rest
    first["content"] = "\n\n".join(system + [first["content"]])
    return rest


class ChatRenderer:
    """Renders conversations for one tokenizer (see the module docstring).

    native: the tool syntax of the tokenizer's chat template, or None.
    tools: the syntax calls are read in (the template's own, else the
    generic one). turns: the turn format used when the tokenizer has no
    chat template (None when it has one). stop_tokens: token ids that end
    an answer besides the tokenizer's end of sequence (the turn format's
    end of turn; ``eos_token_ids`` holds both); stop_strings: strings that
    end one (plain turns)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.native: Optional[ToolFormat] = native_tools(tokenizer)
        self.tools: ToolFormat = self.native or GENERIC_TOOLS
        self.turns: Optional[TurnFormat] = (
            None if getattr(tokenizer, "has_chat_template", False) else turn_format(tokenizer)
        )
        turns = self.turns
        self.stop_tokens: tuple = (tokenizer.get_vocab()[turns.stop],) if turns and turns.stop_is_token else ()
        self.stop_strings: tuple = (turns.stop,) if turns and not turns.stop_is_token else ()

    @property
    def eos_token_ids(self) -> list:
        """The tokens that end an answer: the tokenizer's, and the turn format's end of turn."""
        return list(dict.fromkeys([*self.tokenizer.eos_token_ids, *self.stop_tokens]))

    def describe(self) -> Optional[str]:
        """One line for the server's start when conversations are not
        rendered by the model's own template alone, else None."""
        if self.turns is not None:
            return f"this model has no chat template: conversations are written in {self.turns.name}, tools in the generic <tool_call> syntax"
        if self.native is None:
            return "this model's chat template has no tool-call syntax: tools are offered in the generic <tool_call> syntax"
        return None

    @property
    def reserved(self) -> frozenset:
        """The names template arguments may not take: ``RESERVED_TEMPLATE_NAMES``
        and this tokenizer's own special tokens."""
        special = getattr(self.tokenizer, "special_tokens_map", None) or {}
        return RESERVED_TEMPLATE_NAMES | set(special)

    def text(self, messages: list, tools: Optional[list] = None, options: Optional[dict] = None) -> str:
        """The prompt text of a conversation (chat messages in OpenAI's
        form) with the tools calls may be made to (OpenAI's nested form, or
        None) and the template's keyword arguments. ``UserError`` when the
        template refuses the conversation."""
        options = dict(options or {})
        if self.native is None and (tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)):
            messages, tools = with_generic_tools(messages, tools), None
        if self.turns is not None:
            return self.turns.render(messages)
        if tools:
            options["tools"] = tools
        apply = self.tokenizer.apply_chat_template
        try:
            return apply(template_messages(messages), tokenize=False, add_generation_prompt=True, **options)
        except Exception as e:  # the template's own checks (roles, order)
            first_error = e
        # A template that takes a system message only first gets them joined;
        # one that takes none gets them at the head of the first user message.
        for fold in (
            fold_system if any(m["role"] == "system" for m in messages[1:]) else None,
            system_in_first_user if any(m["role"] == "system" for m in messages) else None,
        ):
            if fold is not None:
                try:
                    return apply(
                        template_messages(fold(messages)), tokenize=False, add_generation_prompt=True, **options
                    )
                except Exception:
                    pass
        raise UserError(f"the chat template refused the conversation ({first_error})")

    def encode(self, messages: list, tools: Optional[list] = None, options: Optional[dict] = None) -> list:
        """The conversation's token ids (see ``text``); a turn format's text
        gets the tokenizer's start-of-sequence token, as a template writes it."""
        return self.tokenizer.encode(self.text(messages, tools, options), add_special_tokens=self.turns is not None)
