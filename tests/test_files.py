"""Files written beside and renamed (``redrafter_mlx.files``); and a full
disk, on a real small file system, stops a long job in one line, keeps what
it wrote, and the job resumes to the same result once space is freed."""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import ROOT
from redrafter_mlx import files
from redrafter_mlx.errors import UserError

sys.path.insert(0, os.path.join(ROOT, "bench"))

import kill_resume  # noqa: E402


def test_a_file_is_replaced_whole_and_a_failed_write_leaves_the_old_one(tmp_path):
    path = tmp_path / "a.json"
    files.write_json(path, {"n": 1})
    with pytest.raises(ZeroDivisionError):
        with files.replacing(path) as temporary:
            temporary.write_text("half")
            1 / 0
    assert json.loads(path.read_text()) == {"n": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]  # no temporary left
    files.write_text(path, "new")
    assert path.read_text() == "new"


def test_a_write_into_a_read_only_folder_is_one_error_naming_the_path(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(UserError, match=f"cannot write {folder / 'x'} .*ermission"):
            files.write_text(folder / "x", "data")
    finally:
        folder.chmod(0o700)


def test_temporaries_a_killed_write_left_are_recognised_and_removed(tmp_path):
    (tmp_path / "keep.npy").write_text("x")
    (files.temporary_beside(tmp_path / "shard-00001.npz")).write_text("half")
    files.remove_temporaries(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.npy"]


class SmallDisk:
    """A tmpfs of a given size, mounted for the test (needs root)."""

    def __init__(self, path: Path, size: int):
        self.path = path
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small file system here: {done.stderr.decode().strip()}")

    def grow(self, size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def unmount(self) -> None:
        subprocess.run(["umount", str(self.path)], check=False)


def error_lines(stderr: str) -> list:
    """The lines of an error output that begin with "error:" (progress bars
    rewrite their line with carriage returns)."""
    return [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith("error:")]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="mounting a tmpfs needs Linux and root")
def test_a_full_disk_stops_distill_and_train_in_one_line_and_they_resume_to_the_same_result(tmp_path):
    model, prompts = kill_resume.make_inputs(tmp_path)
    env = dict(os.environ, REDRAFTER_MLX_CACHE=str(tmp_path / "cache"))
    reference = tmp_path / "reference" / "data"
    reference.parent.mkdir()
    jobs = kill_resume.jobs(model, prompts, reference, tmp_path / "unused")
    kill_resume.finish(jobs["distill"], reference, env)
    expected_data = kill_resume.data_state(reference)
    train_reference = tmp_path / "reference" / "drafter"
    jobs["train"].prepare(train_reference)
    kill_resume.finish(jobs["train"], train_reference, env)
    expected_drafter = kill_resume.drafter_state(train_reference)
    checkpoint = folder_bytes(train_reference.with_name("drafter.train") / "checkpoint")

    def run(job, out):
        return subprocess.run(
            [sys.executable, "-m", "redrafter_mlx.cli", *map(str, job.arguments(out))],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )

    # Distillation on a disk with room for half its data.
    disk = SmallDisk(tmp_path / f"disk-{uuid.uuid4().hex[:6]}", folder_bytes(reference) // 2)
    try:
        out = disk.path / "runs" / "data"
        out.parent.mkdir()
        failed = run(jobs["distill"], out)
        assert failed.returncode != 0
        (line,) = error_lines(failed.stderr)
        assert line.startswith(f"error: cannot write {out}/") and "the disk is full: it needs about" in line, (
            failed.stderr
        )
        assert "Traceback" not in failed.stderr and "intact" in line
        assert failed.stderr.rstrip().endswith(line)
        kept = kill_resume.data_state(out)
        assert 0 < len(kept) and all(kept[name] == expected_data[name] for name in kept if name != "meta.json")
        assert not [p for p in out.iterdir() if files.is_temporary(p)]
        disk.grow(4 * folder_bytes(reference) + (1 << 20))
        resumed = run(jobs["distill"], out)
        assert resumed.returncode == 0, resumed.stderr
        assert kill_resume.data_state(out) == expected_data
    finally:
        disk.unmount()

    # Training on a disk with room for one checkpoint, not for the next
    # beside it: the first stays, and the run resumes from it.
    disk = SmallDisk(tmp_path / f"disk-{uuid.uuid4().hex[:6]}", int(checkpoint * 1.6))
    try:
        out = disk.path / "runs" / "train"
        out.parent.mkdir()
        # The data the job reads beside its output (OUT-data) stays on the
        # large disk: only the training state is on the small one.
        shutil.copytree(reference, tmp_path / "train-data")
        os.symlink(tmp_path / "train-data", out.with_name("train-data"))
        failed = run(jobs["train"], out)
        assert failed.returncode != 0
        (line,) = error_lines(failed.stderr)
        assert (
            line.startswith("error: cannot write ")
            and "the disk is full" in line
            and "checkpoint of step 20 is kept" in line
        ), failed.stderr
        assert "Traceback" not in failed.stderr
        state = json.loads((out.with_name("train.train") / "checkpoint" / "trainer.json").read_text())
        assert state["step"] == 20
        disk.grow(8 * checkpoint + (1 << 20))
        resumed = run(jobs["train"], out)
        assert resumed.returncode == 0, resumed.stderr
        assert "resuming from step 20" in resumed.stdout
        # The weights byte for byte (its config names other folders than the reference's).
        assert kill_resume.drafter_state(out)["model.safetensors"] == expected_drafter["model.safetensors"]
    finally:
        disk.unmount()
