"""Checkpoints: exact resume, the checkpoint's draft vocabulary, retired
settings. (Resuming a whole ``train`` run, in the state folder or the older
layout: test_train.py.)"""

import numpy as np
import pytest
from training_setup import make_trainer, synthetic_setup

from conftest import HIDDEN
from redrafter_mlx.errors import UserError
from redrafter_mlx.training.data import build_draft_vocab, build_positions
from redrafter_mlx.training.trainer import Trainer, train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return synthetic_setup(tmp_path_factory.mktemp("train") / "data")


@pytest.mark.parametrize(
    "head",
    [
        {},
        dict(exit_dim=HIDDEN, warm_start=True, freeze_head_steps=8),
        dict(exit_dim=HIDDEN, warm_start=True, freeze_head_steps=18),
    ],
)
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
    resumed = Trainer(
        base, build_positions(sequences, config.depth, config.eval_fraction), hidden, config, str(tmp_path / "a"), other
    )
    assert resumed.load_checkpoint()
    ids = np.array(resumed.drafter.draft_token_ids)
    np.testing.assert_array_equal(ids, np.array(first.drafter.draft_token_ids))
    assert not np.array_equal(ids, other)
    np.testing.assert_array_equal(resumed.to_draft[ids], np.arange(32))
    np.testing.assert_array_equal(resumed.to_draft, first.to_draft)


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
