"""Drafter training: the loss, learning a pattern, exact resume."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import HIDDEN, VOCAB, tiny_drafter, tiny_model
from mlx.utils import tree_flatten

from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.training.distill import DataFolder
from redrafter_mlx.drafting.drafter import load_drafter
from redrafter_mlx.errors import UserError
from redrafter_mlx.training.train import (
    StackedRows,
    TrainConfig,
    Trainer,
    build_draft_vocab,
    build_positions,
    compute_hidden_cache,
    drafter_loss,
    length_batches,
    train,
)


def test_loss_equals_direct_computation():
    drafter = tiny_drafter(seed=5, exit_dim=48, layers=2)
    table = mx.random.normal((VOCAB, HIDDEN), key=mx.random.key(1))
    embed = lambda t: table[t]
    rng = np.random.default_rng(0)
    hidden = mx.array(rng.normal(size=(6, HIDDEN)), mx.float32)
    tokens = rng.integers(0, VOCAB, size=(6, 3))
    targets = rng.integers(0, VOCAB, size=(6, 3))
    targets[4, 1:] = -1  # the sequence ends
    targets[5, 2] = -1
    loss, correct, counted = drafter_loss(drafter, embed, hidden, mx.array(tokens), mx.array(targets))

    expected, hits, counts = 0.0, np.zeros(3), np.zeros(3)
    for k in range(3):
        terms = []
        for i in range(6):
            state = None
            for j in range(k + 1):
                state = drafter.update_state(embed(mx.array([int(tokens[i, j])])), state)
            logits = np.array(drafter.draft_logits(hidden[i : i + 1], state))[0].astype(np.float64)
            if targets[i, k] < 0:
                continue
            log_z = np.log(np.exp(logits - logits.max()).sum()) + logits.max()
            terms.append(log_z - logits[targets[i, k]])
            hits[k] += logits.argmax() == targets[i, k]
            counts[k] += 1
        expected += np.mean(terms)
    assert abs(loss.item() - expected) < 1e-4
    assert correct.tolist() == hits.tolist() and counted.tolist() == counts.tolist()


def test_stacked_rows_gather_like_the_concatenated_array():
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(n, 3)).astype(np.float16) for n in (5, 1, 7)]
    stacked = StackedRows(parts)
    rows = rng.permutation(13)[:9]
    assert len(stacked) == 13
    np.testing.assert_array_equal(stacked[rows], np.concatenate(parts)[rows])


def synthetic_data(folder, num_sequences=60, seed=0):
    """Sequences that walk a fixed cycle of 16 tokens: each next token is a
    function of the current one, so a drafter can learn every depth."""
    rng = np.random.default_rng(seed)
    cycle = rng.permutation(VOCAB)[:16]
    data = DataFolder(str(folder))
    folder.mkdir()
    (folder / "meta.json").write_text('{"vocab_size": %d, "hidden_size": %d}' % (VOCAB, HIDDEN))
    prompts, lengths, sequences = [], [], []
    for i in range(num_sequences):
        prompt = rng.integers(0, VOCAB, size=rng.integers(2, 6)).tolist()
        start = rng.integers(0, 16)
        response = [int(cycle[(start + j) % 16]) for j in range(rng.integers(12, 30))]
        prompts.append(i)
        lengths.append(len(prompt))
        sequences.append(prompt + response)
    data.write_shard(prompts, lengths, sequences)
    return data


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train") / "data"
    data = synthetic_data(folder)
    base = BaseModel(tiny_model("llama", seed=4))
    sequences = data.load()
    hidden = compute_hidden_cache(base, data, sequences, batch_tokens=256, progress=False)
    return base, sequences, hidden


def make_trainer(setup, output, **overrides):
    base, sequences, hidden = setup
    config = TrainConfig(**{**dict(depth=4, exit_dim=64, steps=300, batch_size=64, learning_rate=3e-3, warmup=20,
                                    eval_every=100, save_every=100, eval_fraction=0.1), **overrides})
    positions = build_positions(sequences, config.depth, config.eval_fraction)
    vocab = build_draft_vocab(sequences, config.draft_vocab) if config.draft_vocab else None
    return Trainer(base, positions, hidden, config, str(output), vocab)


def test_length_batches_cover_every_sequence_once_within_the_budget():
    lengths = np.array([5, 40, 12, 12, 3, 100, 7, 30])
    groups = length_batches(lengths, 36)
    assert sorted(np.concatenate(groups).tolist()) == list(range(8))
    assert [lengths[g].tolist() for g in groups] == [[3, 5, 7], [12, 12], [30], [40], [100]]
    for g in groups:  # longest times size within the budget, or one sequence alone
        assert len(g) == 1 or lengths[g].max() * len(g) <= 36


def test_hidden_cache_matches_the_base_model(setup):
    """Every sequence, in order (the cache was computed in batches made in
    order of length, which is not the sequences' order)."""
    base, sequences, hidden = setup
    assert (np.diff(sequences.lengths) < 0).any()
    row = 0
    for i in range(len(sequences)):
        sequence, p = sequences.sequence(i), int(sequences.prompt_lengths[i])
        direct = np.array(base.backbone(mx.array([sequence.tolist()]))[0])
        np.testing.assert_allclose(hidden[row : row + len(sequence) - p], direct[p - 1 : len(sequence) - 1], atol=2e-2, rtol=1e-2)
        row += len(sequence) - p
    assert row == len(hidden)


@pytest.mark.parametrize("draft_vocab", [0, 32])
def test_training_learns_a_pattern_at_every_depth(setup, tmp_path, draft_vocab):
    trainer = make_trainer(setup, tmp_path / "out", draft_vocab=draft_vocab)
    before = trainer.evaluate()
    result = train(trainer, progress=False)
    assert min(result["eval_accuracy"]) > 0.8, result
    assert max(before["eval_accuracy"]) < 0.2
    trainer.export()
    drafter = load_drafter(str(tmp_path / "out"))
    assert drafter.args.draft_vocab_size == (draft_vocab or None)


def test_a_batchs_teacher_states_are_the_next_hidden_states_of_its_sequence(setup, tmp_path):
    """What the hidden-state loss compares the features with: h[t+1] ..
    h[t+T] of the same sequence."""
    base, sequences, hidden = setup
    trainer = make_trainer(setup, tmp_path / "out", exit_dim=HIDDEN, hidden_loss=1.0)
    p, length = int(sequences.prompt_lengths[0]), int(sequences.lengths[0])
    direct = np.array(base.backbone(mx.array([sequences.sequence(0).tolist()]))[0])
    _, _, targets, teacher = trainer.batch(np.array([0, 1]))
    for row in (0, 1):
        for k in range(trainer.config.depth):
            t = p - 1 + row  # position of h[t] for row
            if t + k + 2 < length:
                np.testing.assert_allclose(np.array(teacher[row, k]), direct[t + k + 1], atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("head", [{}, dict(exit_dim=HIDDEN, warm_start=True, freeze_head_steps=8), dict(exit_dim=HIDDEN, warm_start=True, freeze_head_steps=18)])
def test_resuming_from_a_checkpoint_continues_with_identical_loss(setup, tmp_path, head):
    """Also when the head was unfrozen before the checkpoint (8), and when
    it is unfrozen after the resume (18)."""
    overrides = dict(steps=24, save_every=12, eval_every=100, **head)
    straight = []
    train(make_trainer(setup, tmp_path / "a", **overrides), progress=False, log=lambda r: straight.append(r["loss"]))

    class Stop(Exception):
        pass

    def stop_after_checkpoint(record):
        if record["step"] == 13:
            raise Stop

    with pytest.raises(Stop):
        train(make_trainer(setup, tmp_path / "b", **overrides), progress=False, log=stop_after_checkpoint)
    resumed = make_trainer(setup, tmp_path / "b", **overrides)
    assert resumed.load_checkpoint() and resumed.step == 12
    losses = []
    train(resumed, progress=False, log=lambda r: losses.append(r["loss"]))
    assert losses == straight[12:]


def test_a_resumed_run_trains_in_its_checkpoints_draft_vocabulary(setup, tmp_path):
    """Data added before a resume can rank the draft vocabulary otherwise;
    the targets still index the rows the checkpoint's head was made for."""
    base, sequences, hidden = setup
    overrides = dict(steps=4, save_every=4, eval_every=100, draft_vocab=32)
    first = make_trainer(setup, tmp_path / "a", **overrides)
    train(first, progress=False)
    config = first.config
    other = build_draft_vocab(sequences, 32)[::-1].copy()  # as if new data ranked the tokens in reverse
    resumed = Trainer(base, build_positions(sequences, config.depth, config.eval_fraction), hidden, config, str(tmp_path / "a"), other)
    assert resumed.load_checkpoint()
    ids = np.array(resumed.drafter.draft_token_ids)
    np.testing.assert_array_equal(ids, np.array(first.drafter.draft_token_ids))
    assert not np.array_equal(ids, other)
    np.testing.assert_array_equal(resumed.to_draft[ids], np.arange(32))
    np.testing.assert_array_equal(resumed.to_draft, first.to_draft)


def test_hidden_states_saved_by_distill_equal_recomputed_ones(tmp_path):
    from redrafter_mlx.training.distill import distill, response_stream
    from redrafter_mlx.engine.sampling import SamplingSettings

    base = BaseModel(tiny_model("llama", seed=6))
    prompts = ["abc", "hello world", "x", "a longer prompt here"]
    folder = DataFolder(str(tmp_path / "d"))
    tokenize = lambda text: [ord(c) % 256 for c in text]
    distill(base, tokenize, prompts, folder, {}, response_stream(base, 12, SamplingSettings(), [7]), 3, shard_size=2, progress=False)
    assert len(list(folder.path.glob("hidden-*.npy"))) == 2
    sequences = folder.load()
    saved = np.array(compute_hidden_cache(base, folder, sequences, progress=False))
    for f in list(folder.path.glob("hidden*")):
        f.unlink()
    recomputed = np.array(compute_hidden_cache(base, folder, sequences, progress=False))
    assert saved.shape == recomputed.shape == (int((sequences.lengths - sequences.prompt_lengths).sum()), HIDDEN)
    np.testing.assert_allclose(saved, recomputed, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("draft_vocab", [0, 48])
def test_a_warm_started_drafter_first_predicts_the_base_models_ranking_of_h(setup, draft_vocab):
    """Built for it: whatever the RNN state, the warm-started drafter's
    logits are the base model's logits of h over the draft vocabulary."""
    base, sequences, _ = setup
    trainer = make_trainer(setup, "unused", exit_dim=HIDDEN, warm_start=True, draft_vocab=draft_vocab, num_draft_layers=2)
    h = base.backbone(mx.array([sequences.sequence(0).tolist()]))[0]  # (L, hidden)
    state = trainer.drafter.update_state(base.embed(mx.array(sequences.sequence(1)[: h.shape[0]].tolist())), None)
    ids = np.array(trainer.drafter.draft_token_ids) if draft_vocab else np.arange(VOCAB)
    expected = np.array(base.head(h))[:, ids]
    drafted = np.array(trainer.drafter.draft_logits(h, state))
    np.testing.assert_allclose(drafted, expected, atol=1e-4, rtol=1e-4)
    assert (np.argsort(-drafted, axis=-1)[:, :5] == np.argsort(-expected, axis=-1)[:, :5]).all()
    with pytest.raises(UserError, match="hidden size"):
        make_trainer(setup, "unused", exit_dim=HIDDEN + 8, warm_start=True)


def test_a_frozen_head_stays_the_base_models_for_its_steps_then_trains(setup, tmp_path):
    base, _, _ = setup
    trainer = make_trainer(setup, tmp_path / "out", exit_dim=HIDDEN, warm_start=True, hidden_loss=1.0, freeze_head_steps=10, steps=20, draft_vocab=48)
    head = np.array(base.head_rows(trainer.drafter.draft_token_ids))
    features = np.array(trainer.drafter.input_proj.weight)
    for _ in range(10):
        trainer.train_step()
    np.testing.assert_array_equal(np.array(trainer.drafter.lm_head[-1].weight), head)
    assert not np.allclose(np.array(trainer.drafter.input_proj.weight), features)  # the rest trains
    trainer.train_step()
    assert not np.allclose(np.array(trainer.drafter.lm_head[-1].weight), head)
    with pytest.raises(UserError, match="needs a warm start"):
        make_trainer(setup, "unused", exit_dim=HIDDEN, freeze_head_steps=5)


def test_the_hidden_loss_is_the_squared_error_of_the_features_to_the_next_states(setup, tmp_path):
    base, _, _ = setup
    trainer = make_trainer(setup, tmp_path / "out", exit_dim=HIDDEN, hidden_loss=0.5)
    rows = trainer.train_rows[:40]
    h, tokens, targets, teacher = trainer.batch(rows)
    loss, _, _ = trainer._loss(h, tokens, targets, teacher)
    plain, _, _ = drafter_loss(trainer.drafter, base.embed, h, tokens, targets)
    state, extra = None, 0.0
    drafter = trainer.drafter
    for k in range(tokens.shape[1]):
        state = drafter.update_state(base.embed(mx.maximum(tokens[:, k], 0)), state)
        x = np.array(drafter.input_proj(mx.concatenate([h, state], axis=-1)))
        for block in drafter.lm_head[:-1]:
            x = x + np.array(mx.sigmoid(block.linear(mx.array(x))) * block.linear(mx.array(x)))
        valid = np.array(targets[:, k]) >= 0
        error = ((x - np.array(teacher[:, k])) ** 2).mean(axis=-1)
        extra += 0.5 * error[valid].mean()
    assert float(loss) == pytest.approx(float(plain) + extra, rel=1e-4)
    first = float(loss)
    train(trainer, progress=False)
    assert float(trainer._loss(h, tokens, targets, teacher)[0]) < first  # it trains


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(steps=0), "steps must be at least 1"),
        (dict(warmup=-1), "warmup must be at least 0"),
        (dict(freeze_head_steps=-1), "freeze head steps must be at least 0"),
        (dict(hidden_loss=-0.5), "hidden loss must be at least 0"),
        (dict(dtype="float16"), "float32 or bfloat16"),
        (dict(freeze_head_steps=3), "needs a warm start"),
    ],
)
def test_bad_settings_are_refused_when_made(settings, message):
    with pytest.raises(UserError, match=message):
        TrainConfig(**settings)


def test_a_checkpoint_with_retired_settings_at_their_neutral_values_resumes(setup, tmp_path):
    import json

    overrides = dict(steps=4, save_every=2, eval_every=100)
    trainer = make_trainer(setup, tmp_path / "a", **overrides)
    trainer.train_step()
    trainer.save_checkpoint()
    state_file = trainer.checkpoint_folder / "trainer.json"
    state = json.loads(state_file.read_text())
    state["config"].update(rnn=True, hidden_dropout=0.0, soft_targets=0.0, lookup_weight=1.0)
    state_file.write_text(json.dumps(state))
    assert make_trainer(setup, tmp_path / "a", **overrides).load_checkpoint()
    state["config"]["soft_targets"] = 0.5  # trained otherwise than today's code can
    state_file.write_text(json.dumps(state))
    with pytest.raises(UserError, match="soft_targets"):
        make_trainer(setup, tmp_path / "a", **overrides).load_checkpoint()


# -- train_drafter's output: the drafter alone, its card, its training state beside it


DRAFTER_FILES = ["README.md", "config.json", "model.safetensors"]


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    """The tiny model of ``setup`` saved as an mlx-lm folder (with a word
    tokenizer), and a data folder distilled (synthetically) for it."""
    from conftest import save_word_tokenizer
    from mlx_lm.utils import save_config, save_model

    root = tmp_path_factory.mktemp("train-drafter")
    model = tiny_model("llama", seed=4)
    save_model(root / "model", model)
    save_config(dict(vars(model.args)), root / "model" / "config.json")
    save_word_tokenizer(root / "model", VOCAB)
    synthetic_data(root / "data")
    return str(root / "model"), str(root / "data")


def small_config(**overrides):
    return TrainConfig(**{**dict(depth=3, exit_dim=32, steps=6, batch_size=64, warmup=2, eval_every=3, save_every=3,
                                 eval_fraction=0.1, draft_vocab=48), **overrides})


def run_train(model_and_data, output, config=None):
    """``train_drafter`` on the tiny model; returns the steps it resumed from."""
    from redrafter_mlx.training.train import train_drafter

    model, data = model_and_data
    resumed = []
    train_drafter([data], str(output), config or small_config(), model, dtype="float32", resumed=resumed.append)
    return resumed


def test_train_writes_only_the_drafter_and_its_card_and_keeps_its_state_beside_it(model_and_data, tmp_path):
    import json

    from redrafter_mlx import load
    from redrafter_mlx.loading.loader import drafter_identity

    model, data = model_and_data
    output = tmp_path / "my-drafter"
    assert run_train(model_and_data, output) == []
    assert sorted(p.name for p in output.iterdir()) == DRAFTER_FILES
    state = tmp_path / "my-drafter.train"
    assert sorted(p.name for p in state.iterdir()) == ["checkpoint", "train_log.jsonl"]
    assert [json.loads(line)["step"] for line in (state / "train_log.jsonl").read_text().splitlines()] == list(range(1, 7))

    redrafter, _ = load(model, str(output), dtype="float32")
    config = json.loads((output / "config.json").read_text())
    assert config["base_model"] == {"name": "model", "identity": redrafter.identity}  # a local folder: no Hub id
    assert redrafter.drafter_identity == drafter_identity(str(output))
    assert redrafter.drafter.args.draft_vocab_size == 48
    final = load_drafter(str(state / "checkpoint"))  # the last checkpoint is the drafter exported
    for (name, a), (_, b) in zip(tree_flatten(final.parameters()), tree_flatten(redrafter.drafter.parameters())):
        np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=name)

    card = (output / "README.md").read_text()
    front = card.split("---")[1]
    assert "library_name: redrafter-mlx" in front and "- speculative-decoding" in front and "base_model:" not in front
    assert f"| identity | `{redrafter.identity}` |" in card and "# ReDrafter drafter for model" in card
    assert "| `steps` | 6 |" in card and "| `batch_size` | 64 |" in card and "| `draft_vocab` | 48 |" in card
    sequences = DataFolder(data).load()
    assert f"| `{data}` | {len(sequences)} |" in card
    accuracy = " ".join(f"{a:.3f}" for a in config["training"]["eval_accuracy"])
    assert f"top-1 accuracy at depths 1-3: {accuracy}" in card
    assert "| datastore | none" in card and "hf upload OWNER/NAME my-drafter" in card

    # `datastore` adds its file to the same folder and rewrites the card's datastore row only.
    from redrafter_mlx.training.datastore import add_datastore

    _, tokens, answers = add_datastore(str(output), [data])
    assert sorted(p.name for p in output.iterdir()) == sorted(DRAFTER_FILES + ["datastore.npy"])
    refreshed = (output / "README.md").read_text()
    assert f"| datastore | `datastore.npy`, {tokens:,} tokens of {answers:,} answers (" in refreshed
    assert refreshed.replace(next(l for l in refreshed.splitlines() if l.startswith("| datastore |")), "") == \
        card.replace(next(l for l in card.splitlines() if l.startswith("| datastore |")), "")
    assert load(model, str(output), dtype="float32")[0].datastore is not None


def test_a_trained_drafter_is_found_by_its_base_models_identity(model_and_data, tmp_path, monkeypatch):
    """Put where the loader looks for drafters by identity, the output
    folder is the one a model with no --drafter gets."""
    import shutil

    from redrafter_mlx import load
    from redrafter_mlx.loading import loader

    model, _ = model_and_data
    run_train(model_and_data, tmp_path / "out", small_config(steps=3, draft_vocab=0))
    drafters = tmp_path / "drafters"
    shutil.copytree(tmp_path / "out", drafters / "mine")
    monkeypatch.setattr(loader, "SHIPPED_DRAFTERS_DIR", drafters)
    redrafter, _ = load(model, dtype="float32")
    assert redrafter.drafter is not None and redrafter.drafter_identity == loader.drafter_identity(str(tmp_path / "out"))


def test_an_interrupted_run_resumes_from_its_state_folder_and_the_drafter_appears_at_the_end(model_and_data, tmp_path, monkeypatch):
    output = tmp_path / "out"

    class Stop(Exception):
        pass

    step = Trainer.train_step

    def stop_at_four(trainer):
        if trainer.step == 4:
            raise Stop
        return step(trainer)

    monkeypatch.setattr(Trainer, "train_step", stop_at_four)
    with pytest.raises(Stop):
        run_train(model_and_data, output)
    assert not output.exists()  # nothing half-made where the drafter goes
    monkeypatch.setattr(Trainer, "train_step", step)
    assert run_train(model_and_data, output) == [3]
    assert sorted(p.name for p in output.iterdir()) == DRAFTER_FILES
    assert run_train(model_and_data, output) == [6]  # done: runs again without training, the card still has results
    assert "top-1 accuracy at depths 1-3" in (output / "README.md").read_text()
    with pytest.raises(UserError, match="other settings"):
        run_train(model_and_data, output, small_config(steps=8))


def test_a_run_in_the_old_layout_resumes_and_its_state_moves_out(model_and_data, tmp_path):
    """Runs begun before the layout changed kept checkpoint/ and the log
    inside the output folder."""
    output, state = tmp_path / "out", tmp_path / "out.train"
    run_train(model_and_data, output, small_config(steps=3))
    (state / "checkpoint").rename(output / "checkpoint")
    (state / "train_log.jsonl").rename(output / "train_log.jsonl")
    state.rmdir()
    assert run_train(model_and_data, output, small_config(steps=3)) == [3]
    assert sorted(p.name for p in output.iterdir()) == DRAFTER_FILES
    assert sorted(p.name for p in state.iterdir()) == ["checkpoint", "train_log.jsonl"]
    assert len((state / "train_log.jsonl").read_text().splitlines()) == 3


def test_an_output_folder_that_is_not_a_run_is_refused(model_and_data, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds no training checkpoint to resume"):
        run_train(model_and_data, tmp_path / "taken")
    (tmp_path / "other.train").mkdir()
    (tmp_path / "other.train" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds other files"):
        run_train(model_and_data, tmp_path / "other")


def test_the_card_names_a_hub_base_model_in_its_front_matter(tmp_path):
    import json

    from redrafter_mlx.drafting.drafter import save_drafter
    from redrafter_mlx.training.train import base_model_entry, model_card

    entry = base_model_entry("org/some-model", "0123456789abcdef")
    assert entry == {"name": "org/some-model", "identity": "0123456789abcdef", "hub_id": "org/some-model"}
    assert base_model_entry(None, "x")["default"] is True
    save_drafter(tiny_drafter(), str(tmp_path / "d"), {"base_model": entry})
    card = model_card(tmp_path / "d")
    front = card.split("---")[1]
    assert "\nbase_model: org/some-model\n" in front and "tags:\n- redrafter\n- speculative-decoding\n- mlx\n" in front
    assert "--model org/some-model --drafter OWNER/NAME" in card
    assert json.loads((tmp_path / "d" / "config.json").read_text())["base_model"]["identity"] == "0123456789abcdef"


def test_the_cards_account_of_a_made_drafter_shows_what_really_ran():
    """A distillation stopped short shows the answers it has against the
    prompts planned, a plan cut by hand says so, and the speed names the
    held-out file it was measured on."""
    from redrafter_mlx.training.train import _made_section

    figures = {"speedup_median": 1.11, "speedup_min": 1.01, "speedup_max": 1.65, "tokens_per_step": 1.25, "nodes_per_step": 2.3}
    made = {"command": "redrafter-mlx make-drafter --model M --output D", "kind": "text", "prompts": "openings.jsonl", "train_prompts": 10,
            "held_out_prompts": 2, "runs": [{"name": "distill-t0.7", "temp": 0.7, "count": 4080, "max_tokens": 256, "responses": 2048},
                                             {"name": "distill-t1", "temp": 1.0, "count": 100, "max_tokens": 256, "responses": 100}],
            "note": "cut by hand", "held_out_file": "openings-heldout.jsonl", "stage_minutes": {"train": 32.0}, "cpu_hours": 0.85, "hours": 0.53,
            "held_out_speed": {"temp 0.7": {"auto": figures}, "prompts": 12, "max_tokens": 256}}
    card = "\n".join(_made_section(made))
    assert "2,048 of 4,080 prompts at temperature 0.7" in card and "100 prompts at temperature 1" in card
    assert "| note | cut by hand |" in card
    assert "12 held-out prompts of `openings-heldout.jsonl`" in card and "1.11x (1.01-1.65)" in card
