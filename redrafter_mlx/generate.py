"""The ReDrafter generation loop.

One step: draft with the RNN's beam search, context lookup and the datastore, merge
the drafts into one prefix tree per row, keep the nodes worth their
verification cost, verify the tree in one forward pass of the base model,
accept the longest agreeing path plus a bonus token, and keep only that path
in the KV cache. The next step's beam search is built into the same lazy
graph, so each step has exactly one host synchronisation: reading the
accepted tokens and the next beams; the tree is then built on the host from
them and the row's context, and the accepted path's keys and values are
moved into place (only those out of place, lazily: the copy runs with the
next pass).
"""

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np

from .acceptance import accept
from .base_model import BaseModel
from .beam_search import beam_search
from .budget import AcceptanceStats
from .datastore import Datastore
from .drafter import Drafter
from .errors import UserError
from .cost import cost_curve
from .drafting import DraftSettings, Speculator
from .tree import Tree, pack
from .cache import CacheLayout, extend_batch

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
    acceptance: what this pair's runs so far had accepted, per draft source
    and depth; each run starts from it (``drafting.Speculator``).
    datastore: the drafter's datastore (``datastore.Datastore``), if it has one.
    """

    base: BaseModel
    drafter: Optional[Drafter]
    identity: str = ""
    drafter_identity: str = ""
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats, repr=False, compare=False)
    datastore: Optional[Datastore] = field(default=None, repr=False, compare=False)


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
    when each stops (EOS, which is not emitted, or its max_tokens).

    Prompts are named by the index ``add`` gives them (0, 1, ... in the order
    added). rows: the index of each active batch row, in batch order.
    context: per prompt, the prompt followed by its emitted tokens.
    ids: per prompt, its index in the caller's whole input list
    (``TokenHistory.rows``), which per-prompt sampling seeds follow.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], max_tokens: int, eos_token_ids: Sequence[int], rows=None, ids=None):
        self.eos = set(eos_token_ids)
        self.context, self.ids, self.produced, self.max_tokens = {}, {}, {}, {}
        self.added = 0
        for prompt, id in zip(prompts, range(len(prompts)) if ids is None else ids):
            self.add(prompt, max_tokens, id)
        self.rows = list(range(len(prompts))) if rows is None else list(rows)

    def add(self, prompt: Sequence[int], max_tokens: int, id: int) -> int:
        """Track one more prompt (not yet a batch row); returns its index."""
        index, self.added = self.added, self.added + 1
        self.context[index], self.ids[index] = list(prompt), id
        self.produced[index], self.max_tokens[index] = 0, max_tokens
        return index

    def forget(self, index: int) -> None:
        for table in (self.context, self.ids, self.produced, self.max_tokens):
            del table[index]

    def history(self, tree: Optional[Tree] = None, rows: Optional[list] = None) -> TokenHistory:
        rows = self.rows if rows is None else rows
        context = [self.context[r] for r in rows]
        ids = [self.ids[r] for r in rows]
        if tree is None:
            return TokenHistory(ids, context)
        return TokenHistory(ids, context, tree.tokens, tree.mask, tree.depths)

    def emit(self, tokens_per_row: list, num_accepted: Optional[list] = None, num_nodes: Optional[list] = None, rows: Optional[list] = None) -> list[StepOutput]:
        """Record each row's new tokens (rows: default the active rows), cut
        at EOS and max_tokens."""
        outputs = []
        for i, (row, tokens) in enumerate(zip(self.rows if rows is None else rows, tokens_per_row)):
            finish = None
            for j, token in enumerate(tokens):
                if token in self.eos:
                    tokens, finish = tokens[:j], "stop"
                    break
            room = self.max_tokens[row] - self.produced[row]
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
        done = {out.row for out in outputs if out.finish_reason is not None}
        return self.keep([r for r in self.rows if r not in done])

    def keep(self, rows: list) -> Optional[list[int]]:
        """Keep only these active rows (in batch order); returns the batch
        indices kept, or None when that is every row."""
        if len(rows) == len(self.rows):
            return None
        kept = set(rows)
        keep = [i for i, r in enumerate(self.rows) if r in kept]
        self.rows = [self.rows[i] for i in keep]
        return keep


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
        base.backbone(tokens[:, begin:end], cache=cache)
        layout.end_chunk(end - begin)
        mx.eval([c.state_arrays() for c in cache])
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
            c.keys, c.values = keys[..., :reused, :], values[..., :reused, :]
        layout.lengths[:] = reused
    tokens = mx.array([list(prompt[reused:])], mx.int32)
    return (layout, cache, *_feed(base, layout, cache, tokens, prefill_step_size))


class Decoder:
    """A running batch that prompts join and leave between steps.

    ``join`` prefills new prompts (from their prompt caches when given) and
    returns their first tokens; ``step`` verifies one tree per active row
    and returns what each row gained; rows that finished, or that ``leave``
    named, are out of the batch from the next step on. Prompts are named by
    the index ``join`` gives them (``StepOutput.row``): 0, 1, ... in the
    order they joined.

    choose sees ``TokenHistory.rows`` = the ids given to ``join``.
    cost_batch_sizes: batch sizes whose cost curves size the trees; a step
    of B rows uses the smallest one >= B (else the largest). Each is
    measured on first use and cached on disk (``cost.cost_curve``).
    """

    def __init__(
        self,
        redrafter: ReDrafter,
        draft: DraftSettings,
        choose: Chooser = greedy,
        eos_token_ids: Sequence[int] = (),
        *,
        prefill_step_size: int = PREFILL_STEP_SIZE,
        timing: Optional[StepTiming] = None,
        cost_batch_sizes: Sequence[int] = (1,),
    ):
        draft.check()
        self.redrafter, self.draft, self.choose = redrafter, draft, choose
        self.prefill_step_size, self.timing = prefill_step_size, timing
        self.cost_batch_sizes = sorted(cost_batch_sizes)
        self.costs = {}
        self.tracker = RowTracker([], 0, eos_token_ids)
        self.speculator = Speculator(draft, redrafter.drafter is not None, redrafter.acceptance, redrafter.datastore)
        self.layout = self.cache = self.rnn = None
        self.leaving = set()
        self.sync = _Sync(timing)

    @property
    def rows(self) -> list:
        """The prompts in the batch, in batch order."""
        return self.tracker.rows

    def _search(self, hidden: mx.array, first_tokens: mx.array):
        """The RNN's beams and their probabilities (lazy), when it runs."""
        shape = self.draft.search_shape(self.redrafter.drafter)
        beams, logprobs = beam_search(self.redrafter.drafter, self.redrafter.base.embed, hidden, first_tokens, *shape)
        return beams, mx.exp(logprobs)

    def cost(self, batch_size: int):
        """The cost curve a step of this many rows is sized by (None with a fixed max_nodes)."""
        if self.draft.max_nodes is not None:
            return None
        size = next((b for b in self.cost_batch_sizes if b >= batch_size), self.cost_batch_sizes[-1])
        if size not in self.costs:
            shape = self.draft.search_shape(self.redrafter.drafter) if self.redrafter.drafter else None
            self.costs[size] = cost_curve(self.redrafter, size, shape)
        return self.costs[size]

    def join(self, prompts: Sequence[Sequence[int]], max_tokens, ids: Optional[Sequence[int]] = None, prompt_caches=None) -> list[StepOutput]:
        """Prefill prompts and add them to the batch; returns each one's
        first token. max_tokens: one for all, or one per prompt. ids: each
        prompt's index in the caller's input list (default 0, 1, ...)."""
        base = self.redrafter.base
        check_prompts(base, prompts)
        limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        ids = list(range(len(prompts))) if ids is None else list(ids)
        for c in prompt_caches or ():
            if c is not None:
                c.check(self.redrafter.identity, base.num_layers)
        joining = [self.tracker.add(p, m, i) for p, m, i in zip(prompts, limits, ids)]
        for r in joining:
            self.speculator.track(r, self.tracker.context[r])
        layout, cache, hidden, logits = prefill(base, prompts, self.prefill_step_size, prompt_caches)
        first = self.choose(logits, self.tracker.history(rows=joining))[:, 0]
        # Joining a running batch, the new rows draft as the batch does.
        with_rnn = self.speculator.use_rnn() if self.layout is None else self.rnn is not None
        rnn = self._search(hidden, first) if with_rnn else None
        self.sync("prefill", first, rnn, [c.state_arrays() for c in cache])
        rnn = None if rnn is None else [np.array(a) for a in rnn]
        if self.layout is None:
            self.layout, self.cache, self.rnn = layout, cache, rnn
        else:
            extend_batch(self.layout, self.cache, layout, cache)
            if self.rnn is not None:
                self.rnn = [np.concatenate([a, b]) for a, b in zip(self.rnn, rnn)]
        self.tracker.rows += joining
        return self._finished(self.tracker.emit([[t] for t in np.array(first).tolist()], rows=joining))

    def leave(self, rows: Sequence[int]) -> None:
        """Take prompts out of the batch before the next step."""
        self.leaving.update(rows)

    def _finished(self, outputs: list[StepOutput]) -> list[StepOutput]:
        self.leaving.update(out.row for out in outputs if out.finish_reason is not None)
        return outputs

    def _drop_leaving(self) -> None:
        if not self.leaving:
            return
        gone = [r for r in self.tracker.rows if r in self.leaving]
        keep = self.tracker.keep([r for r in self.tracker.rows if r not in self.leaving])
        self.leaving = set()
        for r in gone:
            self.tracker.forget(r)
            self.speculator.drop(r)
        if keep is None:
            return
        if not keep:
            self.layout = self.cache = self.rnn = None
            return
        trim = self.layout.filter(keep)
        for c in self.cache:
            c.filter(mx.array(keep), trim)
        self.rnn = None if self.rnn is None else [a[keep] for a in self.rnn]

    def prompt_cache(self, row: int) -> tuple[list, list, list]:
        """(tokens, keys, values) the batch holds for one prompt: its
        context as far as its keys and values are committed (views of the
        batch's buffers); valid until the next step."""
        b = self.tracker.rows.index(row)
        pad = int(self.layout.left_padding[b])
        context = self.tracker.context[row]
        length = min(len(context), int(self.layout.lengths[b]) - pad)
        kv = [c.rows_kv(b, pad, pad + length) for c in self.cache]
        return context[:length], [k for k, _ in kv], [v for _, v in kv]

    def step(self) -> list[StepOutput]:
        """One verification step for every active row (none: returns [])."""
        self._drop_leaving()
        tracker, base = self.tracker, self.redrafter.base
        if not tracker.rows:
            return []
        roots = [tracker.context[r][-1] for r in tracker.rows]
        trees = self.speculator.trees(tracker.rows, roots, *(self.rnn or (None, None)), cost=self.cost(len(roots)))
        tree = pack(trees)
        self.sync("host")

        self.layout.begin_tree(tree.depths, tree.mask)
        hidden, logits = base(tree.tokens, self.cache)
        self.sync("verification", hidden, logits)
        choices = self.choose(logits, tracker.history(tree))
        step = accept(tree.beams, tree.unpack, choices, hidden)
        self.sync("acceptance", step.tokens, step.path)
        rnn = self._search(step.next_hidden, step.next_token) if self.speculator.use_rnn() else None
        self.sync("drafting", step.num_accepted, step.tokens, step.path, rnn, [c.state_arrays() for c in self.cache])
        self.rnn = None if rnn is None else [np.array(a) for a in rnn]

        num_accepted, path = np.array(step.num_accepted), np.array(step.path)
        # Known on the host now: only what was accepted, and only what is out
        # of place, is copied (lazily, evaluated with the next pass).
        for c in self.cache:
            c.commit_path(path, num_accepted)
        self.sync("acceptance", [c.state_arrays() for c in self.cache])
        self.speculator.observe(trees, path, num_accepted)
        self.layout.commit(num_accepted + 1)
        tokens = np.array(step.tokens)
        outputs = tracker.emit(
            [tokens[i, : n + 1].tolist() for i, n in enumerate(num_accepted)], num_accepted.tolist(), tree.num_nodes
        )
        if self.timing is not None:
            self.timing.steps += 1
        return self._finished(outputs)


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
    prompt_caches: Optional[Sequence] = None,
    **draft_options,
) -> Iterator[list[StepOutput]]:
    """Generate for a batch of tokenized prompts; yields, after the prefill
    and after each verification step, one ``StepOutput`` per active row.
    Rows that finish leave the batch. ``row_ids`` give each prompt's index in
    the caller's whole input list (default 0, 1, ...): ``choose`` sees them,
    so a prompt's sampling seed does not depend on the batch it runs in.

    ``draft`` says what each step verifies (``DraftSettings``); its fields
    may be given as keywords instead (``beam_width=4``, ``lookup=False``).

    ``prompt_caches``: a ``PromptCache`` (or None) per prompt. A prompt
    starts from the longest prefix its cache shares with it, and before each
    yield its cache is set to the prompt and tokens so far, as far as their
    keys and values are computed (the last token's are not yet).

    With ``timing`` given, phases are synchronised separately and their
    seconds added to it (for benchmarks; it costs extra syncs).
    """
    draft = draft or DraftSettings(**draft_options)
    check_settings(max_tokens, draft)
    check_prompts(redrafter.base, prompts)
    if max_tokens == 0:
        return
    decoder = Decoder(
        redrafter, draft, choose, eos_token_ids,
        prefill_step_size=prefill_step_size, timing=timing, cost_batch_sizes=(len(prompts),),
    )
    outputs = decoder.join(prompts, max_tokens, row_ids, prompt_caches)
    while outputs:
        if prompt_caches is not None:
            for out in outputs:
                if prompt_caches[out.row] is not None:
                    prompt_caches[out.row].set(*decoder.prompt_cache(out.row), redrafter.identity)
        yield outputs
        outputs = decoder.step()


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
