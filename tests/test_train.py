"""Drafter training: the loss, learning a pattern, exact resume."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import HIDDEN, VOCAB, tiny_drafter, tiny_model

from redrafter_mlx.base_model import BaseModel
from redrafter_mlx.distill import DataFolder
from redrafter_mlx.drafter import load_drafter
from redrafter_mlx.errors import UserError
from redrafter_mlx.train import (
    StackedRows,
    TrainConfig,
    Trainer,
    build_draft_vocab,
    build_positions,
    compute_hidden_cache,
    drafter_loss,
    length_batches,
    lookup_depths,
    train,
)


@pytest.mark.parametrize("soft_weight,weighted", [(0.0, False), (0.6, False), (0.0, True)])
def test_loss_equals_direct_computation(soft_weight, weighted):
    drafter = tiny_drafter(seed=5, exit_dim=48, layers=2)
    table = mx.random.normal((VOCAB, HIDDEN), key=mx.random.key(1))
    embed = lambda t: table[t]
    rng = np.random.default_rng(0)
    hidden = mx.array(rng.normal(size=(6, HIDDEN)), mx.float32)
    tokens = rng.integers(0, VOCAB, size=(6, 3))
    targets = rng.integers(0, VOCAB, size=(6, 3))
    targets[4, 1:] = -1  # the sequence ends
    targets[5, 2] = -1
    teacher_logits = rng.normal(size=(6, 3, VOCAB)) * 3
    weights = rng.uniform(0, 1, size=(6, 3)) if weighted else np.ones((6, 3))
    loss, correct, counted = drafter_loss(
        drafter, embed, hidden, mx.array(tokens), mx.array(targets), mx.array(teacher_logits, mx.float32), soft_weight,
        weights=mx.array(weights, mx.float32) if weighted else None,
    )

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
            teacher = np.exp(teacher_logits[i, k] - teacher_logits[i, k].max())
            teacher /= teacher.sum()
            soft = -(teacher * (logits - log_z)).sum()
            terms.append(weights[i, k] * ((1 - soft_weight) * (log_z - logits[targets[i, k]]) + soft_weight * soft))
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
    positions = build_positions(sequences, config.depth, config.eval_fraction, lookup_length=config.depth if config.lookup_weight != 1 else 0)
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


def test_soft_targets_are_the_base_models_next_token_distribution(setup, tmp_path):
    """The teacher states of a batch are h[t+1] .. h[t+T] of the same
    sequence, and training on them alone teaches the drafter the base
    model's own choices (here a random model's, unlike the data's cycle)."""
    base, sequences, hidden = setup
    trainer = make_trainer(setup, tmp_path / "out", soft_targets=1.0, draft_vocab=48)
    p, length = int(sequences.prompt_lengths[0]), int(sequences.lengths[0])
    direct = np.array(base.backbone(mx.array([sequences.sequence(0).tolist()]))[0])
    _, _, targets, _, teacher = trainer.batch(np.array([0, 1]))
    for row in (0, 1):
        for k in range(trainer.config.depth):
            t = p - 1 + row  # position of h[t] for row
            if t + k + 2 < length:
                np.testing.assert_allclose(np.array(teacher[row, k]), direct[t + k + 1], atol=2e-2, rtol=1e-2)

    def agreement():
        rows = trainer.eval_rows
        h, tokens, targets, _, teacher = trainer.batch(rows)
        valid = np.array(targets) >= 0
        teacher_choice = np.array(mx.argmax(teacher @ trainer.teacher_head.T, axis=-1))
        state, choices = None, []
        for k in range(tokens.shape[1]):
            state = trainer.drafter.update_state(base.embed(mx.maximum(tokens[:, k], 0)), state)
            choices.append(np.array(mx.argmax(trainer.drafter.draft_logits(h, state), axis=-1)))
        return (np.stack(choices, 1) == teacher_choice)[valid].mean()

    before = agreement()
    train(trainer, progress=False)
    after = agreement()
    assert before < 0.1 and after > 0.5, (before, after)  # chance: 1/48; the random teacher is nearly flat


@pytest.mark.parametrize("head", [{}, dict(exit_dim=HIDDEN, warm_start=True, freeze_head_steps=8), dict(exit_dim=HIDDEN, warm_start=True, freeze_head_steps=18)])
def test_resuming_from_a_checkpoint_continues_with_identical_loss(setup, tmp_path, head):
    """Also when the head was unfrozen before the checkpoint (8), and when
    it is unfrozen after the resume (18)."""
    overrides = dict(steps=24, save_every=12, eval_every=100, hidden_dropout=0.2, soft_targets=0.5, **head)
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
    from redrafter_mlx.distill import distill, response_stream
    from redrafter_mlx.sampling import SamplingSettings

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
    with pytest.raises(UserError, match="--warm-start"):
        make_trainer(setup, "unused", exit_dim=HIDDEN, freeze_head_steps=5)


def test_the_hidden_loss_is_the_squared_error_of_the_features_to_the_next_states(setup, tmp_path):
    base, _, _ = setup
    trainer = make_trainer(setup, tmp_path / "out", exit_dim=HIDDEN, hidden_loss=0.5)
    rows = trainer.train_rows[:40]
    h, tokens, targets, _, teacher = trainer.batch(rows)
    loss, _, _ = trainer._loss(h, tokens, targets, None, teacher)
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
    assert float(trainer._loss(h, tokens, targets, None, teacher)[0]) < first  # it trains


def test_lookup_depths_count_the_targets_context_lookup_drafts_right():
    sequence = [5, 1, 2, 3, 4, 1, 2, 3, 9, 1, 2]
    # Position t's step is rooted at x[t+1]; lookup continues the context
    # x[0] .. x[t+1] from the latest earlier occurrence of its longest
    # matching suffix. t = 4: "1" occurred at 1, so it drafts 2 3 4 against
    # 2 3 9; t = 5: "1 2" drafts 3 4 1 against 3 9 1; t = 8: "1" (at 5)
    # drafts 2 3 9 where only 2 is left.
    assert lookup_depths(sequence, first=1, count=9, depth=3).tolist() == [0, 0, 0, 2, 1, 0, 0, 1, 0]


def test_lookup_depths_with_two_beams_count_the_better_continuation():
    sequence = [1, 7, 0, 1, 8, 0, 1, 7, 0]
    # t = 5: the context ends "0 1", whose latest occurrence continued 8 0;
    # the second beam continues the earlier "1" with 7 0, the target.
    assert lookup_depths(sequence, first=0, count=7, depth=2).tolist() == [0, 0, 0, 0, 1, 0, 1]
    assert lookup_depths(sequence, first=0, count=7, depth=2, beams=2).tolist() == [0, 0, 0, 0, 1, 2, 1]


def test_targets_lookup_drafts_right_get_the_lookup_weight(setup, tmp_path):
    trainer = make_trainer(setup, tmp_path / "out", lookup_weight=0.25)
    depth = trainer.positions.lookup_depth
    assert depth.max() >= 1  # the data's cycle repeats, so lookup drafts it
    rows = np.arange(200)
    weights = np.array(trainer.batch(rows)[3])
    np.testing.assert_array_equal(weights, np.where(np.arange(trainer.config.depth) < depth[rows][:, None], 0.25, 1.0))
    assert make_trainer(setup, tmp_path / "plain").positions.lookup_depth.max() == 0  # not computed at weight 1
