"""encode_prompt: user messages, conversations and token ids."""

import numpy as np
import pytest

from redrafter_mlx.serving.api import encode_prompt
from redrafter_mlx.errors import UserError


@pytest.fixture(scope="module")
def tokenizer(chat_model):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(chat_model[0])


class NoTemplate:
    has_chat_template = False

    def encode(self, text, add_special_tokens=True):
        return [len(word) for word in text.split()]


def test_a_message_and_the_same_conversation_give_the_same_ids(tokenizer):
    ids = encode_prompt(tokenizer, "w1 w2")
    assert ids == encode_prompt(tokenizer, [{"role": "user", "content": "w1 w2"}])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "w1 w2"}], tokenize=False, add_generation_prompt=True)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert encode_prompt(tokenizer, "w1 w2", chat_template=False) == tokenizer.encode("w1 w2")


def test_a_conversation_keeps_every_turn(tokenizer):
    conversation = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}, {"role": "user", "content": "w3"}]
    ids = encode_prompt(tokenizer, conversation)
    assert tokenizer.decode(ids).split().count("user") == 2
    assert ids[: len(encode_prompt(tokenizer, "w1")) - 2] == encode_prompt(tokenizer, "w1")[:-2]


def test_token_ids_pass_through(tokenizer):
    assert encode_prompt(tokenizer, [4, 0, 9]) == [4, 0, 9]
    assert encode_prompt(NoTemplate(), (1, 2)) == [1, 2]
    assert encode_prompt(tokenizer, np.array([3, 1])) == [3, 1]


def test_without_a_template_a_message_is_plain_text_and_a_conversation_an_error():
    assert encode_prompt(NoTemplate(), "abc de") == [3, 2]
    with pytest.raises(UserError, match="a conversation needs a chat template"):
        encode_prompt(NoTemplate(), [{"role": "user", "content": "abc"}])
