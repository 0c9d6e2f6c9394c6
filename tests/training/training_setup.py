"""What the training tests share (not a test module): synthetic distilled
data a drafter can learn at every depth, the tiny base model's hidden states
for it, and trainers made on them."""

import numpy as np

from conftest import HIDDEN, VOCAB, tiny_model
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.training.config import TrainConfig
from redrafter_mlx.training.data import build_draft_vocab, build_positions, compute_hidden_cache
from redrafter_mlx.training.distill import DataFolder
from redrafter_mlx.training.trainer import Trainer


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


def synthetic_setup(folder):
    """(base, sequences, hidden): the tiny base model, synthetic data
    written into ``folder`` and its hidden-state cache."""
    data = synthetic_data(folder)
    base = BaseModel(tiny_model("llama", seed=4))
    sequences = data.load()
    hidden = compute_hidden_cache(base, data, sequences, batch_tokens=256, progress=False)
    return base, sequences, hidden


def make_trainer(setup, output, **overrides):
    base, sequences, hidden = setup
    config = TrainConfig(
        **{
            **dict(
                depth=4,
                exit_dim=64,
                steps=300,
                batch_size=64,
                learning_rate=3e-3,
                warmup=20,
                eval_every=100,
                save_every=100,
                eval_fraction=0.1,
            ),
            **overrides,
        }
    )
    positions = build_positions(sequences, config.depth, config.eval_fraction)
    vocab = build_draft_vocab(sequences, config.draft_vocab) if config.draft_vocab else None
    return Trainer(base, positions, hidden, config, str(output), vocab)
