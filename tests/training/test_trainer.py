"""The training loss and loop: the loss, learning a pattern, warm starts,
a frozen head, the hidden-state loss."""

import mlx.core as mx
import numpy as np
import pytest
from training_setup import make_trainer, synthetic_setup

from conftest import HIDDEN, VOCAB, tiny_drafter
from redrafter_mlx.drafting.drafter import load_drafter
from redrafter_mlx.errors import UserError
from redrafter_mlx.training.trainer import drafter_loss, train


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


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return synthetic_setup(tmp_path_factory.mktemp("train") / "data")


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


@pytest.mark.parametrize("draft_vocab", [0, 48])
def test_a_warm_started_drafter_first_predicts_the_base_models_ranking_of_h(setup, draft_vocab):
    """Built for it: whatever the RNN state, the warm-started drafter's
    logits are the base model's logits of h over the draft vocabulary."""
    base, sequences, _ = setup
    trainer = make_trainer(
        setup, "unused", exit_dim=HIDDEN, warm_start=True, draft_vocab=draft_vocab, num_draft_layers=2
    )
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
    trainer = make_trainer(
        setup,
        tmp_path / "out",
        exit_dim=HIDDEN,
        warm_start=True,
        hidden_loss=1.0,
        freeze_head_steps=10,
        steps=20,
        draft_vocab=48,
    )
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
