"""Prefill: feed the prompts (or what their prompt caches do not hold) and
return the logits of the first new token, in chunks as mlx-lm does; a
chunk at a time (``Prefill``) where the caller has other work between them.

On the CPU, MLX's attention computes each layer's scores whole: an array of
(rows, query heads, chunk, context) floats, then its masked copy and its
softmax. After 6,000 tokens of context a chunk of 2,048 makes arrays of
about 600 MB each for the default model. There a chunk is made smaller as
the context grows (``chunk_size``), so that prefill works in bounded
memory; on the CPU the smaller chunks are also no slower
(bench/RESULTS.md). Elsewhere MLX fuses attention where it can, and
chunks are mlx-lm's size."""

from typing import Iterator, Sequence

import mlx.core as mx

from ..errors import UserError
from .base_model import BaseModel
from .cache import extend_batch

PREFILL_STEP_SIZE = 2048
SCORES_BYTES = 32 << 20  # on the CPU: the most one layer's attention scores of a chunk may take
MIN_CHUNK = 128  # ... unless the chunk would be shorter than this


def chunk_size(step_size: int, rows: int, heads: int, context: int) -> int:
    """Tokens the next chunk feeds after ``context`` tokens: ``step_size``,
    halved on the CPU while one layer's attention scores (``rows`` x
    ``heads`` x chunk x (context + chunk) float32s) would exceed
    ``SCORES_BYTES``, but not below ``MIN_CHUNK``."""
    chunk = step_size
    if mx.default_device() != mx.cpu:
        return chunk
    while chunk // 2 >= MIN_CHUNK and rows * heads * chunk * (context + chunk) * 4 > SCORES_BYTES:
        chunk //= 2
    return chunk


def check_prompts(base: BaseModel, prompts: Sequence[Sequence[int]]) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token")
    if any(not 0 <= t < base.vocab_size for p in prompts for t in p):
        raise UserError(f"prompt token ids must be in [0, {base.vocab_size})")
    longest = max(len(p) for p in prompts)
    if base.max_context and longest >= base.max_context:
        raise UserError(f"prompt of {longest} tokens does not fit the model's context of {base.max_context} tokens")


class Prefill:
    """Prompts being fed to a new batch, one chunk at a time, so that a
    caller can stop between chunks (a client that went away) or run other
    work between them (the steps of a running batch). ``advance`` feeds the
    next chunk; once ``done``, ``finish`` feeds each prompt's last token and
    returns what ``prefill`` returns.

    Prompts are fed together, left-padded to one length; with
    ``prompt_caches`` (a ``PromptCache`` or None per prompt) each prompt
    starts from the prefix its cache holds and is fed alone. Every chunk
    but the last token is fed as mlx-lm's generation loop feeds it: chunks
    of ``prefill_step_size`` tokens (on the CPU, fewer as the context grows:
    ``chunk_size``), then the last token alone.
    """

    def __init__(
        self,
        base: BaseModel,
        prompts: Sequence[Sequence[int]],
        prefill_step_size: int = PREFILL_STEP_SIZE,
        prompt_caches=None,
    ):
        self.base, self.step_size = base, prefill_step_size
        # Per group of rows fed together: [layout, caches, tokens (B, T), tokens fed].
        if prompt_caches is not None and any(c is not None and c.reusable(p) for p, c in zip(prompts, prompt_caches)):
            self.groups = [self._from_cache(p, c) for p, c in zip(prompts, prompt_caches)]
        else:
            longest = max(len(p) for p in prompts)
            left_padding = [longest - len(p) for p in prompts]
            padded = mx.array([[0] * pad + list(p) for pad, p in zip(left_padding, prompts)], mx.int32)
            self.groups = [[*base.make_cache(left_padding), padded, 0]]

    def _from_cache(self, prompt: Sequence[int], prompt_cache) -> list:
        reused = prompt_cache.reusable(prompt) if prompt_cache is not None else 0
        layout, cache = self.base.make_cache([0])
        if reused:
            for c, keys, values in zip(cache, prompt_cache.keys, prompt_cache.values):
                if values is None:  # a recurrent state, after all the cache's tokens (= reused)
                    c.cache = list(keys)
                else:
                    c.keys, c.values = keys[..., :reused, :], values[..., :reused, :]
            layout.lengths[:] = reused
        return [layout, cache, mx.array([list(prompt[reused:])], mx.int32), 0]

    @property
    def tokens_left(self) -> int:
        """Tokens per row still to feed before the last ones, over all groups."""
        return sum(tokens.shape[1] - 1 - fed for _, _, tokens, fed in self.groups)

    @property
    def done(self) -> bool:
        return self.tokens_left == 0

    def advance(self) -> None:
        """Feed the next chunk (of the first group with one left)."""
        for _ in self.layers():
            pass

    def layers(self) -> Iterator[None]:
        """Feed the next chunk a layer at a time: the chunk's graph is built
        whole, then each layer's caches are computed in turn, with a yield
        after each, where the caller may run other work (the running rows'
        steps) or stop for good (a client that went away: the rest is never
        computed, and this ``Prefill`` must then be dropped). The numbers
        are a whole chunk's: the same operations, computed in parts. Only
        the caches are computed: the chunk's output is not needed, so the
        last layer's attention and MLP never run (as mlx-lm's loop
        evaluates only its caches). A model split over ranks computes the
        chunk whole, output too: it carries the hops between ranks."""
        group = next(g for g in self.groups if g[3] < g[2].shape[1] - 1)
        layout, cache, tokens, fed = group
        chunk = chunk_size(self.step_size, tokens.shape[0], self.base.query_heads, layout.start)
        end = min(fed + chunk, tokens.shape[1] - 1)
        layout.begin_chunk()
        out = self.base.backbone(tokens[:, fed:end], cache=cache)
        layout.end_chunk(end - fed)
        if self.base.ranks.several:
            mx.eval([c.state_arrays() for c in cache], [out])
        else:
            for c in cache:
                mx.eval(c.state_arrays())
                yield
        group[3] = end

    def finish(self):
        """Feed every row's last token (what is left of the chunks too):
        (layout, caches, hidden (B, hidden_size), logits (B, 1, vocab)) at
        each prompt's last token, the groups joined into one batch."""
        while not self.done:
            self.advance()
        parts = []
        for layout, cache, tokens, _ in self.groups:
            layout.begin_chunk()
            hidden, logits = self.base(tokens[:, -1:], cache)
            layout.end_chunk(1)
            parts.append((layout, cache, hidden[:, -1], logits))
        layout, cache = parts[0][:2]
        for other in parts[1:]:
            extend_batch(layout, cache, other[0], other[1])
        if len(parts) == 1:
            return (*parts[0],)
        return layout, cache, mx.concatenate([p[2] for p in parts]), mx.concatenate([p[3] for p in parts])


def prefill(
    base: BaseModel, prompts: Sequence[Sequence[int]], prefill_step_size: int = PREFILL_STEP_SIZE, prompt_caches=None
):
    """Feed the prompts whole (``Prefill``, to the end). Returns (layout,
    cache, hidden (B, hidden_size), logits (B, 1, vocab)) at the last
    prompt token."""
    return Prefill(base, prompts, prefill_step_size, prompt_caches).finish()
