"""``redrafter-mlx train`` as a whole (``train_drafter``): the output folder
holds the drafter alone, with its card, and its training state beside it;
an interrupted run resumes; folders that are not runs are refused. The
parts have their own tests: test_data.py, test_trainer.py,
test_checkpoints.py, test_card.py."""

import numpy as np
import pytest
from mlx.utils import tree_flatten
from training_setup import synthetic_data

from conftest import VOCAB, tiny_model
from redrafter_mlx.drafting.drafter import load_drafter
from redrafter_mlx.errors import UserError
from redrafter_mlx.training.config import TrainConfig
from redrafter_mlx.training.distill import DataFolder
from redrafter_mlx.training.trainer import Trainer

# -- train_drafter's output: the drafter alone, its card, its training state beside it


DRAFTER_FILES = ["README.md", "config.json", "model.safetensors"]


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    """The tiny model of ``training_setup.synthetic_setup`` saved as an mlx-lm folder (with a word
    tokenizer), and a data folder distilled (synthetically) for it."""
    from mlx_lm.utils import save_config, save_model

    from conftest import save_word_tokenizer

    root = tmp_path_factory.mktemp("train-drafter")
    model = tiny_model("llama", seed=4)
    save_model(root / "model", model)
    save_config(dict(vars(model.args)), root / "model" / "config.json")
    save_word_tokenizer(root / "model", VOCAB)
    synthetic_data(root / "data")
    return str(root / "model"), str(root / "data")


def small_config(**overrides):
    return TrainConfig(
        **{
            **dict(
                depth=3,
                exit_dim=32,
                steps=6,
                batch_size=64,
                warmup=2,
                eval_every=3,
                save_every=3,
                eval_fraction=0.1,
                draft_vocab=48,
            ),
            **overrides,
        }
    )


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
    assert [json.loads(line)["step"] for line in (state / "train_log.jsonl").read_text().splitlines()] == list(
        range(1, 7)
    )

    redrafter, _ = load(model, drafter=str(output), dtype="float32")
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
    assert refreshed.replace(
        next(line for line in refreshed.splitlines() if line.startswith("| datastore |")), ""
    ) == card.replace(next(line for line in card.splitlines() if line.startswith("| datastore |")), "")
    assert load(model, drafter=str(output), dtype="float32")[0].datastore is not None


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
    assert redrafter.drafter is not None and redrafter.drafter_identity == loader.drafter_identity(
        str(tmp_path / "out")
    )


def test_an_interrupted_run_resumes_from_its_state_folder_and_the_drafter_appears_at_the_end(
    model_and_data, tmp_path, monkeypatch
):
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
