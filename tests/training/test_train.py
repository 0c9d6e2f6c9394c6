"""Drafter training: the loss, learning a pattern, exact resume."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import HIDDEN, VOCAB, tiny_drafter, tiny_model

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
    state_file = tmp_path / "a" / "checkpoint" / "trainer.json"
    state = json.loads(state_file.read_text())
    state["config"].update(rnn=True, hidden_dropout=0.0, soft_targets=0.0, lookup_weight=1.0)
    state_file.write_text(json.dumps(state))
    assert make_trainer(setup, tmp_path / "a", **overrides).load_checkpoint()
    state["config"]["soft_targets"] = 0.5  # trained otherwise than today's code can
    state_file.write_text(json.dumps(state))
    with pytest.raises(UserError, match="soft_targets"):
        make_trainer(setup, tmp_path / "a", **overrides).load_checkpoint()
