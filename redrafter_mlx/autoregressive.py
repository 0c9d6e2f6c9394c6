"""Plain batched autoregressive decoding with the same cache and row
bookkeeping as ReDrafter: the baseline for benchmarks and the generator for
distillation data."""

from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np

from .base_model import BaseModel
from .generate import PREFILL_STEP_SIZE, Chooser, StepOutput, RowTracker, check_prompts, greedy, prefill


def autoregressive_steps(
    base: BaseModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 256,
    choose: Chooser = greedy,
    eos_token_ids: Sequence[int] = (),
    prefill_step_size: int = PREFILL_STEP_SIZE,
) -> Iterator[list[StepOutput]]:
    """Yields one ``StepOutput`` per active row per token; rows that finish
    leave the batch."""
    check_prompts(base, prompts)
    if max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    if max_tokens == 0:
        return
    tracker = RowTracker(prompts, max_tokens, eos_token_ids)
    layout, cache, _, logits = prefill(base, prompts, prefill_step_size)
    while True:
        token = choose(logits, tracker.history())[:, 0]
        mx.eval(token)
        outputs = tracker.emit([[t] for t in np.array(token).tolist()])
        yield outputs
        keep = tracker.keep_unfinished(outputs)
        if keep is not None:
            if not keep:
                return
            layout.filter(keep)
            keep = mx.array(keep)
            for c in cache:
                c.filter(keep)
            token = token[keep]
        layout.begin_chunk()
        _, logits = base(token[:, None], cache)
        layout.end_chunk(1)
