"""The official drafter checkpoint format, and refusing bad drafters."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import tiny_drafter
from redrafter_mlx.drafting.drafter import check_compatible, load_drafter, save_drafter
from redrafter_mlx.errors import UserError

HIDDEN, VOCAB = 16, 40


def official_checkpoint(folder, exit_dim, layers, rnn, seed=0):
    """Write a checkpoint the way the reference trainer lays it out; return
    its weights as numpy arrays."""
    rng = np.random.default_rng(seed)
    w = {}
    if exit_dim != 2 * HIDDEN:
        w["input_proj.weight"] = rng.normal(size=(exit_dim, 2 * HIDDEN))
        w["input_proj.bias"] = rng.normal(size=(exit_dim,))
    for i in range(layers):
        w[f"lm_head.{i}.linear.weight"] = rng.normal(size=(exit_dim, exit_dim)) / np.sqrt(exit_dim)
        w[f"lm_head.{i}.linear.bias"] = rng.normal(size=(exit_dim,))
    w[f"lm_head.{layers}.weight"] = rng.normal(size=(VOCAB, exit_dim))
    if rnn:
        w["rnn_u.weight"] = rng.normal(size=(HIDDEN, HIDDEN)) / 4
        w["rnn_u.bias"] = rng.normal(size=(HIDDEN,))
        w["rnn_w.weight"] = rng.normal(size=(HIDDEN, HIDDEN)) / 4
    w = {k: v.astype(np.float32) for k, v in w.items()}
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    config = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        exit_dim=exit_dim,
        num_draft_layers=layers,
        rnn=rnn,
        num_lookback_tokens=1,
        architectures=["ReDrafter"],
        torch_dtype="float32",
    )
    (folder / "config.json").write_text(json.dumps(config))
    return w


def silu(x):
    return x / (1 + np.exp(-x))


def reference_logits(w, layers, rnn, hidden, embeddings):
    """Drafter logits for a token sequence, computed directly in numpy."""
    state = np.zeros(HIDDEN)
    out = []
    for e in embeddings:
        if rnn:
            state = silu(w["rnn_w.weight"] @ e + w["rnn_u.weight"] @ state + w["rnn_u.bias"])
        else:
            state = e + state
        x = np.concatenate([hidden, state])
        if "input_proj.weight" in w:
            x = w["input_proj.weight"] @ x + w["input_proj.bias"]
        for i in range(layers):
            x = x + silu(w[f"lm_head.{i}.linear.weight"] @ x + w[f"lm_head.{i}.linear.bias"])
        out.append(w[f"lm_head.{layers}.weight"] @ x)
    return np.array(out)


@pytest.mark.parametrize("exit_dim, layers, rnn", [(32, 1, True), (24, 2, True), (32, 0, False), (48, 3, False)])
def test_official_checkpoint_loads_and_computes_as_specified(tmp_path, exit_dim, layers, rnn):
    w = official_checkpoint(tmp_path / "d", exit_dim, layers, rnn)
    drafter = load_drafter(str(tmp_path / "d"))
    rng = np.random.default_rng(1)
    hidden, embeddings = rng.normal(size=HIDDEN), rng.normal(size=(4, HIDDEN))
    state, got = None, []
    for e in embeddings:
        state = drafter.update_state(mx.array(e, mx.float32)[None], state)
        got.append(np.array(drafter.draft_logits(mx.array(hidden, mx.float32)[None], state))[0])
    np.testing.assert_allclose(
        np.array(got), reference_logits(w, layers, rnn, hidden, embeddings), rtol=1e-4, atol=1e-4
    )


def test_save_and_load_round_trip_with_reduced_vocabulary(tmp_path):
    drafter = tiny_drafter(seed=2, draft_vocab=32, exit_dim=48, layers=2)
    save_drafter(drafter, str(tmp_path / "d"))
    loaded = load_drafter(str(tmp_path / "d"))
    assert loaded.args == drafter.args
    h, s = mx.random.normal((3, 64)), mx.random.normal((3, 64))
    assert mx.allclose(loaded.log_probs(h, s), drafter.log_probs(h, s))
    assert (loaded.draft_token_ids == drafter.draft_token_ids).all()
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert "sorted_draft_vocab" not in config  # the official layout's keys only, unless set
    drafter.args.sorted_draft_vocab = True
    save_drafter(drafter, str(tmp_path / "sorted"))
    assert load_drafter(str(tmp_path / "sorted")).args.sorted_draft_vocab


def test_mismatched_drafter_is_refused_naming_both_numbers():
    drafter = tiny_drafter()
    with pytest.raises(UserError, match="hidden_size 64 .* hidden size 576"):
        check_compatible(drafter.args, 576, 256)
    with pytest.raises(UserError, match="vocab_size 256 .* vocabulary size 49152"):
        check_compatible(drafter.args, 64, 49152)


def test_bad_drafter_folders(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_drafter(str(tmp_path / "missing"))
    official_checkpoint(tmp_path / "d", 32, 1, True)
    (tmp_path / "d" / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(UserError, match="cannot read"):
        load_drafter(str(tmp_path / "d"))
    official_checkpoint(tmp_path / "e", 32, 1, True)
    (tmp_path / "e" / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_drafter(str(tmp_path / "e"))
    official_checkpoint(tmp_path / "f", 32, 1, True)
    config = json.loads((tmp_path / "f" / "config.json").read_text())
    (tmp_path / "f" / "config.json").write_text(json.dumps(dict(config, num_draft_layers=2)))
    with pytest.raises(UserError, match="do not match its config"):
        load_drafter(str(tmp_path / "f"))


@pytest.mark.parametrize("exit_dim", [48, 128])
def test_a_search_reads_h_once_and_drafts_as_the_whole_projection_does(exit_dim):
    """``search_log_probs(read_hidden(h), s)`` is ``log_probs(h, s)`` (128 =
    2 * hidden: no input_proj), also over the first rows, and follows the
    weights when they change."""
    drafter = tiny_drafter(seed=3, exit_dim=exit_dim, layers=1, draft_vocab=32)
    h, s = mx.random.normal((2, 3, 64)), mx.random.normal((2, 3, 64))
    for rows in (None, 8):
        assert mx.allclose(
            drafter.search_log_probs(drafter.read_hidden(h), s, rows), drafter.log_probs(h, s, rows), atol=1e-5
        )
    if exit_dim != 128:
        drafter.input_proj.weight = 2 * drafter.input_proj.weight
        assert mx.allclose(drafter.search_log_probs(drafter.read_hidden(h), s), drafter.log_probs(h, s), atol=1e-5)
    assert not [k for k, _ in tree_flatten(drafter.parameters()) if k.startswith("_")]  # the split halves are not saved
