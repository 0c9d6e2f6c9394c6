"""Kill each long job with SIGKILL at random points of its own run, resume
it, and compare what it ends with against an uninterrupted run, byte for
byte; and check that no folder a killed run leaves loads as a drafter.

    python3 bench/kill_resume.py --points 20 --json bench/results/robustness/kill-resume.json

The jobs run on a tiny random chat model (the tests' own), from the command
line, as a user runs them: ``distill``, ``train``, ``datastore`` and
``make-drafter``. Each job first runs uninterrupted, timed. A trial's kill
comes a random time after the run first writes into its output, drawn
uniformly from the span the uninterrupted run worked after its first
write: the kills land in its work, not in its start-up. A draw that lands
after the run has ended is drawn again, until ``--points`` kills landed.
The tests run a short version (``tests/training/test_kill_resume.py``).
"""

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from conftest import CHAT_VOCAB, save_word_tokenizer, tiny_model  # noqa: E402
from redrafter_mlx.drafting.datastore import load_datastore  # noqa: E402
from redrafter_mlx.drafting.drafter import load_drafter  # noqa: E402
from redrafter_mlx.training.distill import DataFolder  # noqa: E402

JOBS = ("distill", "train", "datastore", "make-drafter")
TRAIN_OPTIONS = [
    "--steps",
    "500",
    "--eval-every",
    "100",
    "--batch-size",
    "32",
    "--exit-dim",
    "32",
    "--draft-vocab",
    "128",
    "--depth",
    "3",
]
TIMINGS = (
    "seconds",
    "cpu_seconds",
    "seconds_this_run",
    "stage_minutes",
    "hours",
    "cpu_hours",
)  # fields that differ between any two runs


def make_inputs(folder: Path, prompts: int = 64) -> tuple[Path, Path]:
    """A tiny random chat model (mlx-lm folder) and a prompts file."""
    from mlx_lm.utils import save_config, save_model

    model = tiny_model("llama", seed=21, vocab=CHAT_VOCAB)
    save_model(folder / "model", model)
    save_config(dict(vars(model.args)), folder / "model" / "config.json")
    save_word_tokenizer(folder / "model", CHAT_VOCAB)
    lines = [json.dumps({"prompt": f"w{i} w{i + 7} w{3 * i % 50} w{(5 * i) % 97}"}) for i in range(prompts)]
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "model", folder / "prompts.jsonl"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def without_timings(value):
    """A JSON value with the fields that hold times left out."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def data_state(folder: Path) -> dict:
    """A data folder's shards, hidden states and metadata, by file: digests
    of the arrays (a shard's zip entries carry their write times)."""
    import numpy as np

    state = {}
    for shard in DataFolder(folder).shards():
        with np.load(shard) as data:
            state[shard.name] = {k: hashlib.sha256(data[k].tobytes()).hexdigest()[:16] for k in sorted(data.files)}
    for path in sorted(folder.glob("hidden-*.npy")) + [folder / "meta.json"]:
        state[path.name] = digest(path)
    return state


def drafter_state(folder: Path) -> dict:
    """A drafter folder's weights and datastore, byte for byte, and its
    configuration without the times it records."""
    state = {name: digest(folder / name) for name in ("model.safetensors", "datastore.npy") if (folder / name).exists()}
    config = json.loads((folder / "config.json").read_text())
    config.get("made", {}).pop("held_out_speed", None)  # measured speed differs between any two runs
    state["config"] = hashlib.sha256(json.dumps(without_timings(config), sort_keys=True).encode()).hexdigest()[:16]
    return state


def loads_as_drafter(folder: Path) -> bool:
    try:
        drafter = load_drafter(str(folder))
        load_datastore(folder, drafter.args.vocab_size)
        return True
    except Exception:
        return False


@dataclass
class Job:
    """One command: its arguments for an output folder, what it starts
    from (prepared afresh for each run), what it ends with, and the folders
    a killed run must not leave loadable as a drafter."""

    name: str
    arguments: Callable[[Path], list]
    prepare: Callable[[Path], None] = lambda out: None
    result: Callable[[Path], dict] = field(default=lambda out: {})
    not_a_drafter: Callable[[Path], list] = lambda out: []
    watched: Callable[[Path], list] = lambda out: [out]  # where the first write shows (none: from the start)


def jobs(model: Path, prompts: Path, reference_data: Path, reference_drafter: Path) -> dict:
    def copy_data(out: Path) -> None:
        shutil.copytree(reference_data, out.parent / (out.name + "-data"))

    def copy_drafter(out: Path) -> None:
        shutil.copytree(reference_drafter, out)
        (out / "datastore.npy").unlink(missing_ok=True)

    def data_of(out: Path) -> Path:
        return out.parent / (out.name + "-data")

    return {
        "distill": Job(
            "distill",
            lambda out: [
                "distill",
                "--model",
                model,
                "--prompts",
                prompts,
                "--output",
                out,
                "--max-tokens",
                "48",
                "--batch-size",
                "4",
                "--shard-size",
                "4",
            ],
            result=data_state,
        ),
        "train": Job(
            "train",
            lambda out: [
                "train",
                "--model",
                model,
                "--data",
                data_of(out),
                "--output",
                out,
                *TRAIN_OPTIONS,
                "--save-every",
                "20",
            ],
            prepare=copy_data,
            result=lambda out: dict(drafter_state(out), data=data_state(data_of(out))),
            not_a_drafter=lambda out: [out],
            watched=lambda out: [out.parent / (out.name + ".train"), out],
        ),
        "datastore": Job(
            "datastore",
            lambda out: ["datastore", "--data", reference_data, "--drafter", out],
            prepare=copy_drafter,
            result=lambda out: dict(drafter_state(out), card=digest(out / "README.md")),
            watched=lambda out: [],
        ),  # its one write is its last act: kills land anywhere in it
        "make-drafter": Job(
            "make-drafter",
            lambda out: [
                "make-drafter",
                "--model",
                model,
                "--prompts",
                prompts,
                "--output",
                out,
                "--max-prompts",
                "12",
                "--steps",
                "12",
                "--max-tokens",
                "12",
                "--held-out",
                "3",
                "--measure-prompts",
                "2",
            ],
            result=lambda out: dict(
                drafter_state(out),
                **{
                    f.name: data_state(f)
                    for f in sorted((out.parent / (out.name + ".make")).glob("distill-*"))
                    if f.is_dir()
                },
            ),
            not_a_drafter=lambda out: [out],
            watched=lambda out: [out.parent / (out.name + ".make")],
        ),
    }


def start(job: Job, out: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "redrafter_mlx.cli", *map(str, job.arguments(out))],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(job: Job, out: Path, env: dict) -> None:
    process = start(job, out, env)
    _, err = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{job.name} failed: {err.strip().splitlines()[-1] if err.strip() else process.returncode}")


def reference(job: Job, out: Path, env: dict) -> tuple[dict, float, float]:
    """The uninterrupted run: (its result, when it first wrote, when it ended)."""
    clear(out)
    job.prepare(out)
    tic = time.perf_counter()
    process = start(job, out, env)
    first = None
    while process.poll() is None:
        if first is None and (not job.watched(out) or any(p.exists() for p in job.watched(out))):
            first = time.perf_counter() - tic
        time.sleep(0.01)
    total = time.perf_counter() - tic
    if process.returncode != 0:
        raise RuntimeError(f"{job.name} failed: {process.stderr.read().strip()}")
    return job.result(out), first if first is not None else 0.0, total


def clear(out: Path) -> None:
    """Remove a run's folders: its output and those beside it (``OUT-data``, ``OUT.train``, ``OUT.make``)."""
    for path in out.parent.glob(out.name + "*"):
        shutil.rmtree(path, ignore_errors=True)


def killed_and_resumed(job: Job, out: Path, env: dict, after: float, expected: dict) -> dict:
    """One trial: start, SIGKILL ``after`` seconds after the run first wrote
    into its output, look at what is left, and run the same command again
    to its end. A folder the killed run left may load as a drafter only if
    it is the finished one (a run killed after its last rename, before it
    exited)."""
    clear(out)
    job.prepare(out)
    process = start(job, out, env)
    tic = time.perf_counter()
    watched = job.watched(out)
    while watched and process.poll() is None and not any(p.exists() for p in watched):
        time.sleep(0.002)
    first = time.perf_counter() - tic
    deadline = time.perf_counter() + after
    while process.poll() is None and time.perf_counter() < deadline:
        time.sleep(0.002)
    finished_first = process.poll() is not None
    if not finished_first:
        process.send_signal(signal.SIGKILL)
    process.wait()
    trial = {"kill_at_seconds": round(first + after, 3), "finished_before_the_kill": finished_first}
    if not finished_first:
        loadable = [p for p in job.not_a_drafter(out) if loads_as_drafter(p)]
        trial["left_finished"] = bool(loadable) and job.result(out) == expected
        trial["left_loadable"] = [p.name for p in loadable if not trial["left_finished"]]
    finish(job, out, env)
    trial["result"] = job.result(out)
    return trial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma-separated, of " + ", ".join(JOBS))
    parser.add_argument("--points", type=int, default=20, help="kill points per job")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill points")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    summary = run(args.jobs.split(","), args.points, args.seed, say=lambda line: print(line, flush=True))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


def run(names: list, points: int, seed: int, say=print) -> dict:
    """Every job's reference run and ``points`` killed-and-resumed runs;
    returns the counts and every trial."""
    unknown = [name for name in names if name not in JOBS]
    if unknown:
        raise SystemExit(f"error: unknown job {unknown[0]}; the jobs are {', '.join(JOBS)}")
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="kill-resume-"))
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))  # the tests add theirs
    env = dict(os.environ, PYTHONPATH=path, REDRAFTER_MLX_CACHE=str(work / "cache"))
    try:
        model, prompts = make_inputs(work)
        # What train and datastore start from: one distillation, one training.
        finish(jobs(model, prompts, work / "data", work / "drafter")["distill"], work / "data", env)
        finish(
            Job(
                "train",
                lambda out: ["train", "--model", model, "--data", work / "data", "--output", out, *TRAIN_OPTIONS],
            ),
            work / "drafter",
            env,
        )
        summary = {"points_per_job": points, "seed": seed, "jobs": {}}
        for name in names:
            job = jobs(model, prompts, work / "data", work / "drafter")[name]
            # Every run at the same path: the output's name is in what it writes.
            out = work / "runs" / name
            out.parent.mkdir(exist_ok=True)
            expected, first, total = reference(job, out, env)
            # Points that land after a run has ended (it may run faster than
            # the reference) are drawn again, up to 3 times as many trials.
            trials = []
            while sum(not t["finished_before_the_kill"] for t in trials) < points and len(trials) < 3 * points:
                after = rng.uniform(0, total - first)
                trial = killed_and_resumed(job, out, env, after, expected)
                trial["identical"] = trial.pop("result") == expected
                trials.append(trial)
                say(
                    f"{name} {len(trials)}: killed at {trial['kill_at_seconds']:.2f} s of about {total:.2f} s"
                    + (" (it had finished)" if trial["finished_before_the_kill"] else "")
                    + f", resumed {'identical' if trial['identical'] else 'DIFFERENT'}"
                    + (" (after its last rename)" if trial.get("left_finished") else "")
                    + (
                        f", left a partial drafter that loads in {trial['left_loadable']}"
                        if trial.get("left_loadable")
                        else ""
                    )
                )
            summary["jobs"][name] = {
                "uninterrupted_seconds": round(total, 2),
                "first_write_seconds": round(first, 2),
                "identical": sum(t["identical"] for t in trials),
                "trials": len(trials),
                "killed": sum(not t["finished_before_the_kill"] for t in trials),
                "left_loadable": sum(bool(t.get("left_loadable")) for t in trials),
                "each": trials,
            }
            say(
                f"{name}: {summary['jobs'][name]['killed']} kills landed; {summary['jobs'][name]['identical']} of {len(trials)} resumed runs identical, "
                f"{summary['jobs'][name]['left_loadable']} killed runs left a partial folder that loads as a drafter"
            )
        summary["identical"] = sum(j["identical"] for j in summary["jobs"].values())
        summary["trials"] = sum(j["trials"] for j in summary["jobs"].values())
        return summary
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
