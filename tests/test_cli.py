"""The redrafter-mlx command line, run as a user runs it, on the embedded
default model (SmolLM2-135M-Instruct)."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import run_cli

from redrafter_mlx.drafter import DrafterArgs, Drafter, save_drafter

QUESTION = "What is the capital of France? Answer in one sentence."


def assert_clean_error(result, message):
    assert result.returncode != 0
    lines = [l for l in result.stderr.splitlines() if l.strip()]
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

    from redrafter_mlx.loading import load_base_model

    model, tokenizer = load_base_model(None)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True)
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
    result = run_cli("generate", "--prompt", question, "--max-tokens", 48, "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["tokens_per_step"] > 1.2

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from redrafter_mlx.loading import load_base_model

    model, tokenizer = load_base_model(None)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    expected = [t for t, _ in zip((token for token, _ in generate_step(mx.array(ids), model, max_tokens=48)), range(48))]
    assert out["tokens"] == expected[: len(out["tokens"])] and len(out["tokens"]) == 48


def test_ignore_chat_template_encodes_like_mlx_lm(smol_drafter):
    result = run_cli("generate", "--drafter", smol_drafter, "--prompt", "Once upon a time", "--max-tokens", 4, "--ignore-chat-template", "--json")
    assert result.returncode == 0, result.stderr
    from redrafter_mlx.loading import load_base_model

    _, tokenizer = load_base_model(None)
    assert json.loads(result.stdout)["prompt_tokens"] == len(tokenizer.encode("Once upon a time"))


def test_prompts_file_gives_one_json_line_per_prompt_in_order(smol_drafter, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Say hi.", QUESTION, "Count to three."]) + "\n")
    batched = run_cli("generate", "--drafter", smol_drafter, "--prompts", prompts, "--batch-size", 3, "--max-tokens", 12, "--json")
    assert batched.returncode == 0, batched.stderr
    lines = [json.loads(l) for l in batched.stdout.splitlines()]
    assert len(lines) == 3 and "Paris" in lines[1]["text"]
    solo = run_cli("generate", "--drafter", smol_drafter, "--prompt", QUESTION, "--max-tokens", 12, "--json")
    assert json.loads(solo.stdout)["tokens"] == lines[1]["tokens"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--beam-width", 0], "beam width"),
        (["--beam-length", 1], "beam length"),
        (["--max-tokens", -1], "max tokens"),
        (["--temp", -1], "temperature"),
        (["--top-p", 1.5], "top-p"),
        (["--top-k", -2], "top-k"),
    ],
)
def test_bad_settings_get_one_error_line(smol_drafter, args, message):
    assert_clean_error(run_cli("generate", "--drafter", smol_drafter, "--prompt", "hi", *args), message)


def test_bad_drafters_and_prompts(smol_drafter, tmp_path):
    assert_clean_error(run_cli("generate", "--drafter", tmp_path / "missing", "--prompt", "hi"), "not found")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(smol_drafter, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    assert_clean_error(run_cli("generate", "--drafter", corrupt, "--prompt", "hi"), "cannot read drafter weights")
    other = tmp_path / "other"
    save_drafter(Drafter(DrafterArgs(vocab_size=32000, hidden_size=576, exit_dim=64)), str(other))
    assert_clean_error(run_cli("generate", "--drafter", other, "--prompt", "hi"), "vocab_size 32000 does not match the base model's vocabulary size 49152")
    long_prompt = "word " * 9000
    assert_clean_error(run_cli("generate", "--drafter", smol_drafter, "--prompt", "-", input=long_prompt), "context")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_clean_error(run_cli("generate", "--drafter", smol_drafter, "--prompts", empty), "holds no prompts")
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"text": "hi"}\n')
    assert_clean_error(run_cli("generate", "--drafter", smol_drafter, "--prompts", no_field), '"prompt" field')


def test_distill_then_train_on_two_folders_gives_a_drafter_generate_loads(tmp_path):
    """The whole training path from the command line, on the real model: a
    greedy and a sampled data folder (two responses per prompt), one drafter
    trained on both."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Name a colour.", "What is 2+3?", "Say hi.")))
    for folder, temp, samples in (("greedy", "0", 1), ("sampled", "0.7", 2)):
        result = run_cli("distill", "--prompts", prompts, "--output", tmp_path / folder, "--max-tokens", 12, "--temp", temp, "--samples", samples)
        assert result.returncode == 0, result.stderr
    assert "6 responses" in result.stdout
    train = ("train", "--data", tmp_path / "greedy", "--data", tmp_path / "sampled", "--output", tmp_path / "drafter",
             "--steps", 3, "--batch-size", 8, "--exit-dim", 32, "--draft-vocab", 64, "--eval-every", 3)
    result = run_cli(*train)
    assert result.returncode == 0, result.stderr
    training = json.loads((tmp_path / "drafter" / "config.json").read_text())["training"]
    assert training["sequences"] == 9 and [s["temp"] for s in training["distill_settings"]] == [0.0, 0.7]
    result = run_cli("generate", "--drafter", tmp_path / "drafter", "--prompt", "Say hi.", "--max-tokens", 8)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    assert_clean_error(run_cli(*train[:4], tmp_path / "greedy", *train[5:]), "given twice")
    assert_clean_error(run_cli(*train[:4], tmp_path, *train[5:]), "not a distillation data folder")
    greedy_samples = run_cli("distill", "--prompts", prompts, "--output", tmp_path / "new", "--samples", 2)
    assert_clean_error(greedy_samples, "--samples above 1 needs --temp above 0")
    assert not (tmp_path / "new").exists()


def test_bench_writes_json_and_plot(smol_drafter, tmp_path):
    pytest.importorskip("matplotlib")
    result = run_cli(
        "bench", "--drafter", smol_drafter, "--every", 3, "--num-prompts", 1, "--max-tokens", 6, "--beam-widths", "1,2",
        "--beam-lengths", 2, "--json", tmp_path / "b.json", "--plot", tmp_path / "b.png",
    )
    assert result.returncode == 0, result.stderr
    assert "OpenBLAS" in result.stdout or "Accelerate" in result.stdout or "BLAS" in result.stdout
    report = json.loads((tmp_path / "b.json").read_text())
    assert {"environment", "settings", "results"} <= set(report)
    assert report["environment"]["mlx"] and report["environment"]["dtype"] == "float32"
    assert report["settings"]["every"] == 3 and report["settings"]["num_prompts"] == 1
    weights = (Path(smol_drafter) / "model.safetensors").read_bytes()
    assert report["settings"]["drafter_sha256"] == hashlib.sha256(weights).hexdigest()[:16]
    assert [(r["beam_width"], r["beam_length"]) for r in report["results"]] == [(1, 2), (2, 2)]
    for r in report["results"]:
        assert r["greedy_mismatches"] == 0 and r["baseline_tps"] > 0 and r["tokens_per_step"] >= 1
        assert abs(sum(r["time_split"].values()) - 1) < 1e-6
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_help_lists_every_command_and_option_defaults():
    result = run_cli("--help")
    for command in ("generate", "chat", "bench", "convert", "distill", "train"):
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
