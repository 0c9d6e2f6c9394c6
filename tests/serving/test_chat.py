"""`redrafter-mlx chat` driven through a pseudo-terminal, as a user would."""

import io
import json
import os
import sys

import pytest

from conftest import ROOT

pexpect = pytest.importorskip("pexpect")


def test_chat_session():
    """The embedded default model and its shipped drafter. Answers may run
    long, so the story is still streaming when Ctrl-C arrives even on a
    fast machine or when this test process is starved of CPU."""
    env = dict(os.environ)
    child = pexpect.spawn(
        sys.executable,
        ["-m", "redrafter_mlx.cli", "chat", "--max-tokens", "2048"],
        cwd=ROOT,
        env=env,
        encoding="utf-8",
        timeout=180,
    )
    child.logfile_read = transcript = io.StringIO()
    try:
        child.expect(">> ")
        child.sendline("What is the capital of France? Answer in one sentence.")
        child.expect("Paris")
        child.expect(">> ")

        child.sendline("/stats")
        child.expect(r"last answer: \d+ tokens, [\d.]+ tokens/s, [\d.]+ tokens per step")
        child.expect(r"session: \d+ tokens")
        child.expect(">> ")

        # Ctrl-C during a long answer stops it and keeps the chat going.
        child.sendline("Write a very long story about a dragon and a knight, with many chapters.")
        child.expect("chapters.\r\n")  # the terminal's echo of the question
        child.expect(r"\w+ \w+ \w+")  # the answer is streaming
        child.sendcontrol("c")
        child.expect(r"\[stopped\]")
        child.expect(">> ")

        # The conversation is intact: the model still answers, with context.
        child.sendline("What city did I ask about first? Answer with one word.")
        child.expect(">> ")
        assert child.isalive()
        # Its prompt came from the conversation's cache, the stopped answer too.
        child.sendline("/stats")
        child.expect(r"first token after [\d.]+ s, (\d+) prompt tokens from the cache")
        assert int(child.match.group(1)) > 40
        child.expect(">> ")

        child.sendline("/reset")
        child.expect("conversation cleared")
        child.expect(">> ")
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    except pexpect.TIMEOUT:
        pytest.fail("timed out; the session so far:\n" + transcript.getvalue()[-4000:])
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_each_conversation_answered_is_logged(chat_model, tmp_path):
    from redrafter_mlx.loading.loader import load
    from redrafter_mlx.serving.chat import chat_loop
    from redrafter_mlx.serving.prompts import PromptLog, read_prompts

    redrafter, tokenizer = load(chat_model[0], drafter=chat_model[1])
    lines = iter(["w1 w2", "/stats", "", "w3", "/reset", "w4"])

    def read(_):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    path = tmp_path / "log.jsonl"
    log = PromptLog(str(path))
    shown = []
    chat_loop(redrafter, tokenizer, 3, "be brief", read=read, write=lambda *a, **k: shown.append(a), prompt_log=log)
    log.close()
    system = {"role": "system", "content": "be brief"}
    first, second, third = read_prompts(str(path))
    assert first == [system, {"role": "user", "content": "w1 w2"}]
    assert second[:2] == first and second[2]["role"] == "assistant" and second[3] == {"role": "user", "content": "w3"}
    assert third == [system, {"role": "user", "content": "w4"}]


def test_a_recorded_ctrl_c_ends_the_answer_at_the_next_step(chat_model):
    """Should library code swallow the KeyboardInterrupt, the press that
    chat's handler records still ends the answer, one step later."""
    import threading

    from redrafter_mlx.loading.loader import load
    from redrafter_mlx.serving.chat import answer

    redrafter, tokenizer = load(chat_model[0], drafter=chat_model[1])
    messages = [{"role": "user", "content": "w1 w2"}]
    _, full, interrupted = answer(redrafter, tokenizer, messages, 24, lambda segment: None)
    assert not interrupted and full.steps > 1

    stop = threading.Event()
    _, stats, interrupted = answer(redrafter, tokenizer, messages, 24, lambda segment: stop.set(), stop=stop)
    assert interrupted and stats.steps == 0 and stats.tokens == 1  # the prefill's token, then nothing


def test_chat_samples_with_the_models_recommendation_else_local_chat_defaults(chat_model, tmp_path):
    """A model folder's generation_config.json sets chat's sampling; without
    one, chat samples at temperature 0.7 and top-p 0.9; options given win."""
    import shutil

    from redrafter_mlx.loading.loader import load
    from redrafter_mlx.serving.chat import chat_sampling

    model = tmp_path / "model"
    shutil.copytree(chat_model[0], model)
    redrafter, _ = load(str(model), drafter="none")
    assert redrafter.generation_config == {}
    plain = chat_sampling(redrafter.generation_config)
    assert (plain.temp, plain.top_p, plain.top_k) == (0.7, 0.9, 0)
    assert chat_sampling({}, temp=0.0).temp == 0.0  # --temp 0 is greedy

    (model / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2})
    )
    redrafter, _ = load(str(model), drafter="none")
    recommended = chat_sampling(redrafter.generation_config)
    assert (recommended.temp, recommended.top_p, recommended.top_k, recommended.min_p) == (0.6, 0.95, 20, 0.0)
    given = chat_sampling(redrafter.generation_config, temp=1.0, top_p=None, seed=3)
    assert (given.temp, given.top_p, given.top_k, given.seed) == (1.0, 0.95, 20, 3)
    assert chat_sampling({"do_sample": False, "temperature": 0.6}).temp == 0.0  # the model recommends greedy decoding


def scripted(lines):
    lines = iter(lines)

    def read(_):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    return read, lines


@pytest.mark.parametrize("leave", ["exit", "quit", "/quit", "  Exit  "])
def test_commands_and_typos_never_reach_the_model(leave):
    """/help answers, any other line starting with / is an unknown command,
    and exit or quit alone on a line leaves: none of them is a message (the
    engine is never called: it is None here)."""
    from redrafter_mlx.serving.chat import HELP, chat_loop

    read, rest = scripted(["/help", "/bogus now", "/resett", leave, "never read"])
    shown = []
    chat_loop(None, None, 3, read=read, write=lambda *a, **k: shown.append(" ".join(map(str, a))))
    assert f"[{HELP}]" in shown
    assert "[unknown command /bogus; /help lists the commands]" in shown
    assert "[unknown command /resett; /help lists the commands]" in shown
    assert list(rest) == ["never read"]


def test_an_answer_cut_by_max_tokens_is_marked(chat_model):
    from redrafter_mlx.loading.loader import load
    from redrafter_mlx.serving.chat import chat_loop

    redrafter, tokenizer = load(chat_model[0], drafter=chat_model[1])
    read, _ = scripted(["w1 w2"])
    shown = []
    chat_loop(
        redrafter,
        tokenizer,
        3,
        read=read,
        write=lambda *a, **k: shown.append("".join(map(str, a))),
        dim=lambda t: f"<{t}>",
    )
    assert "< [stopped at --max-tokens 3]>" in shown
