"""The ReDrafter generation loop.

One step: draft with the RNN's beam search, context lookup and the datastore,
merge the drafts into one prefix tree per row, keep the nodes worth their
verification cost, verify the tree in one forward pass of the base model,
accept the longest agreeing path plus a bonus token, and keep only that path
in the KV cache. The next step's beam search is built into the same lazy
graph, so each step has exactly one host synchronisation: reading the
accepted tokens and the next beams; the tree is then built on the host from
them and the row's context, and the accepted path's keys and values are
moved into place (only those out of place, lazily: the copy runs with the
next pass).
"""

from typing import Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..drafting.beam_search import beam_search
from ..drafting.settings import DraftSettings
from ..drafting.speculator import Speculator
from ..drafting.tree import pack
from ..errors import UserError
from . import calibrate
from .acceptance import accept
from .cache import extend_batch
from .prefill import PREFILL_STEP_SIZE, check_prompts, prefill
from .profile import StepProfile
from .rows import RowTracker
from .sampling import greedy
from .types import Chooser, ReDrafter, StepOutput


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
    measured on first use and cached on disk (``calibrate.cost_curve``).
    profile: a ``StepProfile`` to time each phase (extra synchronisations).
    """

    def __init__(
        self,
        redrafter: ReDrafter,
        draft: DraftSettings,
        choose: Chooser = greedy,
        eos_token_ids: Sequence[int] = (),
        *,
        prefill_step_size: int = PREFILL_STEP_SIZE,
        profile: Optional[StepProfile] = None,
        cost_batch_sizes: Sequence[int] = (1,),
    ):
        self.redrafter, self.draft, self.choose = redrafter, draft, choose
        self.prefill_step_size, self.profile = prefill_step_size, profile
        self.cost_batch_sizes = sorted(cost_batch_sizes)
        self.costs = {}
        self.tracker = RowTracker([], 0, eos_token_ids)
        self.speculator = Speculator(draft, redrafter.drafter is not None, redrafter.acceptance, redrafter.datastore)
        self.layout = self.cache = self.rnn = None
        self.leaving = set()

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
            self.costs[size] = calibrate.cost_curve(self.redrafter, size, shape)
        return self.costs[size]

    def join(self, prompts: Sequence[Sequence[int]], max_tokens, ids: Optional[Sequence[int]] = None, prompt_caches=None) -> list[StepOutput]:
        """Prefill prompts and add them to the batch; returns each one's
        first token. max_tokens: one for all, or one per prompt. ids: each
        prompt's index in the caller's input list (default 0, 1, ...)."""
        base = self.redrafter.base
        if self.profile is not None:
            self.profile.restart()
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
        mx.eval(first, rnn, [c.state_arrays() for c in cache])
        if self.profile is not None:
            self.profile.lap("prefill")
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
        tracker, base, profile = self.tracker, self.redrafter.base, self.profile
        if not tracker.rows:
            return []
        roots = [tracker.context[r][-1] for r in tracker.rows]
        trees = self.speculator.trees(tracker.rows, roots, *(self.rnn or (None, None)), cost=self.cost(len(roots)))
        tree = pack(trees)
        if profile is not None:
            profile.lap("host")

        self.layout.begin_tree(tree.depths, tree.mask)
        hidden, logits = base(tree.tokens, self.cache)
        if profile is not None:
            profile.lap("verification", hidden, logits)
        choices = self.choose(logits, tracker.history(tree))
        step = accept(tree.beams, tree.unpack, choices, hidden)
        if profile is not None:
            profile.lap("acceptance", step.tokens, step.path)
        rnn = self._search(step.next_hidden, step.next_token) if self.speculator.use_rnn() else None
        # The step's one host synchronisation: what was accepted, and the
        # next step's beams, drafted from where this step's path ends.
        mx.eval(step.num_accepted, step.tokens, step.path, rnn, [c.state_arrays() for c in self.cache])
        if profile is not None:
            profile.lap("drafting")
        self.rnn = None if rnn is None else [np.array(a) for a in rnn]

        num_accepted, path = np.array(step.num_accepted), np.array(step.path)
        # Known on the host now: only what was accepted, and only what is out
        # of place, is copied (lazily, evaluated with the next pass).
        for c in self.cache:
            c.commit_path(path, num_accepted)
        if profile is not None:
            profile.lap("commit", [c.state_arrays() for c in self.cache])
            profile.steps += 1
        self.speculator.observe(trees, path, num_accepted)
        self.layout.commit(num_accepted + 1)
        tokens = np.array(step.tokens)
        outputs = tracker.emit(
            [tokens[i, : n + 1].tolist() for i, n in enumerate(num_accepted)], num_accepted.tolist(), tree.num_nodes
        )
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
    profile: Optional[StepProfile] = None,
    row_ids: Optional[Sequence[int]] = None,
    prompt_caches: Optional[Sequence] = None,
) -> Iterator[list[StepOutput]]:
    """Generate for a batch of tokenized prompts; yields, after the prefill
    and after each verification step, one ``StepOutput`` per active row.
    Rows that finish leave the batch. ``row_ids`` give each prompt's index in
    the caller's whole input list (default 0, 1, ...): ``choose`` sees them,
    so a prompt's sampling seed does not depend on the batch it runs in.

    ``draft`` says what each step verifies (default ``DraftSettings()``).

    ``prompt_caches``: a ``PromptCache`` (or None) per prompt. A prompt
    starts from the longest prefix its cache shares with it, and before each
    yield its cache is set to the prompt and tokens so far, as far as their
    keys and values are computed (the last token's are not yet).

    ``profile``: a ``StepProfile`` that each phase's seconds are added to
    (for benchmarks; it costs extra synchronisations).
    """
    if max_tokens < 0:
        raise UserError(f"max tokens must be at least 0, got {max_tokens}")
    if max_tokens == 0:
        check_prompts(redrafter.base, prompts)
        return
    decoder = Decoder(
        redrafter, draft or DraftSettings(), choose, eos_token_ids,
        prefill_step_size=prefill_step_size, profile=profile, cost_batch_sizes=(len(prompts),),
    )
    outputs = decoder.join(prompts, max_tokens, row_ids, prompt_caches)
    while outputs:
        if prompt_caches is not None:
            for out in outputs:
                if prompt_caches[out.row] is not None:
                    prompt_caches[out.row].set(*decoder.prompt_cache(out.row), redrafter.identity)
        yield outputs
        outputs = decoder.step()
