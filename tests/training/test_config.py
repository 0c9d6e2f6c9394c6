"""A training run's settings, checked when made."""

import pytest

from redrafter_mlx.errors import UserError
from redrafter_mlx.training.config import TrainConfig


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
