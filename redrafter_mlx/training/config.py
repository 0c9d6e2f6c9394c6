"""A training run's settings (``TrainConfig``), checked when made.

They are written into every checkpoint, so that a run resumes only under
the settings it began with (``checkpoints.read_checkpoint``), and into the
finished drafter's ``config.json``, which its model card shows
(``card.model_card``). ``RETIRED_SETTINGS`` lets a checkpoint saved by an
earlier version, with settings since removed, resume when those settings
were at the values that made them no-ops.
"""

from dataclasses import dataclass

from ..errors import UserError


@dataclass
class TrainConfig:
    """A training run's settings; checked when made (``UserError``)."""

    depth: int = 5  # T: drafted tokens per position
    exit_dim: int = 1024
    num_draft_layers: int = 1
    draft_vocab: int = 0  # 0: the full vocabulary (official format)
    dtype: str = "float32"  # of the drafter: float32 or bfloat16
    steps: int = 2000
    batch_size: int = 1024  # positions per step
    learning_rate: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.0
    warm_start: bool = False  # start from the base model's head (exit_dim = hidden_size)
    freeze_head_steps: int = 0  # with warm_start: the vocab projection stays the base head's for these steps
    hidden_loss: float = 0.0  # weight of the features' squared error to h[t+k+1] (exit_dim = hidden_size)
    grad_clip: float = 1.0
    eval_every: int = 250
    save_every: int = 250
    eval_fraction: float = 0.02  # of sequences, held out by prompt index
    seed: int = 0

    def __post_init__(self):
        minimums = dict(
            depth=1,
            exit_dim=1,
            num_draft_layers=0,
            draft_vocab=0,
            steps=1,
            batch_size=1,
            warmup=0,
            freeze_head_steps=0,
            hidden_loss=0,
            eval_every=1,
            save_every=1,
        )
        for name, low in minimums.items():
            if getattr(self, name) < low:
                raise UserError(f"{name.replace('_', ' ')} must be at least {low}, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise UserError(f"the drafter trains in float32 or bfloat16, not {self.dtype}")
        if self.freeze_head_steps and not self.warm_start:
            raise UserError("freezing the head needs a warm start (it keeps the base model's head)")


# Settings of earlier versions, and the value that made them no-ops: a
# checkpoint saved with these values resumes under today's settings.
RETIRED_SETTINGS = {"rnn": True, "hidden_dropout": 0.0, "soft_targets": 0.0, "lookup_weight": 1.0}
