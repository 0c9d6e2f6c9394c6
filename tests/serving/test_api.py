"""encode_prompt: user messages, conversations and token ids."""

import numpy as np
import pytest

from redrafter_mlx.engine.calibrate import (
    cost_curve as measured_cost_curve,
)  # (tests fix the curve: this is the real one)
from redrafter_mlx.errors import UserError
from redrafter_mlx.serving.api import encode_prompt


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
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "w1 w2"}], tokenize=False, add_generation_prompt=True
    )
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert encode_prompt(tokenizer, "w1 w2", chat_template=False) == tokenizer.encode("w1 w2")


def test_a_conversation_keeps_every_turn(tokenizer):
    conversation = [
        {"role": "user", "content": "w1"},
        {"role": "assistant", "content": "w2"},
        {"role": "user", "content": "w3"},
    ]
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


def test_the_cost_curve_is_measured_before_the_clock_and_once_per_machine(chat_model, tmp_path, monkeypatch):
    """The first answer on a machine measures the cost curve, before its
    generation clock starts; the next answers read it from the cache. The
    drift check is held steady here: whether steps follow the curve depends
    on what else the machine runs (tests/drafting/test_cost.py tests it)."""
    import time

    from redrafter_mlx.engine import calibrate
    from redrafter_mlx.loading.loader import load
    from redrafter_mlx.serving.generate import stream_generate

    monkeypatch.setenv("REDRAFTER_MLX_CACHE", str(tmp_path))
    measured = []
    measure = calibrate.measure

    def slow_measure(*args, **kwargs):
        measured.append(1)
        time.sleep(2.0)
        return measure(*args, **kwargs)

    monkeypatch.setattr(calibrate, "measure", slow_measure)
    monkeypatch.setattr(calibrate, "cost_curve", measured_cost_curve)
    redrafter, tokenizer = load(chat_model[0], drafter=chat_model[1])
    tic = time.perf_counter()
    for first in stream_generate(redrafter, tokenizer, "w1 w2", max_tokens=48):
        pass
    spent = time.perf_counter() - tic
    assert len(measured) == 1 and spent > 2.0
    assert first.generation_tokens / first.generation_tps < spent - 1.5  # the measurement's two seconds are not in it
    for _ in range(2):
        for _ in stream_generate(redrafter, tokenizer, "w1 w2", max_tokens=48):
            pass
    assert len(measured) == 1


def test_the_readme_quickstart_shows_what_batch_generate_returns():
    import os
    import re

    from conftest import ROOT

    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## Quickstart.*?```python\n(.*?)```", readme, re.S).group(1)
    assert "results = batch_generate(" in block
    assert re.search(r"for text in results\.texts:\n\s+print\(text\)", block)
