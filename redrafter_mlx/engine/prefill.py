"""Prefill: feed the prompts (or what their prompt caches do not hold) and
return the logits of the first new token, in chunks as mlx-lm does."""

from typing import Sequence

import mlx.core as mx

from ..errors import UserError
from .base_model import BaseModel
from .cache import CacheLayout, extend_batch

PREFILL_STEP_SIZE = 2048


def check_prompts(base: BaseModel, prompts: Sequence[Sequence[int]]) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token")
    if any(not 0 <= t < base.vocab_size for p in prompts for t in p):
        raise UserError(f"prompt token ids must be in [0, {base.vocab_size})")
    longest = max(len(p) for p in prompts)
    if base.max_context and longest >= base.max_context:
        raise UserError(
            f"prompt of {longest} tokens does not fit the model's context of "
            f"{base.max_context} tokens"
        )


def _feed(base: BaseModel, layout: CacheLayout, cache: list, tokens: mx.array, prefill_step_size: int):
    """Feed aligned rows' tokens (B, T): all but the last in chunks, then
    the last alone, the way mlx-lm's generation loop does it. Returns hidden
    (B, hidden_size) and logits (B, 1, vocab) at the last token."""
    length = tokens.shape[1]
    for begin in range(0, length - 1, prefill_step_size):
        end = min(begin + prefill_step_size, length - 1)
        layout.begin_chunk()
        out = base.backbone(tokens[:, begin:end], cache=cache)
        layout.end_chunk(end - begin)
        # The output too: for a model split over ranks it carries the hops.
        mx.eval(out, [c.state_arrays() for c in cache])
    layout.begin_chunk()
    hidden, logits = base(tokens[:, -1:], cache)
    layout.end_chunk(1)
    return hidden[:, -1], logits


def prefill(base: BaseModel, prompts: Sequence[Sequence[int]], prefill_step_size: int = PREFILL_STEP_SIZE, prompt_caches=None):
    """Feed the left-padded prompts. With ``prompt_caches`` (a
    ``PromptCache`` or None per prompt), a prompt starts from the prefix its
    cache holds, and each prompt is fed alone.

    Returns (layout, cache, hidden (B, hidden_size), logits (B, 1, vocab)) at
    the last prompt token.
    """
    if prompt_caches is not None and any(c is not None and c.reusable(p) for p, c in zip(prompts, prompt_caches)):
        parts = [_prefill_from_cache(base, p, c, prefill_step_size) for p, c in zip(prompts, prompt_caches)]
        layout, cache, hidden, logits = parts[0]
        for other in parts[1:]:
            extend_batch(layout, cache, other[0], other[1])
        return layout, cache, mx.concatenate([p[2] for p in parts]), mx.concatenate([p[3] for p in parts])
    longest = max(len(p) for p in prompts)
    left_padding = [longest - len(p) for p in prompts]
    padded = mx.array([[0] * pad + list(p) for pad, p in zip(left_padding, prompts)], mx.int32)
    layout, cache = base.make_cache(left_padding)
    return (layout, cache, *_feed(base, layout, cache, padded, prefill_step_size))


def _prefill_from_cache(base: BaseModel, prompt: Sequence[int], prompt_cache, prefill_step_size: int):
    reused = prompt_cache.reusable(prompt) if prompt_cache is not None else 0
    layout, cache = base.make_cache([0])
    if reused:
        for c, keys, values in zip(cache, prompt_cache.keys, prompt_cache.values):
            if values is None:  # a recurrent state, after all the cache's tokens (= reused)
                c.cache = list(keys)
            else:
                c.keys, c.values = keys[..., :reused, :], values[..., :reused, :]
        layout.lengths[:] = reused
    tokens = mx.array([list(prompt[reused:])], mx.int32)
    return (layout, cache, *_feed(base, layout, cache, tokens, prefill_step_size))
