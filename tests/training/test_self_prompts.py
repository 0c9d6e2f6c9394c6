"""Prompts the base model writes itself: sampled, filtered, resumed, and
answered like any prompts file."""

import pytest

from conftest import tiny_model
from redrafter_mlx.engine.autoregressive import autoregressive_steps
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.sampling import SamplingSettings, make_chooser, row_seed
from redrafter_mlx.errors import UserError
from redrafter_mlx.serving.prompts import read_prompts
from redrafter_mlx.training.distill import DataFolder, distill, response_stream
from redrafter_mlx.training.self_prompts import PROMPTS_FILE, UserTurn, read_self_prompts, write_self_prompts

# A quarter of the vocabulary ends the turn: turns of a few tokens, some
# empty, some truncated at MAX_TOKENS, and repeats among the short ones.
TURN = UserTurn(header=[1, 2, 3, 4], stop=set(range(192, 256)))
MAX_TOKENS = 10
SEED = 3


def decode(ids):
    """Two words only, so that short turns repeat."""
    return " ".join(f"t{i % 2}" for i in ids)


@pytest.fixture(scope="module")
def base():
    return BaseModel(tiny_model("llama", seed=5))


def write(base, path, count, batch_size=8, **kwargs):
    return write_self_prompts(
        base,
        decode,
        TURN,
        count,
        path,
        seed=SEED,
        batch_size=batch_size,
        max_tokens=MAX_TOKENS,
        progress=False,
        **kwargs,
    )


def attempt_alone(base, k):
    """Attempt k sampled on its own: (tokens, finish reason)."""
    choose = make_chooser(SamplingSettings(temp=1.0, row_seeds=[row_seed(SEED, k)]))
    tokens, finish = [], None
    for step in autoregressive_steps(
        base, [TURN.header], max_tokens=MAX_TOKENS, choose=choose, eos_token_ids=sorted(TURN.stop)
    ):
        tokens += step[0].tokens
        finish = step[0].finish_reason or finish
    return tokens, finish


def test_prompts_are_the_first_distinct_complete_turns_in_attempt_order(base, tmp_path):
    prompts = write(base, tmp_path / PROMPTS_FILE, 12)
    records = read_self_prompts(tmp_path / PROMPTS_FILE)
    assert [r["prompt"] for r in records] == prompts and len(set(prompts)) == 12
    expected, dropped = [], {"empty": 0, "truncated": 0, "repeated": 0}
    for k in range(records[-1]["attempt"] + 1):
        tokens, finish = attempt_alone(base, k)
        if finish == "length":
            dropped["truncated"] += 1
        elif not tokens:
            dropped["empty"] += 1
        elif decode(tokens) in expected:
            dropped["repeated"] += 1
        else:
            expected.append(decode(tokens))
    assert prompts == expected  # whatever batch each attempt ran in
    assert all(dropped.values()), dropped  # the test meets every kind of drop


def test_an_interrupted_run_resumes_to_the_same_prompts(base, tmp_path):
    whole = write(base, tmp_path / "whole.jsonl", 12)
    calls = []

    def interrupting(ids):
        calls.append(ids)
        if len(calls) == 11:  # in the second batch of 8 attempts
            raise KeyboardInterrupt
        return decode(ids)

    path = tmp_path / "resumed.jsonl"
    with pytest.raises(KeyboardInterrupt):
        write_self_prompts(
            base, interrupting, TURN, 12, path, seed=SEED, batch_size=8, max_tokens=MAX_TOKENS, progress=False
        )
    assert 0 < len(read_self_prompts(path)) < 12  # the first batch was kept
    assert write(base, path, 12, batch_size=5) == whole


def test_the_prompts_file_reproduces_the_data(base, tmp_path):
    """Answering the written prompts gives the same data as distilling the
    prompts file on its own."""
    prompts = write(base, tmp_path / "a" / PROMPTS_FILE, 6)

    def tokenize(text):
        return [int(word[1:]) for word in text.split()]

    def run(folder, texts):
        generate = response_stream(base, 8, SamplingSettings(), [7])
        distill(base, tokenize, texts, DataFolder(folder), {"max_tokens": 8}, generate, 4, progress=False)
        data = DataFolder(folder).load()
        return [data.sequence(i).tolist() for i in range(len(data))]

    assert run(tmp_path / "a", prompts) == run(tmp_path / "b", read_prompts(str(tmp_path / "a" / PROMPTS_FILE)))


def test_too_few_distinct_prompts_is_one_clear_error_keeping_what_was_written(base, tmp_path):
    path = tmp_path / PROMPTS_FILE
    with pytest.raises(UserError, match="wrote only"):
        write(base, path, 12, max_attempts=10)
    assert len(read_self_prompts(path)) < 12
    with pytest.raises(UserError, match="at least 1"):
        write(base, path, 0)
    for damaged in ("not json\n", '{"prompt": "no attempt"}\n'):
        path.write_text(damaged)
        with pytest.raises(UserError, match="cannot read"):
            write(base, path, 3)
