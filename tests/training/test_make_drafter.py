"""``redrafter-mlx make-drafter`` end to end on a tiny chat model: a working
drafter, and a run killed between stages that resumes to the same weights."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from redrafter_mlx.errors import UserError
from redrafter_mlx.training.make_drafter import check_disk, draft_vocab_size, split_prompts, work_folder

SIZES = ["--max-prompts", 12, "--steps", 6, "--max-tokens", 12, "--held-out", 3, "--measure-prompts", 2]


def prompts_file(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 7} w{3 * i % 50}"}) + "\n" for i in range(15)))
    return path


def test_make_drafter_makes_a_drafter_and_a_killed_run_resumes_to_the_same_weights(chat_model, tmp_path):
    model = chat_model[0]
    prompts = prompts_file(tmp_path / "prompts.jsonl")
    env = {"REDRAFTER_MLX_CACHE": str(tmp_path / "cache")}
    straight = run_cli(
        "make-drafter", "--model", model, "--prompts", prompts, "--output", tmp_path / "a", *SIZES, env=env
    )
    assert straight.returncode == 0, straight.stderr
    a = tmp_path / "a"
    assert sorted(p.name for p in a.iterdir()) == ["README.md", "config.json", "datastore.npy", "model.safetensors"]
    plan = json.loads((work_folder(str(a)) / "plan.json").read_text())
    assert plan["kind"] == "chat" and [r["temp"] for r in plan["runs"]] == [0.0, 0.7]
    assert len(plan["train_prompts"]) == 12 and len(plan["held_out_prompts"]) == 3
    assert not set(plan["train_prompts"]) & set(plan["held_out_prompts"])
    config = json.loads((a / "config.json").read_text())
    assert config["made"]["held_out_speed"]["temp 0"]["auto"]["mismatches"] == 0
    card = (a / "README.md").read_text()
    assert "## How it was made" in card and "redrafter-mlx make-drafter" in card and "held-out prompts" in card

    # The same run, killed once a stage is done and run again.
    command = [
        sys.executable,
        "-m",
        "redrafter_mlx.cli",
        "make-drafter",
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--output",
        str(tmp_path / "b"),
        *map(str, SIZES),
    ]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=dict(os.environ, **env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    done = work_folder(str(tmp_path / "b")) / "done.json"
    deadline = time.time() + 120
    while (
        not (done.exists() and "distill-t0" in done.read_text()) and time.time() < deadline and process.poll() is None
    ):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert "train" not in json.loads(done.read_text())  # killed in the middle
    resumed = run_cli(*command[3:], env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming the run planned in" in resumed.stderr and "[distill-t0] done already" in resumed.stderr
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (a / "model.safetensors").read_bytes()
    assert (tmp_path / "b" / "datastore.npy").read_bytes() == (a / "datastore.npy").read_bytes()

    used = run_cli("generate", "--model", model, "--drafter", a, "--prompt", "w1 w2", "--max-tokens", 8, "--json")
    assert used.returncode == 0 and json.loads(used.stdout)["generation_tokens"] >= 1, used.stderr


def test_what_cannot_work_is_refused_in_one_line(chat_model, tmp_path):
    plain = tmp_path / "plain"
    import shutil

    shutil.copytree(chat_model[0], plain)
    tokenizer_config = json.loads((plain / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for template in plain.glob("chat_template.*"):
        template.unlink()
    result = run_cli("make-drafter", "--model", plain, "--output", tmp_path / "d", "--max-prompts", 4, "--steps", 2)
    assert result.returncode == 1 and "no chat template" in result.stderr and "Traceback" not in result.stderr
    assert not work_folder(str(tmp_path / "d")).exists()
    with pytest.raises(UserError, match="too little disk"):
        check_disk(tmp_path, 10**18)


def test_sizes_come_from_the_model():
    assert draft_vocab_size(49152) == 12288 and draft_vocab_size(262144) == 16384 and draft_vocab_size(1000) == 1000
    train, held = split_prompts(100, 5, seed=0)
    assert (
        len(held) == 5 and sorted(train + held) == list(range(100)) and split_prompts(100, 5, seed=0) == (train, held)
    )


def test_a_plan_written_by_hand_runs_its_own_prompts_files(chat_model, tmp_path):
    """``--plan FILE``, as ``bench/train_default_drafter.sh`` gives the
    shipped drafter's recipe: runs with prompts files of their own (the
    shortest N, the first N), one feeding the datastore alone."""
    prompts = prompts_file(tmp_path / "prompts.jsonl")
    plan = {
        "runs": [
            {"name": "greedy", "prompts": str(prompts), "shortest": 8, "temp": 0.0, "seed": 0, "max_tokens": 10},
            {
                "name": "extra",
                "prompts": str(prompts),
                "limit": 5,
                "temp": 0.7,
                "seed": 1,
                "max_tokens": 10,
                "datastore_only": True,
            },
        ],
        "train": {
            "steps": 4,
            "batch_size": 16,
            "exit_dim": 64,
            "warm_start": True,
            "freeze_head_steps": 4,
            "draft_vocab": 64,
            "eval_every": 4,
        },
        "measure": {"prompts_file": str(prompts), "prompts": 1, "max_tokens": 8, "temps": [0.0]},
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = run_cli(
        "make-drafter",
        "--model",
        chat_model[0],
        "--plan",
        tmp_path / "plan.json",
        "--output",
        tmp_path / "d",
        env={"REDRAFTER_MLX_CACHE": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr
    work = work_folder(str(tmp_path / "d"))
    assert len((work / "greedy.jsonl").read_text().splitlines()) == 8
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["training"]["data"] == [str(work / "greedy")] and config["draft_vocab_size"] == 64
    done = json.loads((work / "done.json").read_text())
    assert int(done["datastore"]["answers"]) > 8  # the extra run's answers too
    assert "`prompts.jsonl`" in (tmp_path / "d" / "README.md").read_text()
