"""Tiny random models and drafters shared by the tests."""

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import gemma3_text, llama, qwen2

from redrafter_mlx.base_model import BaseModel
from redrafter_mlx.drafter import Drafter, DrafterArgs
from redrafter_mlx.generate import ReDrafter

VOCAB = 256
HIDDEN = 64


def tiny_model(kind: str = "llama", seed: int = 0, quantize: bool = False, vocab: int = VOCAB) -> nn.Module:
    """A randomly initialised float32 mlx-lm model."""
    mx.random.seed(seed)
    common = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        max_position_embeddings=4096,
    )
    if kind == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", tie_word_embeddings=False, **common))
    elif kind == "qwen2":
        model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", tie_word_embeddings=True, **common))
    elif kind == "gemma3":
        args = dict(common, num_hidden_layers=3, head_dim=16)
        model = gemma3_text.Model(
            gemma3_text.ModelArgs(
                model_type="gemma3_text", sliding_window=8, sliding_window_pattern=3, **args
            )
        )
    else:
        raise ValueError(kind)
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def tiny_drafter(
    seed: int = 0, rnn: bool = True, exit_dim: int = 2 * HIDDEN, layers: int = 1, draft_vocab=None
) -> Drafter:
    mx.random.seed(1000 + seed)
    args = DrafterArgs(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        exit_dim=exit_dim,
        num_draft_layers=layers,
        rnn=rnn,
        draft_vocab_size=draft_vocab,
    )
    drafter = Drafter(args)
    if draft_vocab:
        drafter.draft_token_ids = mx.random.permutation(VOCAB)[:draft_vocab].astype(mx.int32)
    mx.eval(drafter.parameters())
    return drafter


def tiny_redrafter(kind="llama", seed=0, quantize=False, **drafter_kwargs) -> ReDrafter:
    return ReDrafter(BaseModel(tiny_model(kind, seed, quantize)), tiny_drafter(seed, **drafter_kwargs))


@pytest.fixture
def prompt():
    return [5, 17, 42, 99, 3, 250, 7, 18]


class OracleDrafter:
    """A test double with the drafter's interface that drafts the base
    model's true greedy continuations of known sequences.

    It finds where it is by matching the hidden state it is given against the
    base model's hidden states over each of ``sequences`` (prompt +
    reference continuation), and counts drafting depth in its state. With ``corrupt``,
    the drafted token at a pseudo-random depth in 1..corrupt (fixed per
    position) is replaced by a wrong one, so acceptance lengths vary.
    """

    def __init__(self, base: BaseModel, sequences: list, corrupt: int = 0):
        # Sequences side by side, each followed by 16 filler positions that
        # depths past its end read.
        flat, hidden = [], []
        for sequence in sequences:
            flat += sequence + [0] * 16
            hidden += [base.backbone(mx.array([sequence]))[0], mx.full((16, base.hidden_size), 1e6)]
        self.sequence = mx.array(flat, mx.int32)
        self.hidden = mx.concatenate(hidden)  # (T, hidden)
        self.corrupt = corrupt
        self.wrong_depth = mx.random.randint(1, corrupt + 1, (len(flat),), key=mx.random.key(7)) if corrupt else None
        self.draft_vocab_size = base.vocab_size

    def update_state(self, token_embeddings, state):
        depth = mx.zeros(token_embeddings.shape[:-1] + (1,)) if state is None else state
        return depth + 1

    def log_probs(self, hidden, state):
        distance = ((hidden[..., None, :] - self.hidden) ** 2).sum(-1)  # (..., T)
        position = mx.argmin(distance, axis=-1)
        depth = state[..., 0].astype(mx.int32)
        token = self.sequence[position + 1 + depth]
        if self.corrupt:
            wrong = self.wrong_depth[position] == depth
            token = mx.where(wrong, (token + 1) % self.draft_vocab_size, token)
        one_hot = mx.arange(self.draft_vocab_size) == token[..., None]
        return mx.where(one_hot, 0.0, -1e9 - mx.arange(self.draft_vocab_size))

    def token_ids(self, draft_indices):
        return draft_indices


def run_cli(*args, input=None, timeout=600):
    """Run the command line from this checkout; returns the completed process."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    return subprocess.run(
        [sys.executable, "-m", "redrafter_mlx.cli", *map(str, args)],
        input=input, capture_output=True, text=True, timeout=timeout, cwd=root, env=env,
    )


@pytest.fixture(scope="session")
def smol_drafter(tmp_path_factory):
    """A random drafter shaped for SmolLM2-135M (hidden 576, vocab 49152)."""
    from redrafter_mlx.drafter import save_drafter

    mx.random.seed(0)
    drafter = Drafter(DrafterArgs(vocab_size=49152, hidden_size=576, exit_dim=64, num_draft_layers=1))
    path = tmp_path_factory.mktemp("drafters") / "smol-random"
    save_drafter(drafter, str(path))
    return str(path)
