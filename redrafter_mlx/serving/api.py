"""The step-level text API that the command line, the chat and the
benchmarks run on: ``stream_steps`` yields a response per ReDrafter step,
with what the step did; ``batch_steps`` runs several prompts together and
reports each one's steps. ``encode_prompt`` makes token ids as mlx-lm's
generate command does. Apps use mlx-lm's own API (``serving.generate``)."""

import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import mlx.core as mx

from ..drafting.settings import DraftSettings
from ..engine.decoder import generate_steps
from ..engine.profile import StepProfile
from ..engine.prompt_cache import PromptCache
from ..engine.sampling import greedy
from ..engine.types import Chooser, ReDrafter
from ..errors import UserError


@dataclass
class StepResponse:
    """One ReDrafter step of :func:`stream_steps`.

    text: the new segment of decoded text (may be empty).
    tokens: the token ids this step produced (accepted drafts + bonus).
    num_accepted: drafted tokens accepted this step (None for the first
        token, which the prefill produces).
    prompt_tokens, prompt_tps: prompt length and prefill speed (of the
        tokens prefilled: those the prompt cache did not hold).
    cached_tokens: prompt tokens taken from the prompt cache.
    generation_tokens, generation_tps: tokens so far and their rate.
    steps: base-model verification passes so far.
    step_tokens: tokens those passes produced (accepted + bonus, before
        cutting at EOS or max_tokens); step_tokens / steps is the mean
        tokens per step.
    step_nodes: tree nodes those passes verified (the root included).
    peak_memory: peak memory so far, GB.
    finish_reason: "stop", "length" or None.
    """

    text: str
    tokens: list
    num_accepted: Optional[int]
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    steps: int
    step_tokens: int
    step_nodes: int
    peak_memory: float
    finish_reason: Optional[str] = None
    cached_tokens: int = 0


def encode_prompt(
    tokenizer, prompt: Union[str, Sequence], chat_template: bool = True, template_options: Optional[dict] = None
) -> list:
    """Token ids for a prompt, as mlx-lm's generate command makes them: for
    a user message (str), the chat template applied when the tokenizer has
    one (unless ``chat_template`` is False), else the text encoded as it is;
    a conversation (a list of ``{"role", "content"}``) always goes through
    the chat template (with ``template_options``: its keyword arguments,
    such as ``tools`` or ``enable_thinking``); token ids are used as they are."""
    if isinstance(prompt, str):
        use_template = chat_template and tokenizer.has_chat_template
        if not use_template:
            return tokenizer.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    elif len(prompt) == 0 or not isinstance(prompt[0], dict):
        return list(prompt)
    if not tokenizer.has_chat_template:
        raise UserError("a conversation needs a chat template, and this model's tokenizer has none")
    try:
        text = tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, **(template_options or {})
        )
    except Exception as e:  # the template's own checks (roles, order)
        raise UserError(f"the chat template refused the conversation ({e})") from None
    return tokenizer.encode(text, add_special_tokens=False)


def stream_steps(
    redrafter: ReDrafter,
    tokenizer,
    prompt: Union[str, Sequence[int]],
    max_tokens: int = 256,
    *,
    choose: Chooser = greedy,
    chat_template: bool = True,
    profile: Optional[StepProfile] = None,
    prompt_cache: Optional[PromptCache] = None,
    **draft,
) -> Iterator[StepResponse]:
    """Generate from one prompt, yielding a response per step. ``draft``:
    the fields of ``DraftSettings`` (beam_width, beam_length, max_nodes,
    lookup, lookup_length, lookup_max_ngram, datastore_beams,
    later_vocab, partial_beams, first_vocab).

    ``prompt_cache`` (``make_prompt_cache()``): the prompt starts from the
    longest prefix the cache shares with it, and the cache is kept holding
    the prompt and the tokens so far, for the next turn of a conversation."""
    prompt_ids = encode_prompt(tokenizer, prompt, chat_template)
    cached = prompt_cache.reusable(prompt_ids) if prompt_cache is not None else 0
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    running = generate_steps(
        redrafter,
        [prompt_ids],
        max_tokens=max_tokens,
        draft=DraftSettings(**draft),
        choose=choose,
        eos_token_ids=tokenizer.eos_token_ids,
        profile=profile,
        prompt_caches=None if prompt_cache is None else [prompt_cache],
    )
    tic = time.perf_counter()  # (after the cost curve, if it had to be measured)
    prompt_tps, generated, steps, step_tokens, step_nodes = 0.0, 0, 0, 0, 0
    for (out,) in running:
        if out.num_accepted is None:
            prompt_tps = (len(prompt_ids) - cached) / (time.perf_counter() - tic)
            tic = time.perf_counter()
        else:
            steps += 1
            step_tokens += out.num_accepted + 1
            step_nodes += out.num_nodes
        for token in out.tokens:
            detokenizer.add_token(token)
        if out.finish_reason:
            detokenizer.finalize()
        generated += len(out.tokens)
        elapsed = time.perf_counter() - tic
        yield StepResponse(
            text=detokenizer.last_segment,
            tokens=out.tokens,
            num_accepted=out.num_accepted,
            prompt_tokens=len(prompt_ids),
            prompt_tps=prompt_tps,
            generation_tokens=generated,
            generation_tps=generated / elapsed if elapsed > 0 and steps else 0.0,
            steps=steps,
            step_tokens=step_tokens,
            step_nodes=step_nodes,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=out.finish_reason,
            cached_tokens=cached,
        )


@dataclass
class BatchResult:
    """One prompt's result from :func:`batch_steps`."""

    text: str
    tokens: list
    prompt_tokens: int
    steps: int  # verification passes this prompt took part in
    step_tokens: int  # tokens those passes produced (accepted + bonus)
    step_nodes: int  # tree nodes those passes verified (the root included)
    finish_reason: Optional[str]
    seconds: float  # wall time of the batch it ran in

    @property
    def tokens_per_step(self) -> float:
        return self.step_tokens / self.steps if self.steps else 0.0


def batch_steps(
    redrafter: ReDrafter,
    tokenizer,
    prompts: Sequence[Union[str, Sequence[int]]],
    max_tokens: int = 256,
    *,
    batch_size: int = 8,
    choose: Chooser = greedy,
    chat_template: bool = True,
    **draft,
) -> list[BatchResult]:
    """Generate for many prompts, ``batch_size`` at a time (left-padded;
    rows advance by their own accepted lengths and leave the batch when they
    finish). Results come back in input order. Sampled, the prompt at index
    i of ``prompts`` draws with its own seed (``SamplingSettings``), whatever
    the batch size."""
    if batch_size < 1:
        raise UserError(f"batch size must be at least 1, got {batch_size}")
    encoded = [encode_prompt(tokenizer, p, chat_template) for p in prompts]
    results = []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        tokens = [[] for _ in chunk]
        steps, step_tokens, step_nodes = [0] * len(chunk), [0] * len(chunk), [0] * len(chunk)
        finish = [None] * len(chunk)
        running = generate_steps(
            redrafter,
            chunk,
            max_tokens=max_tokens,
            draft=DraftSettings(**draft),
            choose=choose,
            eos_token_ids=tokenizer.eos_token_ids,
            row_ids=range(start, start + len(chunk)),
        )
        tic = time.perf_counter()  # (after the cost curve, if it had to be measured)
        for outputs in running:
            for out in outputs:
                tokens[out.row] += out.tokens
                finish[out.row] = out.finish_reason
                if out.num_accepted is not None:
                    steps[out.row] += 1
                    step_tokens[out.row] += out.num_accepted + 1
                    step_nodes[out.row] += out.num_nodes
        seconds = time.perf_counter() - tic
        for i, ids in enumerate(tokens):
            results.append(
                BatchResult(
                    tokenizer.decode(ids),
                    ids,
                    len(chunk[i]),
                    steps[i],
                    step_tokens[i],
                    step_nodes[i],
                    finish[i],
                    seconds,
                )
            )
    return results
