"""The ReDrafter generation loop.

One step: draft with the RNN's beam search and with context lookup, merge
the drafts into one prefix tree per row, keep the nodes worth their
verification cost, verify the tree in one forward pass of the base model,
accept the longest agreeing path plus a bonus token, and keep only that path
in the KV cache. The next step's beam search is built into the same lazy
graph, so each step has exactly one host synchronisation: reading the
accepted tokens and the next beams; the tree is then built on the host from
them and the row's context.
"""

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np

from .acceptance import accept
from .base_model import BaseModel
from .beam_search import beam_search
from .drafter import Drafter
from .errors import UserError
from .cost import cost_curve
from .drafting import DraftSettings, Speculator
from .tree import Tree, pack

PREFILL_STEP_SIZE = 2048

# choose(logits (B, N, vocab), histories) -> (B, N) token ids; histories gives
# each row's context and each node's ancestors for history-dependent processors.
Chooser = Callable[[mx.array, "TokenHistory"], mx.array]


def greedy(logits: mx.array, history: "TokenHistory") -> mx.array:
    return mx.argmax(logits, axis=-1)


@dataclass
class ReDrafter:
    """A base model and its drafter (None: context lookup only).

    identity, drafter_identity: digests naming the exact model and drafter
    (``loading.model_identity``), which key the cached cost curves.
    """

    base: BaseModel
    drafter: Optional[Drafter]
    identity: str = ""
    drafter_identity: str = ""


@dataclass
class TokenHistory:
    """What a node's token choice may depend on besides its logits.

    rows: per batch row, the index of its prompt in the input list.
    context: per row, the prompt and all tokens committed so far (host lists).
    node_tokens: (B, N) tokens of the nodes being scored (None at prefill).
    node_mask: (B, N, N) ancestor-or-self mask of those nodes (None at prefill).
    node_depths: (B, N) their depths; the root is the context's last token.
    """

    rows: list
    context: list
    node_tokens: Optional[mx.array] = None
    node_mask: Optional[mx.array] = None
    node_depths: Optional[mx.array] = None


@dataclass
class StepOutput:
    """What one step (or the prefill) produced for one row.

    row: index of the prompt in the input list.
    tokens: new token ids, already cut at EOS (which is not included) and
        at max_tokens.
    num_accepted: drafted tokens the base model accepted in this step (None
        for the first token, which comes from the prefill).
    finish_reason: None while the row goes on, else "stop" or "length".
    hidden: (len(tokens), hidden_size) float16, the base model's hidden state
        from which each token was chosen; only when asked for.
    num_nodes: tree nodes this step verified for the row, the root included
        (None for the first token).
    """

    row: int
    tokens: list
    num_accepted: Optional[int]
    finish_reason: Optional[str] = None
    hidden: Optional[np.ndarray] = None
    num_nodes: Optional[int] = None


@dataclass
class StepTiming:
    """Seconds spent per phase when ``profile=True`` (extra syncs)."""

    prefill: float = 0.0
    host: float = 0.0  # context lookup, tree building and pruning
    drafting: float = 0.0
    verification: float = 0.0
    acceptance: float = 0.0
    steps: int = 0


def check_settings(max_tokens: int, draft: DraftSettings) -> None:
    draft.check()
    if max_tokens < 0:
        raise UserError(f"max tokens must be at least 0, got {max_tokens}")


class RowTracker:
    """Which prompts of a batch are still generating, what each produced, and
    when each stops (EOS, which is not emitted, or max_tokens).

    rows: input index of each active batch row, in batch order.
    context: per input prompt, the prompt followed by its emitted tokens.
    ids: per input prompt, its index in the caller's whole input list
        (``TokenHistory.rows``), which per-prompt sampling seeds follow.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], max_tokens: int, eos_token_ids: Sequence[int], rows=None, ids=None):
        self.rows = list(range(len(prompts))) if rows is None else list(rows)
        self.ids = list(range(len(prompts))) if ids is None else list(ids)
        self.context = [list(p) for p in prompts]
        self.produced = [0] * len(prompts)
        self.max_tokens = max_tokens
        self.eos = set(eos_token_ids)

    def history(self, tree: Optional[Tree] = None) -> TokenHistory:
        context = [self.context[r] for r in self.rows]
        ids = [self.ids[r] for r in self.rows]
        if tree is None:
            return TokenHistory(ids, context)
        return TokenHistory(ids, context, tree.tokens, tree.mask, tree.depths)

    def emit(self, tokens_per_row: list, num_accepted: Optional[list] = None, num_nodes: Optional[list] = None) -> list[StepOutput]:
        """Record each active row's new tokens, cut at EOS and max_tokens."""
        outputs = []
        for i, tokens in enumerate(tokens_per_row):
            row, finish = self.rows[i], None
            for j, token in enumerate(tokens):
                if token in self.eos:
                    tokens, finish = tokens[:j], "stop"
                    break
            room = self.max_tokens - self.produced[row]
            if len(tokens) >= room:
                tokens, finish = tokens[:room], finish or "length"
            self.context[row].extend(tokens)
            self.produced[row] += len(tokens)
            accepted = None if num_accepted is None else num_accepted[i]
            nodes = None if num_nodes is None else num_nodes[i]
            outputs.append(StepOutput(row, tokens, accepted, finish, num_nodes=nodes))
        return outputs

    def keep_unfinished(self, outputs: list[StepOutput]) -> Optional[list[int]]:
        """Drop finished rows; returns the batch indices kept, or None when
        every row goes on."""
        keep = [i for i, out in enumerate(outputs) if out.finish_reason is None]
        if len(keep) == len(self.rows):
            return None
        self.rows = [self.rows[i] for i in keep]
        return keep


def check_prompts(base: BaseModel, prompts: Sequence[Sequence[int]]) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    if base.max_context and longest >= base.max_context:
        raise UserError(
            f"prompt of {longest} tokens does not fit the model's context of "
            f"{base.max_context} tokens"
        )


def prefill(base: BaseModel, prompts: Sequence[Sequence[int]], prefill_step_size: int = PREFILL_STEP_SIZE):
    """Feed the left-padded prompts: all but the last token in chunks, then
    the last token alone, the way mlx-lm's generation loop does it.

    Returns (layout, cache, hidden (B, hidden_size), logits (B, 1, vocab)) at
    the last prompt token.
    """
    longest = max(len(p) for p in prompts)
    left_padding = [longest - len(p) for p in prompts]
    padded = mx.array([[0] * pad + list(p) for pad, p in zip(left_padding, prompts)], mx.int32)
    layout, cache = base.make_cache(left_padding)
    for begin in range(0, longest - 1, prefill_step_size):
        end = min(begin + prefill_step_size, longest - 1)
        layout.begin_chunk()
        base.backbone(padded[:, begin:end], cache=cache)
        layout.end_chunk(end - begin)
        mx.eval([c.state_arrays() for c in cache])
    layout.begin_chunk()
    hidden, logits = base(padded[:, -1:], cache)
    layout.end_chunk(1)
    return layout, cache, hidden[:, -1], logits


def generate_steps(
    redrafter: ReDrafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 256,
    draft: Optional[DraftSettings] = None,
    choose: Chooser = greedy,
    eos_token_ids: Sequence[int] = (),
    prefill_step_size: int = PREFILL_STEP_SIZE,
    timing: Optional[StepTiming] = None,
    row_ids: Optional[Sequence[int]] = None,
    **draft_options,
) -> Iterator[list[StepOutput]]:
    """Generate for a batch of tokenized prompts; yields, after the prefill
    and after each verification step, one ``StepOutput`` per active row.
    Rows that finish leave the batch. ``row_ids`` give each prompt's index in
    the caller's whole input list (default 0, 1, ...): ``choose`` sees them,
    so a prompt's sampling seed does not depend on the batch it runs in.

    ``draft`` says what each step verifies (``DraftSettings``); its fields
    may be given as keywords instead (``beam_width=4``, ``lookup=False``).

    With ``timing`` given, phases are synchronised separately and their
    seconds added to it (for benchmarks; it costs extra syncs).
    """
    draft = draft or DraftSettings(**draft_options)
    check_settings(max_tokens, draft)
    base, drafter = redrafter.base, redrafter.drafter
    check_prompts(base, prompts)
    if max_tokens == 0:
        return
    tracker = RowTracker(prompts, max_tokens, eos_token_ids, ids=row_ids)
    shape = (draft.beam_width, draft.beam_length)
    cost = cost_curve(redrafter, len(prompts), shape if drafter else None) if draft.max_nodes is None else None
    speculator = Speculator(draft, drafter is not None, tracker.context, cost)
    sync = _Sync(timing)

    def search(hidden, first_tokens):
        if not speculator.use_rnn():
            return None
        beams, logprobs = beam_search(drafter, base.embed, hidden, first_tokens, *shape)
        return beams, mx.exp(logprobs)

    layout, cache, hidden, logits = prefill(base, prompts, prefill_step_size)
    next_token = choose(logits, tracker.history())[:, 0]
    rnn = search(hidden, next_token)
    sync("prefill", next_token, rnn, [c.state_arrays() for c in cache])
    rnn = None if rnn is None else [np.array(a) for a in rnn]
    outputs = tracker.emit([[t] for t in np.array(next_token).tolist()])
    yield outputs

    while True:
        keep = tracker.keep_unfinished(outputs)
        if keep is not None:
            if not keep:
                return
            trim = layout.filter(keep)
            for c in cache:
                c.filter(mx.array(keep), trim)
            rnn = None if rnn is None else [a[keep] for a in rnn]
        roots = [tracker.context[r][-1] for r in tracker.rows]
        trees = speculator.trees(tracker.rows, roots, *(rnn or (None, None)))
        tree = pack(trees)
        sync("host")

        layout.begin_tree(tree.depths, tree.mask)
        hidden, logits = base(tree.tokens, cache)
        sync("verification", hidden, logits)
        choices = choose(logits, tracker.history(tree))
        step = accept(tree.beams, tree.unpack, choices, hidden)
        for c in cache:
            c.commit_path(step.path)
        sync("acceptance", step.tokens, [c.state_arrays() for c in cache])
        rnn = search(step.next_hidden, step.next_token)
        sync("drafting", step.num_accepted, step.tokens, step.path, rnn, [c.state_arrays() for c in cache])
        rnn = None if rnn is None else [np.array(a) for a in rnn]

        num_accepted = np.array(step.num_accepted)
        speculator.observe(trees, np.array(step.path), num_accepted)
        layout.commit(num_accepted + 1)
        tokens = np.array(step.tokens)
        outputs = tracker.emit(
            [tokens[i, : n + 1].tolist() for i, n in enumerate(num_accepted)], num_accepted.tolist(), tree.num_nodes
        )
        if timing is not None:
            timing.steps += 1
        yield outputs


class _Sync:
    """Evaluates at the end of the step, or after every phase when timing."""

    def __init__(self, timing: Optional[StepTiming]):
        self.timing = timing
        self.last = time.perf_counter()

    def __call__(self, phase: str, *arrays) -> None:
        if self.timing is None and phase not in ("prefill", "drafting"):
            return
        mx.eval(*arrays)
        if self.timing is not None:
            now = time.perf_counter()
            setattr(self.timing, phase, getattr(self.timing, phase) + now - self.last)
            self.last = now
