"""Conversations rendered for tokenizers that cannot render them alone: no
chat template (a turn format), a template without tool syntax (the generic
one), a template that refuses system messages after the first, or all."""

import json

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from redrafter_mlx.errors import UserError
from redrafter_mlx.serving.chat_format import CHATML, GEMMA_TURNS, PLAIN_TURNS, ChatRenderer
from redrafter_mlx.serving.tools import GENERIC_TOOLS, ToolCallText

WORDS = ["<unk>", "<bos>", "<eos>", "hello", "there", "user", "model"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
CALLED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Show a.txt"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.txt"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "hello"},
    {"role": "user", "content": "Thanks"},
]
STRICT = (  # a template that takes a system message only first, as many do
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('System role must come first') }}{% endif %}"
    "[{{ m.role }}] {{ m.content }} {% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def tokenizer(special: list, template=None) -> TokenizerWrapper:
    words = WORDS + [w for w in special if w not in WORDS]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        additional_special_tokens=special,
        chat_template=template,
    )
    return TokenizerWrapper(hf)


def test_a_tokenizer_without_a_template_gets_the_turn_format_its_vocabulary_shows():
    gemma = ChatRenderer(tokenizer(["<start_of_turn>", "<end_of_turn>"]))
    assert gemma.turns is GEMMA_TURNS and gemma.tools is GENERIC_TOOLS
    text = gemma.text(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "there"},
            {"role": "user", "content": "hello"},
        ]
    )
    # Gemma's turns have no system role: its text opens the next user turn.
    assert text == (
        "<start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\nthere<end_of_turn>\n"
        "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n"
    )
    end_of_turn = gemma.tokenizer.get_vocab()["<end_of_turn>"]
    assert gemma.stop_tokens == (end_of_turn,) and end_of_turn in gemma.eos_token_ids and gemma.stop_strings == ()
    hello = [
        {"role": "user", "content": "hello"}
    ]  # encoded as a prompt is, with the start of sequence where the tokenizer adds one
    assert gemma.encode(hello) == gemma.tokenizer.encode(gemma.text(hello))
    assert ChatRenderer(tokenizer(["<|im_start|>", "<|im_end|>"])).turns is CHATML
    plain = ChatRenderer(tokenizer([]))
    assert plain.turns is PLAIN_TURNS and plain.stop_tokens == () and plain.stop_strings == ("\nUser:",)
    assert plain.text([{"role": "user", "content": "hello"}]) == "User: hello\n\nAssistant: "
    assert "no chat template" in gemma.describe()


def test_tools_without_template_syntax_are_offered_and_replayed_in_the_generic_syntax():
    renderer = ChatRenderer(tokenizer(["<|im_start|>", "<|im_end|>"]))
    text = renderer.text(CALLED, TOOLS)
    system, user, assistant, results = text.split("<|im_start|>")[1:5]
    assert system.startswith("system\nBe brief.\n\n# Tools") and json.dumps(TOOLS[0]["function"]) in system
    assert (
        assistant
        == 'assistant\n<tool_call>\n{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call><|im_end|>\n'
    )
    # The result and the user's next words are one user turn.
    assert results == "user\n<tool_response>\nhello\n</tool_response>\n\nThanks<|im_end|>\n"
    # What the model writes back in that syntax is read as a call.
    reader = ToolCallText(renderer.tools, TOOLS)
    shown = (
        reader.add('Sure.<tool_call>\n{"name": "read", "arguments": {"path": "b.txt"}}\n</tool_call>') + reader.finish()
    )
    assert shown == "Sure." and reader.calls == [{"name": "read", "arguments": {"path": "b.txt"}}]


def test_a_call_cut_at_the_length_limit_or_not_a_call_at_all_comes_back_as_text():
    syntax = ChatRenderer(tokenizer(["<|im_start|>", "<|im_end|>"])).tools
    cut = ToolCallText(syntax, TOOLS)
    written = 'Reading.<tool_call>\n{"name": "read", "argu'
    assert cut.add(written) + cut.finish() == written and cut.calls == []
    prose = ToolCallText(syntax, TOOLS)
    written = "Use <tool_call>like this</tool_call> then."
    assert prose.add(written) + prose.finish() == written and prose.calls == []


def test_a_template_without_tools_renders_the_generic_syntax_through_itself():
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    renderer = ChatRenderer(tokenizer([], template))
    assert renderer.turns is None and renderer.native is None and "no tool-call syntax" in renderer.describe()
    text = renderer.text(CALLED, TOOLS)
    assert (
        text.startswith("[system] Be brief.\n\n# Tools")
        and "[assistant] <tool_call>" in text
        and text.endswith("[assistant] ")
    )
    assert renderer.text(CALLED[1:2]) == "[user] Show a.txt [assistant] "  # no tools: the conversation as it is


def test_system_messages_stay_in_place_unless_the_template_refuses_them():
    middle = [
        {"role": "user", "content": "hello"},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "there"},
    ]
    lenient = ChatRenderer(tokenizer([], STRICT.replace("{{ raise_exception('System role must come first') }}", "")))
    assert lenient.text(middle) == "[user] hello [system] Be brief. [user] there [assistant] "
    strict = ChatRenderer(tokenizer([], STRICT))
    assert strict.text(middle) == "[system] Be brief. [user] hello [user] there [assistant] "
    refusing = ChatRenderer(tokenizer([], "{{ raise_exception('no') }}"))
    with pytest.raises(UserError, match="refused the conversation"):
        refusing.text(middle)


def test_a_template_without_a_system_role_gets_the_system_text_and_tools_in_the_first_user_message():
    no_system = ChatRenderer(tokenizer([], STRICT.replace("and not loop.first", "")))  # refuses every system message
    assert no_system.text(CALLED[:2]) == "[user] Be brief.\n\nShow a.txt [assistant] "
    with_tools = no_system.text(CALLED[1:2], TOOLS)  # the generic tools' text is a system message
    assert with_tools.startswith("[user] # Tools") and with_tools.endswith("Show a.txt [assistant] ")


def test_template_syntax_a_client_sends_is_text_and_a_template_argument_the_template_cannot_use_is_a_user_error():
    """Messages, tool descriptions and template arguments are values the
    template reads: Jinja syntax in them comes out as written, never run.
    A template argument the template fails on is the client's error."""
    template = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
        "{% if budget is defined %}budget {{ budget + 1 }} {% endif %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    renderer = ChatRenderer(tokenizer([], template))
    injected = "{{ 7*7 }} {% for x in range(3) %}x{% endfor %}"
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "description": injected, "parameters": {"type": "object", "properties": {}}},
        }
    ]
    text = renderer.text([{"role": "user", "content": injected}], tools)
    assert text.count(injected) == 2 and "49" not in text and "xxx" not in text
    messages = [{"role": "user", "content": "hello"}]
    assert renderer.text(messages, options={"budget": 3}) == "[user] hello budget 4 [assistant] "
    with pytest.raises(UserError, match="the chat template refused the conversation"):
        renderer.text(messages, options={"budget": "x"})
