"""Prompts files (user messages, conversations, token ids) and the prompt
log that `serve` and `chat` append to."""

import json
import os

import pytest

from redrafter_mlx.errors import UserError
from redrafter_mlx.serving.prompts import PromptLog, read_prompts

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "holds no prompts"),
        ('{"prompt": "a"}\nnot json\n', "line 2, column 1: not valid JSON"),
        ('{"text": "a"}\n', 'line 1: needs a "prompt" string'),
        ('["a"]\n', 'line 1: needs a "prompt" string'),
        ('{"messages": []}\n', 'line 1: needs a "prompt" string, a "messages" list'),
        ('{"messages": [{"role": "user", "content": 3}]}\n', "line 1: needs"),
        ('{"messages": [{"content": "hi"}]}\n', "line 1: needs"),
        ('{"tokens": [1, -2]}\n', "line 1: needs"),
        ('{"tokens": [1, true]}\n', "line 1: needs"),
        ('{"tokens": [1.5]}\n', "line 1: needs"),
    ],
)
def test_bad_prompts_files(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        read_prompts(str(path))


def test_the_three_kinds_of_prompt_are_read_and_other_fields_ignored(tmp_path):
    path = tmp_path / "p.jsonl"
    records = [{"id": 0, "prompt": "hello"}, {"messages": CONVERSATION, "source": "log"}, {"tokens": [5, 0, 7]}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert read_prompts(str(path)) == ["hello", CONVERSATION, [5, 0, 7]]
    with pytest.raises(UserError, match="not found"):
        read_prompts(str(tmp_path / "missing.jsonl"))


def test_the_log_appends_what_read_prompts_gives_back(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"prompt": "kept"}\n')
    log = PromptLog(str(path))
    log.add(CONVERSATION)
    log.add([3, 4])
    log.add("héllo")
    log.close()
    log.add("after close: dropped")
    assert read_prompts(str(path)) == ["kept", CONVERSATION, [3, 4], "héllo"]


def test_a_line_cut_short_costs_only_itself(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "cut sh')
    log = PromptLog(str(path))
    log.add("b")
    log.close()
    lines = path.read_text().splitlines()
    assert lines == ['{"prompt": "a"}', '{"prompt": "cut sh', '{"prompt": "b"}']
    with pytest.raises(UserError, match="line 2, column 12: not valid JSON"):
        read_prompts(str(path))


def test_an_unwritable_log_is_one_error(tmp_path):
    with pytest.raises(UserError, match="cannot write the prompt log .*/no/such/log.jsonl"):
        PromptLog(str(tmp_path / "no" / "such" / "log.jsonl"))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_stops_the_log_with_one_warning():
    warnings = []
    log = PromptLog("/dev/full", warn=warnings.append)
    log.add("a")
    log.add("b")
    assert len(warnings) == 1 and "the prompt log /dev/full stopped" in warnings[0]
