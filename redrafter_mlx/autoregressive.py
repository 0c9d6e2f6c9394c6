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
    with_hidden: bool = False,
) -> Iterator[list[StepOutput]]:
    """Yields one ``StepOutput`` per active row per token; rows that finish
    leave the batch. ``with_hidden`` attaches the hidden state each token was
    chosen from (what drafter training needs, for free)."""
    check_prompts(base, prompts)
    if max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    if max_tokens == 0:
        return
    tracker = RowTracker(prompts, max_tokens, eos_token_ids)
    layout, cache, hidden, logits = prefill(base, prompts, prefill_step_size)
    while True:
        token = choose(logits, tracker.history())[:, 0]
        hidden_rows = hidden.astype(mx.float16) if with_hidden else None
        mx.eval(token, hidden_rows)
        outputs = tracker.emit([[t] for t in np.array(token).tolist()])
        if with_hidden:
            hidden_rows = np.array(hidden_rows)
            for i, out in enumerate(outputs):
                out.hidden = hidden_rows[i : i + 1][: len(out.tokens)]
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
        hidden, logits = base(token[:, None], cache)
        hidden = hidden[:, -1]
        layout.end_chunk(1)
