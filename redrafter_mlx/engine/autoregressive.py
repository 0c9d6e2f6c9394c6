"""Plain batched autoregressive decoding with the same cache and row
bookkeeping as ReDrafter: the baseline for benchmarks and the generator for
distillation data."""

from typing import Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..errors import UserError
from .base_model import BaseModel
from .cache import extend_batch
from .prefill import PREFILL_STEP_SIZE, check_prompts, prefill
from .rows import RowTracker
from .sampling import greedy
from .types import Chooser, StepOutput


def autoregressive_steps(
    base: BaseModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 256,
    choose: Chooser = greedy,
    eos_token_ids: Sequence[int] = (),
    prefill_step_size: int = PREFILL_STEP_SIZE,
    with_hidden: bool = False,
    max_batch: Optional[int] = None,
) -> Iterator[list[StepOutput]]:
    """Yields one ``StepOutput`` per active row per token; rows that finish
    leave the batch.

    With ``max_batch``, at most that many prompts run at once, in input
    order; as rows finish, waiting prompts are prefilled and join the batch
    (a quarter of the batch at a time, to share their prefill). With
    ``with_hidden``, each output carries the hidden state its token was
    chosen from (what drafter training needs, for free).
    """
    check_prompts(base, prompts)
    if max_tokens < 0:
        raise UserError(f"max tokens must be at least 0, got {max_tokens}")
    if max_tokens == 0:
        return
    size = max_batch or len(prompts)
    waiting = list(range(size, len(prompts)))
    tracker = RowTracker(prompts, max_tokens, eos_token_ids, rows=range(min(size, len(prompts))))
    layout, cache, hidden, logits = prefill(base, prompts[:size], prefill_step_size)
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
        if keep is not None and keep:
            trim = layout.filter(keep)
            keep = mx.array(keep)
            for c in cache:
                c.filter(keep, trim)
            token = token[keep]
        if tracker.rows:
            layout.begin_chunk()
            hidden, logits = base(token[:, None], cache)
            hidden = hidden[:, -1]
            layout.end_chunk(1)
        free = size - len(tracker.rows)
        if waiting and (free >= max(size // 4, 1) or not tracker.rows):
            joining, waiting = waiting[:free], waiting[free:]
            new_layout, new_cache, new_hidden, new_logits = prefill(base, [prompts[i] for i in joining], prefill_step_size)
            if tracker.rows:
                extend_batch(layout, cache, new_layout, new_cache)
                hidden, logits = mx.concatenate([hidden, new_hidden]), mx.concatenate([logits, new_logits])
            else:
                layout, cache, hidden, logits = new_layout, new_cache, new_hidden, new_logits
            tracker.rows += joining
        elif not tracker.rows:
            return
