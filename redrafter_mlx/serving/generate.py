"""mlx-lm's generation API, decoded by ReDrafter.

``stream_generate``, ``generate`` and ``batch_generate`` take mlx-lm's own
arguments and give back mlx-lm's own types, so that an app written against
``mlx_lm`` switches by changing its import:

- ``sampler`` and ``logits_processors`` are mlx-lm's
  (``mlx_lm.sample_utils.make_sampler`` / ``make_logits_processors``, or any
  functions of their shapes). Every tree node's token is drawn by the app's
  sampler from that node's processed distribution, and the processors see
  the node's own path (``engine.sampling.AppSampler``): greedy output is
  plain decoding's, and sampled output has its distribution.
- ``prompt_cache`` is what ``make_prompt_cache(model)`` gives (mlx-lm's
  function asks the model, ``ReDrafter.make_cache``). As in mlx-lm, it
  holds the conversation so far, and each prompt continues it.
- A string prompt is encoded as mlx-lm encodes it, without the chat
  template: apply the template yourself, as with mlx-lm.
- ``stream_generate`` yields one ``GenerationResponse`` per token, with
  mlx-lm's fields; ``from_draft`` marks the tokens a step accepted from
  the drafts. It also reports the steps so far.

What mlx-lm's arguments ask and ReDrafter does not do (a rotating or
quantized KV cache, input embeddings, a separate draft model) is refused
with one clear error, not ignored. ``draft`` (a ``DraftSettings``) sets how
the drafts are made; the defaults size each step by this machine's cost.
"""

import time
from dataclasses import dataclass, fields
from typing import Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import BatchResponse
from mlx_lm.generate import GenerationResponse as MlxLmResponse
from mlx_lm.generate_utils import BatchStats
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..drafting.settings import DraftSettings
from ..engine.decoder import generate_steps
from ..engine.prefill import PREFILL_STEP_SIZE
from ..engine.prompt_cache import PromptCache
from ..engine.sampling import AppSampler
from ..engine.types import ReDrafter
from ..errors import UserError


@dataclass
class GenerationResponse(MlxLmResponse):
    """mlx-lm's ``GenerationResponse`` (text, token, logprobs, from_draft,
    prompt_tokens, prompt_tps, generation_tokens, generation_tps,
    peak_memory, finish_reason), and what ReDrafter's steps did so far:

    steps: verification passes; step_tokens: tokens they produced
        (accepted drafts and bonus tokens, before cutting at the end);
        step_tokens / steps is the mean tokens per step.
    cached_tokens: prompt tokens the prompt cache served."""

    steps: int = 0
    step_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Options:
    """The keyword arguments of mlx-lm's ``generate_step`` that ReDrafter
    takes (``options``)."""

    sampler: Optional[Callable] = None
    logits_processors: Optional[list] = None
    prompt_cache: Optional[PromptCache] = None
    prefill_step_size: int = PREFILL_STEP_SIZE
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None
    draft: Optional[DraftSettings] = None


# mlx-lm's arguments that ask for what ReDrafter does not do, and the value that asks for nothing.
UNSUPPORTED = {"max_kv_size": None, "kv_bits": None, "input_embeddings": None, "draft_model": None}
IGNORED = ("kv_group_size", "quantized_kv_start", "num_draft_tokens", "stream")  # meaningful only with the above


def options(kwargs: dict, allowed: Optional[set] = None) -> Options:
    """``Options`` from mlx-lm's keyword arguments: one clear error for an
    argument ReDrafter does not support or does not know. allowed: the
    names taken (default: every field of ``Options``)."""
    allowed = {f.name for f in fields(Options)} if allowed is None else allowed
    given = dict(kwargs)
    for name, nothing in UNSUPPORTED.items():
        if given.pop(name, nothing) is not nothing:
            raise UserError(f"{name} is not supported by ReDrafter's decoding")
    for name in IGNORED:
        given.pop(name, None)
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise UserError(f"unknown argument{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    chosen = Options(**given)
    if chosen.prompt_cache is not None and not isinstance(chosen.prompt_cache, PromptCache):
        raise UserError("prompt_cache must come from make_prompt_cache(model), with the model redrafter_mlx.load gave")
    return chosen


def check_model(model) -> ReDrafter:
    if not isinstance(model, ReDrafter):
        raise UserError("the model must be what redrafter_mlx.load returns (a base model with its drafter)")
    return model


def wrap(tokenizer) -> TokenizerWrapper:
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def prompt_ids(tokenizer: TokenizerWrapper, prompt: Union[str, mx.array, Sequence[int]]) -> list:
    """Token ids as mlx-lm's ``stream_generate`` makes them: a string is
    encoded as it is, with the tokenizer's special tokens unless it already
    begins with the BOS token."""
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        return list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
    return [int(t) for t in (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]


def continued(cache: Optional[PromptCache], prompt: list) -> list:
    """The whole sequence a prompt continues to: the conversation the cache
    holds (its tokens and those still pending), then the prompt."""
    return prompt if cache is None else list(cache.tokens) + list(cache.pending) + prompt


def token_limit(redrafter: ReDrafter, max_tokens: int, sequence: list) -> int:
    """mlx-lm's ``max_tokens`` (-1: no limit but the model's context)."""
    if max_tokens == -1:
        return max(redrafter.base.max_context - len(sequence), 1)
    if max_tokens < 1:
        raise UserError(f"max_tokens must be at least 1 (or -1 for no limit), got {max_tokens}")
    return max_tokens


def stream_generate(
    model: ReDrafter,
    tokenizer,
    prompt: Union[str, mx.array, List[int]],
    max_tokens: int = 256,
    draft_model=None,
    **kwargs,
) -> Iterator[GenerationResponse]:
    """Generate from one prompt, yielding a ``GenerationResponse`` per
    token, as mlx-lm's ``stream_generate`` does. ``kwargs``: mlx-lm's
    ``generate_step`` arguments that apply (``sampler``,
    ``logits_processors``, ``prompt_cache``, ``prefill_step_size``,
    ``prompt_progress_callback``), and ``draft`` (a ``DraftSettings``).

    The end-of-sequence token ends the stream in a last response of its
    own (``finish_reason`` "stop"), and the ``max_tokens``-th token comes in
    a last response with ``finish_reason`` "length", as in mlx-lm."""
    redrafter, tokenizer = check_model(model), wrap(tokenizer)
    chosen = options(dict(kwargs, draft_model=draft_model))
    cache = chosen.prompt_cache
    ids = prompt_ids(tokenizer, prompt)
    if not ids:
        raise UserError("the prompt is empty")
    sequence = continued(cache, ids)
    limit = token_limit(redrafter, max_tokens, sequence)
    cached = cache.reusable(sequence) if cache is not None else 0
    choose = AppSampler(chosen.sampler, chosen.logits_processors, distributions=True, starts=[len(sequence) - len(ids)])
    progress = chosen.prompt_progress_callback or (lambda done, total: None)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    progress(0, len(ids))
    running = generate_steps(
        redrafter,
        [sequence],
        max_tokens=limit,
        draft=chosen.draft,
        choose=choose,
        eos_token_ids=tokenizer.eos_token_ids,
        prefill_step_size=chosen.prefill_step_size,
        prompt_caches=None if cache is None else [cache],
    )
    tic = time.perf_counter()
    prompt_tps, produced, steps, step_tokens, generated = 0.0, 0, 0, 0, []
    for (out,) in running:
        if out.num_accepted is None:
            progress(len(ids), len(ids))
            prompt_tps = len(ids) / max(time.perf_counter() - tic, 1e-9)
            tic = time.perf_counter()
        else:
            steps, step_tokens = steps + 1, step_tokens + out.num_accepted + 1
        emitted = [
            (
                token,
                None if out.distributions is None else out.distributions[i],
                out.num_accepted is not None and i < out.num_accepted,
            )
            for i, token in enumerate(out.tokens)
        ]
        if (
            out.finish_reason == "stop"
        ):  # as in mlx-lm, the end-of-sequence token ends the stream in a response of its own
            emitted.append((out.stop_token, None, False))
        for n, (token, logprobs, from_draft) in enumerate(emitted):
            last = out.finish_reason is not None and n == len(emitted) - 1
            produced += 1
            generated.append(token)
            if not (last and out.finish_reason == "stop"):
                detokenizer.add_token(token)
            if last:
                detokenizer.finalize()
            yield GenerationResponse(
                text=detokenizer.last_segment,
                token=token,
                logprobs=logprobs,
                from_draft=from_draft,
                prompt_tokens=len(ids),
                prompt_tps=prompt_tps,
                generation_tokens=produced,
                generation_tps=produced / max(time.perf_counter() - tic, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=out.finish_reason if last else None,
                steps=steps,
                step_tokens=step_tokens,
                cached_tokens=cached,
            )
    if cache is not None:
        conversation = sequence + generated
        cache.pending = conversation[len(cache.tokens) :]


def generate(model: ReDrafter, tokenizer, prompt: Union[str, List[int]], verbose: bool = False, **kwargs) -> str:
    """The whole text of ``stream_generate(model, tokenizer, prompt,
    **kwargs)``; with ``verbose``, streamed to standard output with
    mlx-lm's speed lines (and ReDrafter's tokens per step)."""
    if verbose:
        print("=" * 10)
    text, response = "", None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        text += response.text
        if verbose:
            print(response.text, end="", flush=True)
    if verbose:
        print()
        print("=" * 10)
        if not text:
            print("No text generated for this prompt")
            return text
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        if response.steps:
            print(f"Steps: {response.steps}, {response.step_tokens / response.steps:.2f} tokens per step")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text


def batch_generate(
    model: ReDrafter,
    tokenizer,
    prompts: List[List[int]],
    prompt_caches: Optional[List[PromptCache]] = None,
    max_tokens: Union[int, List[int]] = 128,
    verbose: bool = False,
    return_prompt_caches: bool = False,
    return_token_ids: bool = False,
    return_logprobs: bool = False,
    **kwargs,
) -> BatchResponse:
    """Generate for many tokenized prompts together, as mlx-lm's
    ``batch_generate``: returns mlx-lm's ``BatchResponse`` (texts in input
    order, stats, and on request each prompt's cache, token ids and the
    log-probability of each sampled token). ``kwargs``: ``sampler``,
    ``logits_processors``, ``completion_batch_size`` (prompts decoded
    together, default 32), ``prefill_step_size`` and ``draft``;
    ``prefill_batch_size`` is taken and not needed (prompts are prefilled
    together).

    ``prompt_caches``: a cache per prompt (or None), which each prompt
    continues; as in mlx-lm they are not changed: with
    ``return_prompt_caches``, the response holds new ones."""
    redrafter, tokenizer = check_model(model), wrap(tokenizer)
    given = dict(kwargs)
    batch_size = given.pop("completion_batch_size", 32)
    given.pop("prefill_batch_size", None)
    chosen = options(given, allowed={"sampler", "logits_processors", "prefill_step_size", "draft"})
    if batch_size < 1:
        raise UserError(f"completion_batch_size must be at least 1, got {batch_size}")
    caches = list(prompt_caches) if prompt_caches is not None else [None] * len(prompts)
    if len(caches) != len(prompts):
        raise UserError(f"{len(prompts)} prompts but {len(caches)} prompt caches")
    if any(c is not None and not isinstance(c, PromptCache) for c in caches):
        raise UserError("prompt_caches must come from make_prompt_cache(model), with the model redrafter_mlx.load gave")
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    sequences = [continued(c, [int(t) for t in p]) for c, p in zip(caches, prompts)]
    limits = [token_limit(redrafter, m, s) for m, s in zip(limits, sequences)]
    # New caches, so that the given ones stay as they are (they share arrays, never change them).
    working = [
        PromptCache(c.tokens, c.keys, c.values, c.model)
        if c is not None
        else PromptCache()
        if return_prompt_caches
        else None
        for c in caches
    ]
    choose = AppSampler(
        chosen.sampler, chosen.logits_processors, starts=[len(s) - len(p) for s, p in zip(sequences, prompts)]
    )
    if return_logprobs:
        choose.logprobs_wanted = 0
    tokens, logprobs, ends = [[] for _ in prompts], [[] for _ in prompts], [[] for _ in prompts]
    stats = BatchStats(prompt_tokens=sum(map(len, prompts)))
    start, finished = time.perf_counter(), 0
    for first in range(0, len(prompts), batch_size):
        rows = range(first, min(first + batch_size, len(prompts)))
        tic = time.perf_counter()
        running = generate_steps(
            redrafter,
            [sequences[i] for i in rows],
            max_tokens=[limits[i] for i in rows],
            draft=chosen.draft,
            choose=choose,
            eos_token_ids=tokenizer.eos_token_ids,
            prefill_step_size=chosen.prefill_step_size,
            row_ids=rows,
            prompt_caches=[working[i] for i in rows],
        )
        for n, outputs in enumerate(running):
            if n == 0:  # the prompts' first tokens
                stats.prompt_time += time.perf_counter() - tic
            else:
                stats.generation_steps += 1
            for out in outputs:
                i = rows[out.row]  # (out.row: the prompt's index in this chunk)
                tokens[i] += out.tokens
                ends[i] = [out.stop_token] if out.finish_reason == "stop" else []
                logprobs[i] += [chosen_logprob for chosen_logprob, _ in out.logprobs or ()]
                finished += out.finish_reason is not None
                if out.finish_reason is not None and verbose:
                    print(f"[batch_generate] Finished processing {finished}/{len(prompts)} ...", end="\r")
    stats.wall_time = time.perf_counter() - start
    stats.decode_time = stats.wall_time - stats.prompt_time
    stats.generation_tokens = sum(map(len, tokens))
    stats.peak_memory = mx.get_peak_memory() / 1e9
    for cache, sequence, answer, end in zip(working, sequences, tokens, ends):
        if cache is not None:
            cache.pending = (sequence + answer + end)[len(cache.tokens) :]
    texts = [tokenizer.decode(t) for t in tokens]
    if verbose:
        print(f"[batch_generate] Finished processing {len(prompts)}/{len(prompts)}")
        print(f"[batch_generate] Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} tokens-per-sec")
        print(
            f"[batch_generate] Generation: {stats.generation_tokens} tokens, {stats.generation_tps:.3f} tokens-per-sec"
        )
        print(f"[batch_generate] Peak memory: {stats.peak_memory:.3f} GB")
    return BatchResponse(
        texts,
        stats,
        working if return_prompt_caches else None,
        tokens if return_token_ids else None,
        logprobs if return_logprobs else None,
    )
