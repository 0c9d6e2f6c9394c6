"""The redrafter-mlx command line, run as a user runs it, on the embedded
default model (SmolLM2-135M-Instruct)."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, run_cli
from redrafter_mlx.drafting.datastore import load_datastore
from redrafter_mlx.drafting.drafter import Drafter, DrafterArgs, save_drafter
from redrafter_mlx.training.distill import DataFolder

QUESTION = "What is the capital of France? Answer in one sentence."


def assert_clean_error(result, message, status=None):
    """One ``error:`` line holding ``message``, no traceback; exit status
    ``status`` (2: a bad option value, 1: a failure at run time), or any
    non-zero one."""
    assert result.returncode != 0 if status is None else result.returncode == status, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_generate_json_fields_and_greedy_parity_with_mlx_lm(smol_drafter):
    result = run_cli("generate", "--drafter", smol_drafter, "--prompt", QUESTION, "--max-tokens", 24, "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    for key in ("text", "tokens", "prompt_tokens", "generation_tokens", "steps", "tokens_per_step", "generation_tps"):
        assert key in out
    assert "Paris" in out["text"]
    assert out["generation_tokens"] == len(out["tokens"]) and out["steps"] >= 1

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from redrafter_mlx.loading.loader import load_base_model

    model, tokenizer = load_base_model(None)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert out["prompt_tokens"] == len(ids)
    expected = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=24):
        if token in tokenizer.eos_token_ids:
            break
        expected.append(token)
    assert out["tokens"] == expected


def test_default_drafter_speeds_up_without_changing_greedy_output():
    """No --model, no --drafter: the shipped drafter accepts drafted tokens,
    and the output is still mlx-lm's greedy output."""
    question = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"
    # A fixed node budget: `auto` sizes the tree by this machine's timings,
    # which a loaded test machine can make plain decoding's.
    result = run_cli("generate", "--prompt", question, "--max-tokens", 48, "--max-nodes", 8, "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["tokens_per_step"] > 1.2

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from redrafter_mlx.loading.loader import load_base_model

    model, tokenizer = load_base_model(None)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    expected = [
        t for t, _ in zip((token for token, _ in generate_step(mx.array(ids), model, max_tokens=48)), range(48))
    ]
    assert out["tokens"] == expected[: len(out["tokens"])] and len(out["tokens"]) == 48


def test_ignore_chat_template_encodes_like_mlx_lm(smol_drafter):
    result = run_cli(
        "generate",
        "--drafter",
        smol_drafter,
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        4,
        "--ignore-chat-template",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    from redrafter_mlx.loading.loader import load_base_model

    _, tokenizer = load_base_model(None)
    assert json.loads(result.stdout)["prompt_tokens"] == len(tokenizer.encode("Once upon a time"))


def test_prompts_file_gives_one_json_line_per_prompt_in_order(smol_drafter, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Say hi.", QUESTION, "Count to three."]) + "\n")
    # A fixed node count: the same trees in both runs, and no curve measured for three rows.
    fixed = ("--drafter", smol_drafter, "--max-nodes", 4, "--max-tokens", 12, "--json")
    batched = run_cli("generate", *fixed, "--prompts", prompts, "--batch-size", 3)
    assert batched.returncode == 0, batched.stderr
    lines = [json.loads(line) for line in batched.stdout.splitlines()]
    assert len(lines) == 3 and "Paris" in lines[1]["text"]
    solo = run_cli("generate", *fixed, "--prompt", QUESTION)
    assert json.loads(solo.stdout)["tokens"] == lines[1]["tokens"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--beam-width", 0], "beam width"),
        (["--beam-length", 1], "beam length"),
        (["--max-tokens", -1], "Invalid value for '--max-tokens' / '-n'"),
        (["--max-tokens", 0], "Invalid value for '--max-tokens' / '-n'"),
        (["--temp", -1], "temperature"),
        (["--top-p", 1.5], "top-p"),
        (["--top-k", -2], "top-k"),
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "   "], "--prompt is empty"),
    ],
)
def test_bad_settings_exit_2_with_one_error_line(smol_drafter, args, message):
    """Whether Click or a settings object finds the bad value, it is a usage error."""
    assert_clean_error(run_cli("generate", "--drafter", smol_drafter, "--prompt", "hi", *args), message, status=2)


def test_bad_drafters_and_prompts(smol_drafter, tmp_path):
    assert_clean_error(run_cli("generate", "--drafter", tmp_path / "missing", "--prompt", "hi"), "not found")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(smol_drafter, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    assert_clean_error(run_cli("generate", "--drafter", corrupt, "--prompt", "hi"), "cannot read drafter weights")
    other = tmp_path / "other"
    save_drafter(Drafter(DrafterArgs(vocab_size=32000, hidden_size=576, exit_dim=64)), str(other))
    assert_clean_error(
        run_cli("generate", "--drafter", other, "--prompt", "hi"),
        "vocab_size 32000 does not match the base model's vocabulary size 49152",
    )
    long_prompt = "word " * 9000
    assert_clean_error(run_cli("generate", "--drafter", smol_drafter, "--prompt", "-", input=long_prompt), "context")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_clean_error(run_cli("generate", "--drafter", smol_drafter, "--prompts", empty), "holds no prompts")
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"text": "hi"}\n')
    assert_clean_error(run_cli("generate", "--drafter", smol_drafter, "--prompts", no_field), 'needs a "prompt" string')


def test_distill_then_train_on_two_folders_gives_a_drafter_generate_loads(tmp_path):
    """The whole training path from the command line, on the real model: a
    greedy and a sampled data folder (two responses per prompt), one drafter
    trained on both."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Name a colour.", "What is 2+3?", "Say hi.")))
    for folder, temp, samples, workers in (("greedy", "0", 1, 1), ("sampled", "0.7", 2, 2), ("sampled-1", "0.7", 2, 1)):
        result = run_cli(
            "distill",
            "--prompts",
            prompts,
            "--output",
            tmp_path / folder,
            "--max-tokens",
            12,
            "--temp",
            temp,
            "--samples",
            samples,
            "--workers",
            workers,
        )
        assert result.returncode == 0, result.stderr
    assert "6 responses" in result.stdout

    def responses(folder):
        data = DataFolder(tmp_path / folder).load()
        samples = np.concatenate([np.load(shard)["sample"] for shard in DataFolder(tmp_path / folder).shards()])
        return {(int(data.prompt_index[i]), int(samples[i])): data.sequence(i).tolist() for i in range(len(data))}

    assert responses("sampled") == responses("sampled-1")  # two worker processes make the same data
    train = (
        "train",
        "--data",
        tmp_path / "greedy",
        "--data",
        tmp_path / "sampled",
        "--output",
        tmp_path / "drafter",
        "--steps",
        3,
        "--batch-size",
        8,
        "--exit-dim",
        32,
        "--draft-vocab",
        64,
        "--eval-every",
        3,
    )
    result = run_cli(*train)
    assert result.returncode == 0, result.stderr
    training = json.loads((tmp_path / "drafter" / "config.json").read_text())["training"]
    assert training["sequences"] == 9 and [s["temp"] for s in training["distill_settings"]] == [0.0, 0.7]
    result = run_cli("generate", "--drafter", tmp_path / "drafter", "--prompt", "Say hi.", "--max-tokens", 8, "--json")
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    greedy_text = json.loads(result.stdout)["text"]
    store = (
        "datastore",
        "--data",
        tmp_path / "greedy",
        "--data",
        tmp_path / "sampled",
        "--drafter",
        tmp_path / "drafter",
    )
    result = run_cli(*store)
    assert result.returncode == 0 and "of 6 answers" in result.stdout, result.stderr  # prompt 0's are held out
    greedy = DataFolder(tmp_path / "greedy").load()
    kept = greedy.sequence(int(np.flatnonzero(greedy.prompt_index == 1)[0])).tolist()
    proposals = load_datastore(tmp_path / "drafter", 49152).propose(kept[:-1], 1, beams=3)
    assert proposals[0][2] == 4 and kept[-1] in [tokens[0] for tokens, _, _ in proposals]
    result = run_cli("generate", "--drafter", tmp_path / "drafter", "--prompt", "Say hi.", "--max-tokens", 8, "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["text"] == greedy_text, result.stderr
    other = tmp_path / "other-model"
    shutil.copytree(tmp_path / "greedy", other)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps(dict(meta, vocab_size=1000)))
    before = (tmp_path / "drafter" / "datastore.npy").read_bytes()
    assert_clean_error(run_cli(*store[:-2], "--data", other, *store[-2:]), "was made for a model with vocab_size 1000")
    assert_clean_error(run_cli(*store[:-1], tmp_path / "greedy"), "has no config.json")
    assert (tmp_path / "drafter" / "datastore.npy").read_bytes() == before
    assert_clean_error(run_cli(*train[:4], tmp_path / "greedy", *train[5:]), "given twice")
    assert_clean_error(run_cli(*train[:4], tmp_path, *train[5:]), "not a distillation data folder")
    assert_clean_error(run_cli(*train, "--freeze-head-steps", 2), "freezing the head needs a warm start")
    assert_clean_error(
        run_cli(*train, "--warm-start", "--freeze-head-steps", -1), "freeze head steps must be at least 0"
    )
    greedy_samples = run_cli("distill", "--prompts", prompts, "--output", tmp_path / "new", "--samples", 2)
    assert_clean_error(greedy_samples, "more than one sample per prompt needs a temperature above 0")
    assert not (tmp_path / "new").exists()


def test_bench_counts_every_run_prints_a_line_per_prompt_and_saves_its_results(smol_drafter, tmp_path):
    """With no --json, the results go to a dated file in the working folder."""
    from redrafter_mlx.serving.bench import count_runs

    result = run_cli(
        "bench",
        "--drafter",
        smol_drafter,
        "--every",
        4,
        "--num-prompts",
        2,
        "--max-tokens",
        4,
        "--configs",
        "auto,lookup",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    runs = count_runs(2, 2, 1)
    assert f"{runs}/{runs}" in result.stderr  # warm-up and profiled runs counted
    assert "batch 1/2: plain" in result.stderr and "batch 2/2: plain" in result.stderr and "auto " in result.stderr
    (saved,) = tmp_path.glob("bench-*.json")
    assert f"results saved to {saved.name}" in result.stdout
    assert [r["config"] for r in json.loads(saved.read_text())["results"]] == ["auto", "lookup"]


def test_bench_writes_json_and_plot(smol_drafter, tmp_path):
    pytest.importorskip("matplotlib")
    result = run_cli(
        "bench",
        "--drafter",
        smol_drafter,
        "--every",
        3,
        "--num-prompts",
        1,
        "--max-tokens",
        6,
        "--configs",
        "auto,lookup,rnn:2x3,both:1x2",
        "--json",
        tmp_path / "b.json",
        "--plot",
        tmp_path / "b.png",
        "--profile",
    )
    assert result.returncode == 0, result.stderr
    assert (
        "milliseconds per step, by phase" in result.stdout
        and "drafting" in result.stdout
        and "a plain token" in result.stdout
    )
    assert "OpenBLAS" in result.stdout or "Accelerate" in result.stdout or "BLAS" in result.stdout
    assert "verification cost" in result.stdout and "RNN beam search" in result.stdout
    report = json.loads((tmp_path / "b.json").read_text())
    assert {"environment", "settings", "results", "cost_curve"} <= set(report)
    assert report["environment"]["mlx"] and report["environment"]["dtype"] == "float32"
    assert report["settings"]["every"] == 3 and report["settings"]["num_prompts"] == 1
    weights = (Path(smol_drafter) / "model.safetensors").read_bytes()
    assert report["settings"]["drafter_sha256"] == hashlib.sha256(weights).hexdigest()[:16]
    assert [r["config"] for r in report["results"]] == ["auto", "lookup", "rnn:2x3", "both:1x2"]
    for r in report["results"]:
        assert r["mismatches"] == 0 and r["baseline_tps"] > 0 and r["tokens_per_step"] >= 1
        assert r["nodes_per_step"] >= 1 and r["overhead_share"] >= 0
        assert abs(sum(r["time_split"].values()) - 1) < 1e-6
        assert (
            set(r["step_ms"]) == {"host", "packing", "pass", "choice", "drafting", "commit"}
            and r["step_ms"]["pass"] > 0
        )
    assert report["results"][2]["nodes_per_step"] > 1  # rnn:2x3 verifies its beams
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    assert_clean_error(run_cli("bench", "--configs", "fast"), "unknown bench configuration", status=2)
    assert_clean_error(run_cli("bench", "--configs", "auto,lookuplen:0"), "unknown bench configuration 'lookuplen:0'")


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--lookup-beams", 2], "--lookup-beams was removed"),
        (["train", "--soft-targets=1", "--data", "d", "-o", "o"], "--soft-targets was removed"),
        (["train", "--hidden-dropout", 0.1, "--data", "d", "-o", "o"], "--hidden-dropout was removed"),
        (["train", "--lookup-weight", 0.3, "--data", "d", "-o", "o"], "--lookup-weight was removed"),
        (["train", "--no-rnn", "--data", "d", "-o", "o"], "--no-rnn was removed"),
        (["generate", "--no-such-option"], "No such option: --no-such-option"),
        (["frobnicate"], "No such command 'frobnicate'"),
        (["serve", "--port", 99999], "Invalid value for '--port'"),
        (["serve", "--port", 0], "Invalid value for '--port'"),
        (["serve", "--keep-alive", 0], "Invalid value for '--keep-alive': must be more than 0"),
        (["bench", "--repetition-penalty", 1.1], "No such option: --repetition-penalty"),
        (["train", "--output", "o"], "Missing option '--data'"),
        (["generate", "--dtype", "float8"], "Invalid value for '--dtype'"),
    ],
)
def test_removed_unknown_and_out_of_range_options_exit_2_with_one_error_line(args, message):
    assert_clean_error(run_cli(*args), message, status=2)


def test_help_lists_every_command_and_option_defaults():
    result = run_cli("--help")
    for command in ("generate", "chat", "serve", "bench", "make-drafter", "distill", "train", "datastore", "convert"):
        assert command in result.stdout
    generate_help = run_cli("generate", "--help").stdout
    for option in ("--model", "--max-tokens", "--temp", "--top-p", "--seed", "--ignore-chat-template", "--beam-width"):
        assert option in generate_help
    assert "default" in generate_help.lower()


def test_installed_entry_point_runs():
    executable = shutil.which("redrafter-mlx")
    if executable is None:
        pytest.skip("package not installed (run setup.sh)")
    import subprocess

    result = subprocess.run([executable, "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "generate" in result.stdout


def mlx_lm_greedy_answer(question, max_tokens):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from redrafter_mlx.loading.loader import load_base_model

    model, tokenizer = load_base_model(None)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    expected = []
    for token, _ in generate_step(
        mx.array(tokenizer.encode(prompt, add_special_tokens=False)), model, max_tokens=max_tokens
    ):
        if token in tokenizer.eos_token_ids:
            break
        expected.append(token)
    return expected


def test_lookup_only_and_the_shipped_drafter_found_by_model_identity(tmp_path):
    """--drafter none drafts by context lookup alone; the default model
    copied elsewhere and passed with --model still gets its shipped drafter;
    all of them keep mlx-lm's greedy output."""
    from redrafter_mlx.loading.gguf import default_model_path

    question = "Repeat this list twice: apples, pears, plums, figs."
    expected = mlx_lm_greedy_answer(question, 40)
    # A fixed node budget: `auto` sizes the tree by this machine's timings,
    # which a loaded test machine can make plain decoding's.
    lookup = run_cli(
        "generate", "--drafter", "none", "--prompt", question, "--max-tokens", 40, "--max-nodes", 4, "--json"
    )
    assert lookup.returncode == 0, lookup.stderr
    out = json.loads(lookup.stdout)
    assert out["tokens"] == expected and out["tokens_per_step"] > 1.2 and out["nodes_per_step"] > 1

    copy = tmp_path / "elsewhere" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    copy.parent.mkdir()
    shutil.copyfile(default_model_path(), copy)
    found = run_cli(
        "generate", "--model", copy, "--prompt", question, "--max-tokens", 40, "--no-lookup", "--max-nodes", 4, "--json"
    )
    assert found.returncode == 0, found.stderr
    assert "context lookup only" not in found.stderr
    out = json.loads(found.stdout)
    assert out["tokens"] == expected and out["tokens_per_step"] > 1.0


def test_a_model_with_no_shipped_drafter_drafts_by_lookup_and_says_so(chat_model):
    model, _, _, _, _ = chat_model
    result = run_cli("generate", "--model", model, "--prompt", "pick a word", "--max-tokens", 8, "--json")
    assert result.returncode == 0, result.stderr
    assert "no drafter is shipped for this model; drafting by context lookup only" in result.stderr
    assert json.loads(result.stdout)["generation_tokens"] >= 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-nodes", -1], "max nodes"),
        (["--max-nodes", "many"], "Invalid value for '--max-nodes': takes a whole number or 'auto'"),
        (["--lookup-max-ngram", 0], "lookup max ngram must be at least 1"),
        (["--lookup-length", 0], "lookup length"),
        (["--datastore-beams", -1], "datastore beams"),
        (["--drafter", "none", "--beam-width", 4], "does not go with --drafter none"),
        (["--model", "/no/such/path"], "model not found: /no/such/path"),
        (["--model", "missing.gguf"], "model not found: missing.gguf"),
    ],
)
def test_bad_drafting_options_get_one_error_line(args, message):
    assert_clean_error(run_cli("generate", "--prompt", "hi", *args), message)


def test_a_prompt_that_is_not_utf8_gets_one_error_line():
    import subprocess
    import sys

    root = ROOT
    result = subprocess.run(
        [sys.executable, "-m", "redrafter_mlx.cli", "generate", "--prompt", "-"],
        input=b"caf\xe9 \xff\xfe",
        capture_output=True,
        cwd=root,
        env=dict(os.environ),
        timeout=300,
    )
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    assert_clean_error(result, "not UTF-8")


def test_a_temp_dir_that_does_not_exist_gets_one_warning_and_the_command_runs(tmp_path):
    # MLX compiles kernels in TMPDIR; before the fallback this run ended in
    # "RuntimeError: filesystem error: temp_directory_path".
    missing = tmp_path / "gone"
    result = run_cli("generate", "--prompt", "hi", "--max-tokens", 4, "--json", env={"TMPDIR": str(missing)})
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: TMPDIR={missing} is not a directory; using /")
    assert json.loads(result.stdout)["generation_tokens"] >= 1


def test_loading_warns_when_mlx_runs_on_the_reference_blas():
    import subprocess
    import sys

    root = ROOT
    code = "import mlx.core; import redrafter_mlx; from redrafter_mlx.loading.loader import warn_if_slow_blas; warn_if_slow_blas()"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=dict(os.environ)
    )
    assert result.returncode == 0
    if sys.platform.startswith("linux"):
        assert result.stderr.count("\n") == 1 and "slow reference BLAS" in result.stderr


def test_self_prompts_bad_input_gets_one_error_line_and_loses_nothing(chat_model, tmp_path):
    model, _, _, _, _ = chat_model
    assert_clean_error(run_cli("distill", "-o", tmp_path / "a"), "either --prompts FILE or --self-prompts N")
    assert_clean_error(
        run_cli("distill", "--self-prompts", 0, "-o", tmp_path / "a"), "Invalid value for '--self-prompts'", status=2
    )
    # A model without a chat template has no user turn to write.
    plain = tmp_path / "plain"
    shutil.copytree(model, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    for template in plain.glob("chat_template.*"):
        template.unlink()
    assert_clean_error(
        run_cli("distill", "--model", plain, "--self-prompts", 4, "-o", tmp_path / "b"),
        "needs a model with a chat template",
    )
    # A data folder made for another model is refused before anything is written.
    folder = tmp_path / "c"
    folder.mkdir()
    meta = json.dumps({"model": "another", "max_tokens": 256, "temp": 0.0, "top_p": 1.0, "seed": 0, "self_prompts": 4})
    (folder / "meta.json").write_text(meta)
    (folder / "self-prompts.jsonl").write_text('{"prompt": "kept", "source": "self-prompts", "attempt": 0}\n')
    assert_clean_error(
        run_cli("distill", "--model", model, "--self-prompts", 4, "-o", folder), "different settings (model)"
    )
    assert (folder / "meta.json").read_text() == meta
    assert "kept" in (folder / "self-prompts.jsonl").read_text()


def test_distill_answers_a_prompt_log_and_the_log_option_fails_cleanly(chat_model, tmp_path):
    from mlx_lm.utils import load_tokenizer

    from redrafter_mlx.serving.api import encode_prompt
    from redrafter_mlx.training.distill import DataFolder

    model = chat_model[0]
    conversation = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w1 w2"}]
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"messages": conversation}) + "\n" + json.dumps({"tokens": [4, 5, 6]}) + "\n")
    result = run_cli("distill", "--model", model, "--prompts", log, "--output", tmp_path / "d", "--max-tokens", 4)
    assert result.returncode == 0, result.stderr
    data = DataFolder(str(tmp_path / "d")).load()
    prompts = {int(i): data.sequence(n)[: data.prompt_lengths[n]].tolist() for n, i in enumerate(data.prompt_index)}
    assert prompts == {0: encode_prompt(load_tokenizer(model), conversation), 1: [4, 5, 6]}

    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"tokens": [1, 99999]}\n')
    assert_clean_error(
        run_cli("distill", "--model", model, "--prompts", foreign, "-o", tmp_path / "e"),
        "line 1 holds token ids outside the model's vocabulary",
    )
    assert_clean_error(
        run_cli("generate", "--model", model, "--drafter", "none", "--prompts", foreign),
        "prompt token ids must be in [0, ",
    )
    for command in ("chat", "serve"):
        assert_clean_error(
            run_cli(command, "--model", model, "--log-prompts", tmp_path / "no" / "log.jsonl"),
            "cannot write the prompt log",
        )


def test_version_and_shell_completion_in_a_throw_away_home(tmp_path):
    # The shell as named on the command line: Typer otherwise detects it from
    # the process's parents, and a test run's parents need not hold a shell.
    home = {"HOME": str(tmp_path), "SHELL": "/bin/bash", "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    version = run_cli("--version", env=home)
    assert version.returncode == 0 and version.stdout.strip() == "redrafter-mlx 0.1.0"
    shown = run_cli("--show-completion", "bash", env=home)
    assert shown.returncode == 0 and "_REDRAFTER_MLX_COMPLETE" in shown.stdout, shown.stderr
    installed = run_cli("--install-completion", "bash", env=home)
    assert installed.returncode == 0, installed.stderr
    assert "redrafter-mlx" in (tmp_path / ".bashrc").read_text()
    script = tmp_path / ".bash_completions" / "redrafter-mlx.sh"
    assert "_REDRAFTER_MLX_COMPLETE" in script.read_text()
    # What the installed script asks the command when Tab is pressed.
    completed = run_cli(
        env=dict(home, _REDRAFTER_MLX_COMPLETE="complete_bash", COMP_WORDS="redrafter-mlx gen", COMP_CWORD="1")
    )
    assert completed.returncode == 0 and "generate" in completed.stdout.split()
    options = run_cli(
        env=dict(
            home, _REDRAFTER_MLX_COMPLETE="complete_bash", COMP_WORDS="redrafter-mlx serve --max-b", COMP_CWORD="2"
        )
    )
    assert "--max-batch" in options.stdout.split() and "--max-body-bytes" in options.stdout.split()


def test_the_bare_command_and_help_exit_0_without_a_traceback():
    for args in ([], ["--help"], ["-h"], ["chat", "--help"]):
        result = run_cli(*args)
        assert result.returncode == 0 and "Traceback" not in result.stderr, (args, result.stderr)
        assert "Usage" in result.stdout
    chat_help = run_cli("chat", "--help").stdout
    for command in ("/help", "/reset", "/stats", "/quit", "exit", "Ctrl-C"):
        assert command in chat_help


def test_a_failure_at_run_time_exits_1(smol_drafter, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b",, }\n')
    assert_clean_error(run_cli("generate", "--prompts", prompts), "line 2, column 16: not valid JSON", status=1)
    assert_clean_error(run_cli("generate", "--prompts", tmp_path / "missing.jsonl"), "prompts file not found", status=1)


def test_an_answer_cut_by_max_tokens_says_so(smol_drafter):
    cut = run_cli(
        "generate", "--drafter", smol_drafter, "--prompt", "Write a long story about the sea.", "--max-tokens", 5
    )
    assert cut.returncode == 0, cut.stderr
    assert "[stopped at --max-tokens 5]" in cut.stderr and "[stopped" not in cut.stdout
    whole = run_cli("generate", "--drafter", smol_drafter, "--prompt", QUESTION, "--max-tokens", 64)
    assert whole.returncode == 0 and "[stopped" not in whole.stderr, whole.stderr


def test_serve_ended_by_sigterm_while_it_measures_exits_0(tmp_path):
    """A cost curve not yet measured on this machine (an empty cache): the
    server measures it before it serves; a SIGTERM then ends it cleanly."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, REDRAFTER_MLX_CACHE=str(tmp_path))
    process = subprocess.Popen(
        [sys.executable, "-m", "redrafter_mlx.cli", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = []
        for line in process.stderr:
            seen.append(line)
            if line.startswith("measuring this machine's verification cost"):
                break
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=120)
        rest = process.stderr.read()
    finally:
        process.kill()
    assert status == 0, "".join(seen) + rest
    assert "stopped (SIGTERM) before serving" in rest and "Traceback" not in rest


def test_option_groups_lay_a_group_out_in_its_place_and_hand_the_command_one_object():
    import inspect

    from redrafter_mlx.cli import ModelOptions, SamplingOptions, leaving_out, option_groups

    got = {}

    @option_groups
    def command(
        first: int = 1,
        base: ModelOptions = ModelOptions(),
        sampling: leaving_out(SamplingOptions, "seed") = SamplingOptions(),
        last: int = 2,
    ):
        got.update(first=first, base=base, sampling=sampling, last=last)

    names = ["first", "model", "dtype", "temp", "top_p", "top_k", "min_p", "repetition_penalty", "last"]
    assert list(inspect.signature(command).parameters) == names
    command(
        first=3, model="m", dtype=None, temp=0.5, top_p=None, top_k=None, min_p=None, repetition_penalty=None, last=4
    )
    assert got == dict(first=3, base=ModelOptions(model="m"), sampling=SamplingOptions(temp=0.5), last=4)

    def twice(model: str = "", base: ModelOptions = ModelOptions()):
        pass

    def misspelt(sampling: leaving_out(SamplingOptions, "tmp") = SamplingOptions()):
        pass

    with pytest.raises(ValueError, match="duplicate parameter name: 'model'"):
        option_groups(twice)
    with pytest.raises(TypeError, match="SamplingOptions has no options"):
        option_groups(misspelt)


def test_the_readme_holds_the_option_tables_the_declarations_make():
    """The README's option tables are rendered from the same declarations
    as --help (scripts/readme_options.py writes them); every option of every
    command appears in one."""
    import importlib.util

    import typer.main

    from redrafter_mlx.cli import app

    spec = importlib.util.spec_from_file_location("readme_options", os.path.join(ROOT, "scripts", "readme_options.py"))
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)  # defines the renderer; writes nothing unless run as a script
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert tables.render_readme(readme) == readme, "run: python3 scripts/readme_options.py"
    for key in tables.option_tables():
        assert f"<!-- options: {key} -->" in readme
    rows = "\n".join(line for line in readme.splitlines() if line.startswith("|"))
    for name in typer.main.get_command(app).commands:
        for option in tables.command_options(name):
            assert f"`{option.opts[0]}`" in rows, f"{name} {option.opts[0]}"
