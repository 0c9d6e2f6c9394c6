"""Plain batched autoregressive decoding: the baseline for benchmarks and
the generator for distillation data. It is the engine's own plain step
(``Decoder`` with nothing drafted, pipelined as mlx-lm's loop is unless the
token choice reads the tokens, as a repetition penalty does), with a queue
of prompts that refill the batch as rows finish: the one plain loop the
package has."""

from typing import Iterator, Optional, Sequence

from ..drafting.settings import DraftSettings
from ..errors import UserError
from .base_model import BaseModel
from .decoder import Decoder
from .prefill import PREFILL_STEP_SIZE, check_prompts
from .sampling import greedy
from .types import Chooser, ReDrafter, StepOutput

PLAIN = DraftSettings(max_nodes=0, lookup=False, datastore_beams=0)


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
    """Yields the ``StepOutput`` of each active row per token (``row``: the
    prompt's index in ``prompts``); rows that finish leave the batch.

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
    decoder = Decoder(
        ReDrafter(base, None),
        PLAIN,
        choose,
        eos_token_ids,
        prefill_step_size=prefill_step_size,
        with_hidden=with_hidden,
    )
    first = list(range(min(size, len(prompts))))
    waiting = list(range(len(first), len(prompts)))
    outputs = decoder.join([prompts[i] for i in first], max_tokens, ids=first)
    while True:
        yield outputs
        running = sum(r not in decoder.leaving for r in decoder.rows)
        free = size - running
        if waiting and (free >= max(size // 4, 1) or not running):
            joining, waiting = waiting[:free], waiting[free:]
            # Prompts join in input order, so the decoder names them by their index.
            outputs = decoder.join([prompts[i] for i in joining], max_tokens, ids=joining)
        elif not running:
            return
        else:
            outputs = decoder.step()
