"""Distillation data: batched greedy generation, shards, resume, bad input."""

import errno

import numpy as np
import pytest

from conftest import tiny_model
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.sampling import SamplingSettings
from redrafter_mlx.errors import UserError
from redrafter_mlx.training.distill import DataFolder, distill, hidden_path, response_stream

PROMPTS = ["hello there", "a", "what is two plus two?", "xyz" * 7, "tell me a story", "ok", "1 2 3 4 5"]


def tokenize(text):
    return [ord(c) % 256 for c in text]


@pytest.fixture(scope="module")
def base():
    return BaseModel(tiny_model("llama", seed=3))


def generator(base, max_tokens=20, eos=(7,), sampling=SamplingSettings()):
    return response_stream(base, max_tokens, sampling, eos)


def run(base, folder, prompts=PROMPTS, batch_size=3, generate=None, samples=1):
    generate = generate or generator(base)
    return distill(
        base,
        tokenize,
        prompts,
        DataFolder(folder),
        {"max_tokens": 20},
        generate,
        batch_size,
        samples,
        shard_size=3,
        progress=False,
    )


def interrupted_after(finished, generate):
    """``generate`` stopped by Ctrl-C once ``finished`` responses are out
    (over all its calls: one per chunk)."""
    count = [0]

    def interrupted(prompts, batch_size, samples):
        for result in generate(prompts, batch_size, samples):
            if count[0] == finished:
                raise KeyboardInterrupt
            count[0] += 1
            yield result

    return interrupted


def folder_contents(folder):
    """Every array of every shard and hidden-state file, by file name."""
    contents = {}
    for shard in DataFolder(folder).shards():
        with np.load(shard) as data:
            contents[shard.name] = {k: data[k].tolist() for k in data.files}
        contents[shard.name]["hidden"] = np.load(hidden_path(shard)).tobytes()
    return contents


def sequences_by_prompt(folder):
    data = DataFolder(folder).load()
    return {int(data.prompt_index[i]): data.sequence(i).tolist() for i in range(len(data))}


def test_batched_output_equals_single_prompt_generation_and_is_deterministic(base, tmp_path):
    run(base, tmp_path / "a", batch_size=3)
    run(base, tmp_path / "b", batch_size=7)
    batched = sequences_by_prompt(tmp_path / "a")
    assert batched == sequences_by_prompt(tmp_path / "b")
    assert sorted(batched) == list(range(len(PROMPTS)))
    generate = generator(base)
    for i, prompt in enumerate(PROMPTS):
        ((_, response, hidden),) = generate([tokenize(prompt)], 1, [0])
        assert batched[i] == tokenize(prompt) + response
        assert hidden.shape == (len(response), 64)
    lengths = {len(s) - len(tokenize(PROMPTS[i])) for i, s in batched.items()}
    assert len(lengths) > 1  # rows stopped at EOS at different points


def test_a_hybrid_model_distills_as_one_prompt_at_a_time_does(tmp_path):
    """A model with recurrent layers: batched rows of different lengths give
    what each prompt alone gives, with one hidden state per response token."""
    hybrid = BaseModel(tiny_model("qwen3_next", seed=3))
    run(hybrid, tmp_path / "a", prompts=PROMPTS[:4], batch_size=4)
    batched = sequences_by_prompt(tmp_path / "a")
    generate = generator(hybrid)
    for i, prompt in enumerate(PROMPTS[:4]):
        ((_, response, hidden),) = generate([tokenize(prompt)], 1, [0])
        assert batched[i] == tokenize(prompt) + response
        assert hidden.shape == (len(response), 64)


def test_interrupted_run_resumes_without_redoing_prompts(base, tmp_path):
    generate = generator(base)

    with pytest.raises(KeyboardInterrupt):
        run(base, tmp_path / "d", generate=interrupted_after(4, generate))
    assert len(DataFolder(tmp_path / "d").shards()) == 1  # the first chunk of 3 was written, the second was cut
    totals = run(base, tmp_path / "d")
    assert totals["new_responses"] == len(PROMPTS) - 3
    run(base, tmp_path / "full")
    assert sequences_by_prompt(tmp_path / "d") == sequences_by_prompt(tmp_path / "full")
    assert folder_contents(tmp_path / "d") == folder_contents(tmp_path / "full")  # the same shards, state for state


def test_several_sampled_responses_per_prompt_resume_and_are_reproducible(base, tmp_path):
    sampled = generator(base, eos=(), sampling=SamplingSettings(temp=1.0, seed=3))

    with pytest.raises(KeyboardInterrupt):
        run(base, tmp_path / "d", generate=interrupted_after(7, sampled), samples=3)
    totals = run(base, tmp_path / "d", generate=sampled, samples=3)
    assert totals["new_responses"] == 3 * len(PROMPTS) - 6 and totals["responses"] == 3 * len(PROMPTS)
    run(base, tmp_path / "other-batches", generate=sampled, samples=3, batch_size=5)

    def responses(folder):
        by_unit = {}
        for shard in DataFolder(folder).shards():
            with np.load(shard) as f:
                ends = np.cumsum(f["lengths"])
                for i, k, end, n in zip(f["prompt_index"].tolist(), f["sample"].tolist(), ends, f["lengths"]):
                    by_unit[i, k] = f["tokens"][end - n : end].tolist()
        return by_unit

    interrupted_run, other = responses(tmp_path / "d"), responses(tmp_path / "other-batches")
    assert sorted(interrupted_run) == [(i, k) for i in range(len(PROMPTS)) for k in range(3)]
    assert interrupted_run == other  # a response depends only on its prompt, sample number and seed
    for i in range(len(PROMPTS)):
        assert len({tuple(interrupted_run[i, k]) for k in range(3)}) == 3  # different samples
    # The first sample is what a one-response run gives.
    run(base, tmp_path / "single", generate=sampled)
    assert sequences_by_prompt(tmp_path / "single") == {i: interrupted_run[i, 0] for i in range(len(PROMPTS))}
    with pytest.raises(UserError, match="different settings"):
        run(base, tmp_path / "single", generate=sampled, samples=2)


def test_out_of_disk_keeps_written_shards(base, tmp_path, monkeypatch):
    run(base, tmp_path / "d", prompts=PROMPTS[:3])
    before = sequences_by_prompt(tmp_path / "d")

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", no_space)
    folder = DataFolder(tmp_path / "d")
    with pytest.raises(UserError, match="shard-00001.npz.*disk is full.*intact"):
        folder.write_shard([5], [3], [[1, 2, 3, 4]])
    assert sequences_by_prompt(tmp_path / "d") == before
    assert not list((tmp_path / "d").glob(".*partial*"))


def test_folder_for_another_model_or_other_settings_is_refused(base, tmp_path):
    run(base, tmp_path / "d", prompts=PROMPTS[:2])
    with pytest.raises(UserError, match="hidden_size 64, but this model has 576"):
        DataFolder(tmp_path / "d").check_model(256, 576)
    with pytest.raises(UserError, match="different settings"):
        run(base, tmp_path / "d", prompts=PROMPTS[:4])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a distillation data folder"):
        run(base, tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_a_worker_leaves_when_its_parent_is_killed(tmp_path):
    # Before leave_with_parent, `kill` of a `distill --workers 2` left both
    # workers decoding for the rest of the session.
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent("""
        import multiprocessing, time
        from redrafter_mlx.training.distill import leave_with_parent

        def child():
            leave_with_parent()
            time.sleep(600)

        if __name__ == "__main__":
            process = multiprocessing.get_context("spawn").Process(target=child, daemon=True)
            process.start()
            print(process.pid, flush=True)
            time.sleep(600)
    """)
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    child = int(parent.stdout.readline())

    def running(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        stat = f"/proc/{pid}/stat"  # a zombie is gone, only not yet reaped
        return not (os.path.exists(stat) and open(stat).read().split(")")[-1].split()[0] == "Z")

    try:
        time.sleep(3)  # the child imports the package and starts watching
        parent.kill()
        parent.wait()
        deadline = time.time() + 20
        while running(child) and time.time() < deadline:
            time.sleep(0.2)
        assert not running(child)
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)
