"""A model split over ranks (engine.distributed): separate processes on
127.0.0.1 with free ports, started as mlx.launch starts them (MLX_RANK and
a ring hostfile), each with a hard timeout and its exit status checked."""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest

from conftest import (
    ROOT,
    OracleDrafter,
    mlx_lm_greedy,
    run,
    run_cli,
    save_word_tokenizer,
    start_server,
    stop_server,
    tiny_drafter,
    tiny_model,
)
from redrafter_mlx.drafting.drafter import save_drafter
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.cache import CacheLayout, TreeKVCache, extend_batch
from redrafter_mlx.engine.distributed import Skip, SkippedCache
from redrafter_mlx.engine.types import ReDrafter

PROMPTS = [[20, 21, 22, 20, 21, 22, 20, 21], [30, 31], [40, 41, 42, 43, 40, 41]]  # token ids
TIMEOUT = 180


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


# A rank on another kind of chip, which rounds differently, exaggerated: it
# chooses other tokens than rank 0 at every step, and drafts others (every
# other search, one beam fewer: a step whose shapes differ too).
OTHER_CHIP = """
import itertools
import sys
import cli
from redrafter_mlx.engine import decoder, distributed

distributed.numerics = lambda: "another chip"

choose, search, calls = decoder.Decoder._choose, decoder.Decoder._search, itertools.count()

def other_choice(self, logits, history):
    choices, *rest = choose(self, logits, history)
    return ((choices + 1) % logits.shape[-1], *rest)

def other_search(self, hidden, first_tokens, length=0):
    beams, probs = search(self, hidden, first_tokens, length)
    beams, probs = (beams + 1) % 256, probs * 0.5
    return (beams[:, 1:], probs[:, 1:]) if next(calls) % 2 else (beams, probs)

decoder.Decoder._choose, decoder.Decoder._search = other_choice, other_search
cli.main(sys.argv[1:])
"""


def start_ranks(tmp_path, per_rank_args: list, programs=None) -> list:
    """One process per entry of ``per_rank_args``, as ranks of a ring; the
    ranks in ``programs`` run that Python code (which patches the package,
    then runs the command) instead of the plain command."""
    hostfile = tmp_path / f"hosts-{time.monotonic_ns()}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(len(per_rank_args))]))
    processes = []
    for rank, args in enumerate(per_rank_args):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
        program = ["-c", programs[rank]] if rank in (programs or {}) else ["-m", "redrafter_mlx.cli"]
        processes.append(
            subprocess.Popen(
                [sys.executable, *program, *map(str, args)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return processes


def launch(tmp_path, per_rank_args: list, kill_rank=None, programs=None) -> list[tuple[int, str, str]]:
    """Run one process per entry of ``per_rank_args`` as ranks of a ring;
    returns each one's (exit status, stdout, stderr). ``kill_rank``: the
    rank to kill with SIGKILL once rank 0 has written its first output
    (whose first byte is then missing from rank 0's stdout)."""
    processes = start_ranks(tmp_path, per_rank_args, programs)
    if kill_rank is not None:
        ready, _, _ = select.select([processes[0].stdout], [], [], TIMEOUT)
        if not ready:
            for q in processes:
                q.kill()
            pytest.fail("rank 0 wrote nothing within the timeout")
        os.read(processes[0].stdout.fileno(), 1)
        processes[kill_rank].send_signal(signal.SIGKILL)
    results, deadline = [], time.monotonic() + TIMEOUT
    for p in processes:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in processes:
                q.kill()
            pytest.fail("a rank did not end within the timeout")
        results.append((p.returncode, out, err))
    return results


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """mlx-lm folders of tiny random models (dense, hybrid, experts), and a
    random drafter for them."""
    from mlx_lm.utils import save_config, save_model

    root = tmp_path_factory.mktemp("split")
    paths = {}
    for kind in ("llama", "qwen2", "gemma3", "qwen3_next", "qwen3_5", "lfm2", "nemotron_h", "qwen3_moe", "mixtral"):
        model = tiny_model(kind, seed=4)
        save_model(root / kind, model)
        save_config({k: v for k, v in vars(model.args).items() if v is not None}, root / kind / "config.json")
        save_word_tokenizer(root / kind, 256)
        paths[kind] = root / kind
    save_drafter(tiny_drafter(seed=4), str(root / "drafter"))
    paths["drafter"] = root / "drafter"
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"tokens": p}) + "\n" for p in PROMPTS))
    paths["prompts"] = prompts
    return paths


def token_lists(stdout: str) -> list:
    return [json.loads(line)["tokens"] for line in stdout.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "kind, split, nodes",
    [
        ("llama", "pipeline", 8),
        ("qwen2", "pipeline", 8),
        ("llama", "tensor", 8),
        ("llama", "pipeline", None),
        ("qwen3_next", "pipeline", 8),  # a hybrid through mlx-lm's pipeline()
        ("lfm2", "pipeline", 8),  # a hybrid through this package's stages
        ("nemotron_h", "pipeline", 8),  # a hybrid whose MLP-only layers keep no cache
        ("qwen3_5", "pipeline", 8),  # another hybrid through mlx-lm's pipeline()
        ("mixtral", "pipeline", 8),  # experts through this package's stages
        ("qwen3_moe", "pipeline", 8),  # experts through mlx-lm's pipeline()
    ],
)
def test_a_split_model_decodes_as_one_process_does(folders, tmp_path, kind, split, nodes):
    """Greedy output, a batch of three prompts of different lengths, drafted
    by the RNN and by lookup in 8-node trees (given, or a split run's
    default), equals one process's (whose trees the cost curve sizes)."""
    args = [
        "generate",
        "--model",
        folders[kind],
        "--drafter",
        folders["drafter"],
        "--prompts",
        folders["prompts"],
        "--batch-size",
        3,
        "--max-tokens",
        40,
    ] + (["--max-nodes", nodes] if nodes else [])
    alone = run_cli(*args)
    assert alone.returncode == 0, alone.stderr
    expected = token_lists(alone.stdout)
    assert len(expected) == 3 and sum(map(len, expected)) > 24
    (code0, out0, err0), (code1, out1, err1) = launch(tmp_path, [args + ["--split", split]] * 2)
    assert (code0, code1) == (0, 0), err0 + err1
    assert token_lists(out0) == expected
    assert out1 == ""  # only rank 0 writes
    assert "differently" not in err0 + err1  # alike ranks agree on every step without sending it


def test_a_rank_that_rounds_differently_takes_rank_0s_steps(folders, tmp_path):
    """A rank whose chip chose and drafted other tokens would commit another
    path to its caches: it takes rank 0's step instead (and says so once),
    and the output is still one process's."""
    args = [
        "generate",
        "--model",
        folders["llama"],
        "--drafter",
        folders["drafter"],
        "--prompts",
        folders["prompts"],
        "--batch-size",
        3,
        "--max-tokens",
        32,
        "--max-nodes",
        8,
    ]
    alone = run_cli(*args)
    assert alone.returncode == 0, alone.stderr
    (code0, out0, err0), (code1, _, err1) = launch(tmp_path, [args] * 2, programs={1: OTHER_CHIP})
    assert (code0, code1) == (0, 0), err0 + err1
    assert token_lists(out0) == token_lists(alone.stdout)
    assert err1.count("computed a step differently from rank 0") == 1


# One decoder that prompts join one after another (as in a server),
# counting the cost curves measured; rank 0 finds every curve drifting.
def test_seeded_sampling_in_a_split_gives_one_process_tokens(folders, tmp_path):
    """Sampling stays exact: with a seed, the tokens are one process's."""
    args = [
        "generate",
        "--model",
        folders["llama"],
        "--drafter",
        folders["drafter"],
        "--prompts",
        folders["prompts"],
        "--batch-size",
        3,
        "--max-tokens",
        32,
        "--max-nodes",
        8,
        "--temp",
        0.8,
        "--seed",
        5,
    ]
    alone = run_cli(*args)
    assert alone.returncode == 0, alone.stderr
    (code0, out0, err0), (code1, _, err1) = launch(tmp_path, [args] * 2)
    assert (code0, code1) == (0, 0), err0 + err1
    assert token_lists(out0) == token_lists(alone.stdout)


def test_three_ranks_split_a_sliding_window_model_as_one_process_decodes(folders, tmp_path):
    """gemma3 (three layers, sliding-window masks read from caches by
    index), one layer per rank."""
    args = [
        "generate",
        "--model",
        folders["gemma3"],
        "--drafter",
        folders["drafter"],
        "--prompts",
        folders["prompts"],
        "--batch-size",
        3,
        "--max-tokens",
        32,
        "--max-nodes",
        8,
    ]
    alone = run_cli(*args)
    assert alone.returncode == 0, alone.stderr
    results = launch(tmp_path, [args] * 3)
    assert [code for code, _, _ in results] == [0, 0, 0], "".join(err for _, _, err in results)
    assert token_lists(results[0][1]) == token_lists(alone.stdout)


def test_the_default_model_in_two_stages_equals_one_process(tmp_path):
    args = [
        "generate",
        "--prompt",
        "Name three planets and one fact about each.",
        "--max-tokens",
        32,
        "--max-nodes",
        8,
        "--json",
    ]
    alone = run_cli(*args)
    assert alone.returncode == 0, alone.stderr
    expected = json.loads(alone.stdout)
    assert expected["ranks"] == 1 and len(expected["tokens"]) == 32
    (code0, out0, err0), (code1, _, err1) = launch(tmp_path, [args] * 2)
    assert (code0, code1) == (0, 0), err0 + err1
    split = json.loads(out0)
    assert split["tokens"] == expected["tokens"]
    assert split["ranks"] == 2


def test_a_killed_rank_ends_the_others_with_an_error(folders, tmp_path):
    args = [
        "generate",
        "--model",
        folders["llama"],
        "--drafter",
        "none",
        "--prompt",
        "w5 w6",
        "--ignore-chat-template",
        "--max-tokens",
        100000,
        "--max-nodes",
        4,
    ]
    (code0, _, err0), (code1, _, _) = launch(tmp_path, [args] * 2, kill_rank=1)
    assert code1 == -signal.SIGKILL
    assert code0 == 1
    # Our line (MLX's own transport may write one of its own, even on the same line).
    assert "error: " in err0, err0
    assert "Traceback" not in err0


def test_a_rank_whose_peers_never_come_ends_with_an_error(tmp_path):
    # mx.distributed.init waits for the other ranks holding the interpreter:
    # no thread of this process could end it.
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    code = "from redrafter_mlx.engine import distributed; distributed.join(silence=1.0); print('joined')"
    env = dict(os.environ, MLX_RANK="0", MLX_HOSTFILE=str(hostfile))
    tic = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == -signal.SIGKILL
    assert result.stdout == ""
    assert result.stderr.strip() == "error: the other ranks did not connect within 2 s; ending rank 0"
    assert time.monotonic() - tic < 60


def test_ranks_with_different_models_are_refused(folders, tmp_path):
    args = [
        "generate",
        "--drafter",
        "none",
        "--prompt",
        "w5",
        "--ignore-chat-template",
        "--max-tokens",
        4,
        "--max-nodes",
        4,
    ]
    results = launch(tmp_path, [args + ["--model", folders["llama"]], args + ["--model", folders["qwen2"]]])
    for code, _, err in results:
        assert code == 1
        assert "another model than rank 0" in err or "rank 0 ended" in err or "rank 1 ended" in err, err


def test_bench_compares_plain_pipelined_decoding_with_redrafter_in_the_same_split(folders, tmp_path):
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "--model",
        folders["llama"],
        "--drafter",
        folders["drafter"],
        "--prompts",
        folders["prompts"],
        "--num-prompts",
        2,
        "--max-tokens",
        16,
        "--configs",
        "auto,lookup",
        "--json",
        out,
    ]
    (code0, _, err0), (code1, out1, err1) = launch(tmp_path, [args] * 2)
    assert (code0, code1) == (0, 0), err0 + err1
    report = json.loads(out.read_text())
    assert report["environment"]["ranks"] == 2
    assert [r["config"] for r in report["results"]] == ["auto", "lookup"]
    assert all(r["mismatches"] == 0 for r in report["results"])
    assert out1 == ""


def test_serve_answers_from_rank_0_as_one_process_does_and_stops_every_rank(folders, tmp_path):
    """Two requests at once (continuous batching across the split), greedy,
    equal to a one-process server's answers; SIGTERM to rank 0 ends both."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    options = ["--model", folders["llama"], "--drafter", folders["drafter"], "--max-batch", 2, "--max-nodes", 8]
    bodies = [
        {"model": "m", "prompt": "w5 w6 w7 w5 w6 w7 w5", "max_tokens": 24, "temperature": 0},
        {"model": "m", "prompt": "w9 w10 w11", "max_tokens": 20, "temperature": 0},
    ]

    def answers(url):
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda b: httpx.post(f"{url}/v1/completions", json=b, timeout=120), bodies))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json()["choices"][0]["text"] for r in replies]

    process, url, _ = start_server(*options)
    try:
        expected = answers(url)
    finally:
        stop_server(process)
    port = free_ports(1)[0]
    ranks = start_ranks(tmp_path, [["serve", "--port", port, *options]] * 2)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + TIMEOUT
    try:
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert all(p.poll() is None for p in ranks) and time.monotonic() < deadline, (
                "the split server did not start"
            )
            time.sleep(0.2)
        assert answers(url) == expected
        assert answers(url) == expected  # the same rows again, after the first ones left the batch
        ranks[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in ranks]
        assert codes == [0, 0], [p.communicate()[1] for p in ranks]
    finally:
        for p in ranks:
            p.kill()


BROADCASTS = """
import json
import redrafter_mlx
from redrafter_mlx.engine import distributed

ranks = distributed.join("pipeline")
sent = [None, {"leave": [1, 2]}] + [bytes(range(256)) * (n // 256) + bytes(n % 256) for n in (4000, 4073, 4074, 4075, 4076, 4100, 20000)]  # 4074: exactly the first sum
got = [ranks.broadcast(obj if ranks.rank == 0 else None) for obj in sent]
print(json.dumps([a == b for a, b in zip(got, sent)]))
ranks.end()
"""


def test_a_broadcast_of_any_size_arrives_whole(tmp_path):
    """What rank 0 sends the others (a server's plan each step, a step
    where ranks differ): small objects in one sum, larger ones in two,
    byte for byte around the boundary."""
    results = launch(tmp_path, [[], []], programs={0: BROADCASTS, 1: BROADCASTS})
    for code, out, err in results:
        assert code == 0, err
        assert json.loads(out) == [True] * 9


def test_the_heartbeat_finds_rank_0_where_the_launcher_says(tmp_path, monkeypatch):
    """Rank 0's address: from the ring hostfile mlx.launch writes, from the
    coordinator it names for jaccl, else this machine."""
    from redrafter_mlx.engine.distributed import rank0_host

    monkeypatch.delenv("MLX_JACCL_COORDINATOR", raising=False)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    assert rank0_host() == "127.0.0.1"
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.2:5000", "10.0.1.2:5000"], ["10.0.0.3:5000"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    assert rank0_host() == "10.0.0.2"
    monkeypatch.setenv("MLX_JACCL_COORDINATOR", "192.168.1.7:32323")
    assert rank0_host() == "192.168.1.7"


def test_a_digest_tells_steps_apart():
    """What ranks that may round differently compare each step: the same
    arrays agree; another value, even in the last bit, or another shape
    does not."""
    import numpy as np

    from redrafter_mlx.engine.distributed import digest

    step = (np.array([2]), np.arange(6).reshape(1, 6), [np.ones((1, 4, 5), np.float32), None])
    again = (np.array([2]), np.arange(6).reshape(1, 6), [np.ones((1, 4, 5), np.float32), None])
    assert digest(step) == digest(again)
    other_value = (np.array([2]), np.arange(6).reshape(1, 6), [np.full((1, 4, 5), 1 + 1e-7, np.float32), None])
    assert digest(step) != digest(other_value)
    other_shape = (np.array([2]), np.arange(6).reshape(1, 6), [np.ones((1, 3, 5), np.float32), None])
    assert digest(step) != digest(other_shape)


# -- a layer another rank runs, in one process ----------------------------------


def test_a_skipped_layers_cache_answers_for_the_layout_and_keeps_nothing():
    """Positions and masks (windowed too) are a TreeKVCache's on the same
    layout; committing, filtering and extending keep nothing; it refuses
    to be written or read for a prompt cache."""
    layout = CacheLayout([2, 0])
    skipped, kept = SkippedCache(layout), TreeKVCache(layout)
    layout.begin_chunk()
    assert skipped.offset.tolist() == kept.offset.tolist() == [-2, 0]
    for window in (None, 2):
        assert np.array_equal(
            np.array(skipped.make_mask(4, window_size=window)), np.array(kept.make_mask(4, window_size=window))
        )
    kept.update_and_fetch(mx.zeros((2, 1, 4, 3)), mx.zeros((2, 1, 4, 3)))
    layout.end_chunk(4)
    depths = mx.array([[0, 1, 1], [0, 1, 2]], mx.int32)
    tree = mx.array([[[1, 0, 0], [1, 1, 0], [1, 0, 1]], [[1, 0, 0], [1, 1, 0], [1, 1, 1]]], mx.bool_)
    layout.begin_tree(depths, tree)
    assert skipped.offset.tolist() == kept.offset.tolist()
    assert np.array_equal(np.array(skipped.make_mask(3, window_size=2)), np.array(kept.make_mask(3, window_size=2)))
    with pytest.raises(RuntimeError, match="another rank"):
        skipped.update_and_fetch(mx.zeros((2, 1, 3, 3)), mx.zeros((2, 1, 3, 3)))
    skipped.commit_path(np.array([[0, 2], [0, 1]]), np.array([1, 1]))
    other_layout = CacheLayout([0])
    extend_batch(layout, [skipped], other_layout, [SkippedCache(other_layout)])
    skipped.filter(mx.array([0, 2]), 0)
    assert skipped.keys is None and skipped.values is None and skipped.state_arrays() == []
    with pytest.raises(RuntimeError, match="prompt cache"):
        skipped.rows_kv(0, 0, 4)


def test_a_model_that_reads_its_masks_from_a_skipped_layer_decodes_as_mlx_lm_does():
    """A llama whose first layer (the one its masks are read from) is a
    Skip, as on a rank that runs the others: a batch of prompts of
    different lengths, drafted into trees, decodes as mlx-lm decodes it."""
    model = tiny_model("llama", seed=4)
    model.model.layers = [Skip(model.model.layers[0]), *model.model.layers[1:]]
    base = BaseModel(model)
    assert [type(c) for c in base.make_cache([0])[1]] == [SkippedCache, TreeKVCache]
    references = [mlx_lm_greedy(model, p, 24) for p in PROMPTS]
    drafter = OracleDrafter(base, [p + r for p, r in zip(PROMPTS, references)], corrupt=3)
    tokens, accepted = run(ReDrafter(base, drafter), PROMPTS, max_tokens=24, max_nodes=8)
    assert tokens == references
    assert max(accepted) >= 2
