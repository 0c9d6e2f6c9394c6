"""The ReDrafter generation loop.

One step: draft with the RNN's beam search, context lookup and the datastore,
merge the drafts into one prefix tree per row, keep the nodes worth their
verification cost, verify the tree in one forward pass of the base model,
accept the longest agreeing path plus a bonus token, and keep only that path
in the KV cache. Each step has one host synchronisation: reading what was
accepted. The next step's beam search, drafted from where the accepted path
ends, is then issued at once and runs while the host moves the accepted
path's keys and values into place (only those out of place, lazily: the
copy runs with the next pass) and makes the next step's cheap drafts; the
next tree reads the beams last.

What a step does is the speculator's ``Plan`` (``drafting.speculator``);
``Decoder.step`` only carries it out: plan, then (a tree step) verify the
trees, accept each row's path, search the next beams and commit the path. A plain step (nothing drafted) is
pipelined as mlx-lm pipelines its loop: the pass that feeds this step's
token is built and started before this step's token is read, so that the
host's work overlaps the device's, and it does no other work per token:
while rows stay aligned it is the same chunk of one token, with the same
positions and no mask, that mlx-lm's own loop feeds.
"""

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from ..drafting.beam_search import beam_search
from ..drafting.cost import CostCurve
from ..drafting.settings import DraftSettings
from ..drafting.speculator import Beams, Plan, Speculator
from ..drafting.tree import pack
from ..errors import UserError
from .acceptance import accept
from .cache import extend_batch
from .costs import StepCosts
from .prefill import PREFILL_STEP_SIZE, Prefill, check_prompts
from .profile import NO_PROFILE, StepProfile
from .rows import RowTracker
from .sampling import greedy
from .types import Chooser, ReDrafter, StepOutput, TokenHistory


class PlainPass(NamedTuple):
    """One plain pass's results for the rows in batch order, lazy: token
    (B,) the chosen tokens; hidden (B, hidden_size) the hidden states they
    were chosen from; logprobs the chooser's (chosen, top ids, top
    log-probabilities) arrays, or None; distributions (B, 1, vocab) what
    the tokens were chosen from, when the chooser keeps them."""

    token: mx.array
    hidden: mx.array
    logprobs: Optional[tuple]
    distributions: Optional[mx.array] = None

    def rows(self, keep: mx.array) -> "PlainPass":
        """The rows ``keep`` (indices), in that order."""
        return PlainPass(
            self.token[keep],
            self.hidden[keep],
            None if self.logprobs is None else tuple(a[keep] for a in self.logprobs),
            None if self.distributions is None else self.distributions[keep],
        )


@dataclass
class Joining:
    """Prompts on their way into the batch (``Decoder.begin_join``): their
    token limits, the caller's ids for them, and their prefill so far."""

    prompts: list
    limits: list
    ids: list
    prefill: Prefill


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
    of B rows uses the smallest one >= B (else the largest). Steps are
    sized by ``costs`` (``costs.StepCosts``): the measured curve, kept true
    by what the steps themselves cost. cost_curve: one ``CostCurve`` for
    every batch size and context, used as it is (tests).
    profile: a ``StepProfile`` to time each phase (extra synchronisations).
    with_hidden: each output of a plain step (and of ``join``) carries the
    hidden state its token was chosen from (``StepOutput.hidden``;
    distillation, which decodes plainly).
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
        cost_curve=None,
        with_hidden: bool = False,
    ):
        self.redrafter, self.draft, self.choose = redrafter, draft, choose
        self.prefill_step_size, self.with_hidden = prefill_step_size, with_hidden
        self.profile = NO_PROFILE if profile is None else profile
        self.speculator = Speculator(
            draft,
            redrafter.drafter is not None,
            redrafter.acceptance,
            redrafter.datastore,
            redrafter.answers,
            chains=redrafter.base.recurrent,
        )
        shape = draft.search_shape(redrafter.drafter) if redrafter.drafter is not None else None
        self.costs = StepCosts(
            redrafter, cost_batch_sizes, shape, cost_curve, sized=not self.speculator.forced, step_costs=fixed_costs
        )
        self.tracker = RowTracker([], 0, eos_token_ids)
        self.layout = self.cache = None
        self.beams: Optional[Beams] = None  # the RNN's beams for the next step (None: it did not search)
        self.leaving = set()
        self.ahead: Optional[PlainPass] = None  # a plain pass issued ahead (its fed tokens are committed)
        self.constants: dict = {}  # (batch size, ahead) -> a plain pass's depths and mask

    @property
    def rows(self) -> list:
        """The prompts in the batch, in batch order."""
        return self.tracker.rows

    def _search(self, hidden: mx.array, first_tokens: mx.array, length: int = 0) -> Beams:
        """The RNN's beams and their probabilities (lazy), ``length`` long
        (the root included; 0: the settings' beam length)."""
        width, full, later, partial, first = self.draft.search_shape(self.redrafter.drafter)
        beams, logprobs = beam_search(
            self.redrafter.drafter,
            self.redrafter.base.embed,
            hidden,
            first_tokens,
            width,
            length or full,
            later,
            partial,
            first,
        )
        return Beams(beams, mx.exp(logprobs))

    def join(
        self, prompts: Sequence[Sequence[int]], max_tokens, ids: Optional[Sequence[int]] = None, prompt_caches=None
    ) -> list[StepOutput]:
        """Prefill prompts and add them to the batch; returns each one's
        first token, in order and last (before them: the tokens of running
        rows whose plain pass had run ahead). max_tokens: one for all, or one per prompt.
        ids: each prompt's index in the caller's input list (default 0, 1, ...)."""
        return self.finish_join(self.begin_join(prompts, max_tokens, ids, prompt_caches))

    def begin_join(
        self, prompts: Sequence[Sequence[int]], max_tokens, ids: Optional[Sequence[int]] = None, prompt_caches=None
    ) -> Joining:
        """``join`` in two halves, with the batch's steps between them: the
        prompts are checked here, their prefill runs a chunk at a time
        (``Joining.prefill.advance``) while the running rows step, and
        ``finish_join`` feeds the rest and adds them to the batch."""
        base = self.redrafter.base
        check_prompts(base, prompts)
        limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        ids = list(range(len(prompts))) if ids is None else list(ids)
        for c in prompt_caches or ():
            if c is not None:
                c.check(self.redrafter.identity, base.num_layers)
        return Joining(list(prompts), limits, ids, Prefill(base, prompts, self.prefill_step_size, prompt_caches))

    def finish_join(self, coming: Joining) -> list[StepOutput]:
        """The second half of ``join``: returns what ``join`` returns."""
        self.profile.restart()
        ready = self._resolve_ahead()
        staying = sum(r not in self.leaving for r in self.tracker.rows)
        # What can pay on this curve is known before the first search,
        # which runs now when the RNN drafts.
        cost = self.costs.curve(staying + len(coming.prompts), max(map(len, coming.prompts)))
        joining = [self.tracker.add(p, m, i) for p, m, i in zip(coming.prompts, coming.limits, coming.ids)]
        plan = self.speculator.plan_join(
            joining,
            [self.tracker.context[r] for r in joining],
            [self.choose.is_sampled(i) for i in coming.ids],
            cost,
            running=self.layout is not None,
            beams=self.beams,
        )
        layout, cache, hidden, logits = coming.prefill.finish()
        first, logprobs, distributions = self._choose(logits, self.tracker.history(rows=joining))
        first = first[:, 0]
        beams = self._search(hidden, first, plan.search_length) if plan.search else None
        hidden_rows = hidden.astype(mx.float16) if self.with_hidden else None
        mx.eval(first, beams, logprobs, hidden_rows, [c.state_arrays() for c in cache])
        self.profile.lap("prefill")
        _, (first, beams) = self._settle(None, (np.array(first), host_beams(beams)))
        self._add_rows(joining, layout, cache, beams)
        at_root = np.zeros((len(joining), 1), np.int64)
        outputs = self.tracker.emit(
            [[t] for t in first.tolist()],
            rows=joining,
            logprobs=logprob_lists(logprobs, at_root),
            distributions=distribution_rows(distributions, at_root),
        )
        self._attach_hidden(outputs, hidden_rows, joining)
        return ready + self._finished(outputs)

    def _add_rows(self, rows: list, layout, cache: list, beams: Optional[Beams]) -> None:
        """Prefilled prompts join the batch as ``rows``: their layout, cache
        and first beams after the running rows'."""
        if self.layout is None:
            self.layout, self.cache, self.beams = layout, cache, beams
        else:
            extend_batch(self.layout, self.cache, layout, cache)
            if self.beams is not None:
                self.beams = self.beams.joined(beams)
        self.tracker.rows += rows

    def leave(self, rows: Sequence[int]) -> None:
        """Take prompts out of the batch before the next step."""
        self.leaving.update(rows)

    def _finished(self, outputs: list[StepOutput]) -> list[StepOutput]:
        self.leaving.update(out.row for out in outputs if out.finish_reason is not None)
        return outputs

    def _attach_hidden(self, outputs: list[StepOutput], hidden_rows, rows: list) -> None:
        """With ``with_hidden``: each output's hidden state, from
        ``hidden_rows`` (B, hidden_size) of the batch ``rows``."""
        if hidden_rows is None:
            return
        hidden_rows = np.array(hidden_rows)
        index = {r: i for i, r in enumerate(rows)}
        for out in outputs:
            i = index[out.row]
            out.hidden = hidden_rows[i : i + 1][: len(out.tokens)]

    def _drop_leaving(self) -> None:
        if not self.leaving:
            return
        gone = [r for r in self.tracker.rows if r in self.leaving]
        keep = self.tracker.keep([r for r in self.tracker.rows if r not in self.leaving])
        self.leaving = set()
        for r in gone:
            if self.redrafter.answers is not None and self.tracker.produced[r]:
                self.redrafter.answers.add(self.tracker.context[r][-self.tracker.produced[r] :])
            self.tracker.forget(r)
            self.speculator.drop(r)
        if keep is None:
            return
        if not keep:
            self.layout = self.cache = self.beams = self.ahead = None
            return
        trim = self.layout.filter(keep)
        for c in self.cache:
            c.filter(mx.array(keep), trim)
        self.beams = None if self.beams is None else self.beams.rows(keep)
        self.ahead = None if self.ahead is None else self.ahead.rows(mx.array(keep))

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
        """One step for every active row: the speculator plans it, and the
        plan is carried out: a tree verified, or a plain token (none:
        returns [])."""
        self._drop_leaving()
        tracker = self.tracker
        if not tracker.rows:
            return []
        cost = self.costs.curve(len(tracker.rows), self.layout.start)  # (the keys this step's pass reads)
        tic = time.perf_counter()
        roots = [tracker.context[r][-1] for r in tracker.rows]
        may_run_ahead = (
            not self.choose.reads_tokens and not self.profile.enabled and not self.redrafter.base.ranks.several
        )
        plan = self.speculator.plan(
            tracker.rows, roots, self.beams, cost=cost, ahead=self.ahead is not None, may_run_ahead=may_run_ahead
        )
        outputs = self._plain_step(plan, roots, tic) if plan.mode == "plain" else self._tree_step(plan, tic)
        self.costs.step_returned()
        return self._finished(outputs)

    def _tree_step(self, plan: Plan, tic: float) -> list[StepOutput]:
        """Verify the plan's trees, accept each row's longest agreeing path,
        search the next step's beams from where it ends (in the same graph)
        and commit the path."""
        tracker, profile = self.tracker, self.profile
        profile.lap("host")
        tree, hidden, logits = self._verify(plan.trees)
        step, logprobs, distributions = self._accept(tree, hidden, logits)
        beams = self._search(step.next_hidden, step.next_token, plan.search_length) if plan.search else None
        beams = self._synchronise(
            [step.num_accepted, step.tokens, step.path, logprobs, [c.state_arrays() for c in self.cache]], beams
        )
        seconds, (num_accepted, path, tokens, self.beams) = self._settle(
            tic, (np.array(step.num_accepted), np.array(step.path), np.array(step.tokens), beams)
        )
        # Known on the host now: only what was accepted, and only what is out
        # of place, is copied (lazily, evaluated with the next pass).
        for c in self.cache:
            c.commit_path(path, num_accepted)
        profile.lap("commit", [c.state_arrays() for c in self.cache])
        self.speculator.observe(plan.trees, path, num_accepted)
        self.costs.observe(len(tracker.rows), self.layout.start, max(tree.num_nodes), seconds, plan.search)
        self.layout.commit(num_accepted + 1)
        outputs = tracker.emit(
            [tokens[i, : n + 1].tolist() for i, n in enumerate(num_accepted)],
            num_accepted.tolist(),
            tree.num_nodes,
            logprobs=logprob_lists(logprobs, path),
            distributions=distribution_rows(distributions, path, num_accepted + 1),
        )
        profile.lap("host")
        profile.count_step()
        return outputs

    def _verify(self, trees: tuple):
        """The base model's pass over the rows' trees, packed: (the packed
        ``Tree``, hidden (B, N, hidden_size), logits (B, N, vocab)), lazy."""
        tree = pack(trees)
        self.layout.begin_tree(tree.depths, tree.mask)
        self.profile.lap("packing", tree.tokens, tree.depths, tree.mask, tree.beams, tree.unpack)
        hidden, logits = self.redrafter.base(tree.tokens, self.cache)
        self.profile.lap("pass", hidden, logits)
        return tree, hidden, logits

    def _accept(self, tree, hidden: mx.array, logits: mx.array):
        """The choice at every node and each row's longest path that agrees
        with it: (``accept``'s step, log-probability arrays or None, the
        nodes' distributions or None), lazy."""
        choices, logprobs, distributions = self._choose(logits, self.tracker.history(tree))
        step = accept(tree.beams, tree.unpack, choices, hidden)
        self.profile.lap("choice", step.tokens, step.path, step.num_accepted, logprobs)
        return step, logprobs, distributions

    def _synchronise(self, results: list, beams: Optional[Beams]) -> Optional[Beams]:
        """The tree step's one host synchronisation: ``results`` (what was
        accepted) evaluated. The next step's beams, drafted from where this
        step's path ends, go on computing while the host commits the path
        and makes the next step's cheap drafts, and are read when the next
        tree takes them; a profiled step, or one of a model split over ranks
        (which must settle them), reads them now (as numpy arrays)."""
        if self.profile.enabled or self.redrafter.base.ranks.several:
            mx.eval(*results, beams)
            beams = host_beams(beams)
        else:
            mx.eval(*results)
            if beams is not None:
                mx.async_eval(beams)
        self.profile.lap("drafting")
        return beams

    def _settle(self, tic: Optional[float], results):
        """The step's wall seconds since ``tic`` (0 without one), and its
        ``results`` (numpy arrays): rank 0's where ranks of a split model
        may round differently (``Ranks.settle``), so that every rank commits
        the same path."""
        seconds = 0.0 if tic is None else time.perf_counter() - tic
        ranks = self.redrafter.base.ranks
        return seconds, results if ranks.alike else ranks.settle(results)

    def _choose(self, logits: mx.array, history: TokenHistory):
        """The choice at every node (B, N); when the chooser reports
        log-probabilities, its (chosen, top ids, top log-probabilities)
        arrays (else None); when it keeps them, the distributions the
        choices were made from (B, N, vocab) (else None)."""
        wanted, choose = self.choose.logprobs_wanted, self.choose
        if wanted is None:
            choices, logprobs = choose(logits, history), None
        else:
            choices, *logprobs = choose(logits, history, logprobs=wanted)
            logprobs = tuple(logprobs)
        return choices, logprobs, choose.last_distributions if choose.keeps_distributions else None

    def _plain_constants(self, batch: int, ahead: bool):
        """A plain pass's node depths (B, 1) (1 when its fed token is not yet
        in the host's contexts) and one-node mask (B, 1, 1)."""
        key = (batch, ahead)
        if key not in self.constants:
            depths = mx.full((batch, 1), int(ahead), mx.int32)
            mask = mx.ones((batch, 1, 1), mx.bool_)
            mx.eval(depths, mask)
            self.constants[key] = depths, mask
        return self.constants[key]

    def _plain_pass(self, tokens: mx.array, ahead: bool) -> PlainPass:
        """Feed one token per row (B, 1), commit it, and choose the next
        (lazy). ``ahead``: the fed tokens are not yet in the rows' contexts
        on the host (their positions are one further).

        While every row ends where the block begins (always at batch 1) the
        token is fed as a causal chunk, as mlx-lm's loop feeds it; rows of
        different lengths take it as a one-node tree, moved to each row's
        end."""
        batch = tokens.shape[0]
        layout, base = self.layout, self.redrafter.base
        depths, mask = self._plain_constants(batch, ahead)
        if layout.aligned:
            layout.begin_chunk()
            hidden, logits = base(tokens, self.cache)
            layout.end_chunk(1)
        else:
            layout.begin_tree(self._plain_constants(batch, False)[0], mask)
            hidden, logits = base(tokens, self.cache)
            root_only, none = np.zeros((batch, 1), np.int64), np.zeros(batch, np.int64)
            for c in self.cache:  # rows shorter than the longest get their token moved to their end
                c.commit_path(root_only, none)
            layout.commit(none + 1)
        tracker = self.tracker
        history = TokenHistory(
            [tracker.ids[r] for r in tracker.rows], [tracker.context[r] for r in tracker.rows], tokens, mask, depths
        )
        choices, logprobs, distributions = self._choose(logits, history)
        return PlainPass(choices[:, 0], hidden[:, 0], logprobs, distributions)

    def _plain_step(self, plan: Plan, roots: list, tic: float) -> list[StepOutput]:
        """A step with nothing drafted: the token after each row's root, from
        the pass issued ahead by the last step when there is one; with
        ``plan.ahead``, the next step's pass is issued before this one's
        token is read."""
        consumed = self.ahead is not None
        if consumed:
            now, self.ahead = self.ahead, None
        else:
            now = self._plain_pass(mx.array(roots, mx.int32)[:, None], ahead=False)
        if plan.ahead:
            self.ahead = self._plain_pass(now.token[:, None], ahead=True)
            mx.async_eval(self.ahead)
        beams = self._search(now.hidden, now.token, plan.search_length) if plan.search else None
        hidden_rows = now.hidden.astype(mx.float16) if self.with_hidden else None
        mx.eval(now.token, beams, now.logprobs, hidden_rows)  # the step's one synchronisation
        self.profile.lap("pass")
        self.profile.count_step()
        seconds, (token, self.beams) = self._settle(tic, (np.array(now.token), host_beams(beams)))
        batch = len(roots)
        self.costs.plain_step(batch, self.layout.start, tic, seconds, plan.search, consumed=consumed, ahead=plan.ahead)
        at_root = np.zeros((batch, 1), np.int64)
        outputs = self.tracker.emit(
            [[t] for t in token.tolist()],
            [0] * batch,
            [1] * batch,
            logprobs=logprob_lists(now.logprobs, at_root),
            distributions=distribution_rows(now.distributions, at_root),
        )
        self._attach_hidden(outputs, hidden_rows, self.tracker.rows)
        return outputs

    def _resolve_ahead(self) -> list[StepOutput]:
        """Read the pass issued ahead, if any (prompts are about to join the
        batch): the tokens it chose, as this step's outputs."""
        if self.ahead is None or not self.tracker.rows:
            self.ahead = None
            return []
        ahead, self.ahead = self.ahead, None
        hidden_rows = ahead.hidden.astype(mx.float16) if self.with_hidden else None
        at_root = np.zeros((len(self.tracker.rows), 1), np.int64)
        lists = logprob_lists(ahead.logprobs, at_root) or [None] * len(self.tracker.rows)
        distributions = distribution_rows(ahead.distributions, at_root) or [None] * len(self.tracker.rows)
        going_on = [
            (r, t, lp, d)
            for r, t, lp, d in zip(self.tracker.rows, np.array(ahead.token).tolist(), lists, distributions)
            if r not in self.leaving
        ]
        rows = [r for r, _, _, _ in going_on]
        per_row = None if ahead.logprobs is None else [lp for _, _, lp, _ in going_on]
        per_row_distributions = None if ahead.distributions is None else [d for _, _, _, d in going_on]
        outputs = self.tracker.emit(
            [[t] for _, t, _, _ in going_on],
            [0] * len(rows),
            [1] * len(rows),
            rows=rows,
            logprobs=per_row,
            distributions=per_row_distributions,
        )
        self._attach_hidden(outputs, hidden_rows, self.tracker.rows)
        return self._finished(outputs)


def fixed_costs(
    redrafter: ReDrafter, prompts: list, curve: CostCurve, pass_seconds: Callable[[int], float], tokens: int = 16
) -> tuple[float, float]:
    """(seconds a drafting step costs besides its pass, seconds of one
    pipelined plain token), from the engine's own steps on ``prompts``:
    drafting steps by context lookup alone (a prompt that repeats itself,
    so that lookup drafts), then plain decoding of ``tokens`` tokens.

    The fixed cost is a few percent of a pass where a pass is slow, less
    than a shared machine's drift between one measurement and the next; so
    each drafting step is held against a pass of its node count timed right
    after it (``pass_seconds(n)``, see ``calibrate.measure``), and plain
    decoding against passes of one token timed around it, scaled to the
    curve's. The medians, after a step of each kind to warm up."""
    lookup_only = ReDrafter(redrafter.base, None, redrafter.identity)

    def run(draft: DraftSettings, prompts: list, beside=None) -> list[tuple[float, float]]:
        """Each step's (seconds, seconds of ``beside(its node count)`` run right after it)."""
        decoder = Decoder(lookup_only, draft)
        decoder.join(prompts, tokens + 1)
        timed = []
        while True:
            tic = time.perf_counter()
            outputs = decoder.step()
            seconds = time.perf_counter() - tic
            if not outputs:
                break
            nodes = max((out.num_nodes or 1) for out in outputs)
            timed.append((seconds, beside(nodes) if beside else 0.0))
            if any(out.finish_reason for out in outputs):
                break
        return timed[1:]

    block = prompts[0][: len(prompts[0]) // 4]
    repeating = [(block * 4)[: len(prompts[0])] for _ in prompts]
    drafting = run(DraftSettings(max_nodes=4, datastore_beams=0), repeating, pass_seconds)
    fixed = max(statistics.median(step - alone for step, alone in drafting), 0.0) if drafting else 0.0
    around = [pass_seconds(1) for _ in range(3)]
    plain = statistics.median(
        seconds for seconds, _ in run(DraftSettings(max_nodes=0, lookup=False, datastore_beams=0), prompts)
    )
    mx.synchronize()  # (the last plain pass may have been issued ahead)
    around += [pass_seconds(1) for _ in range(3)]
    return fixed, plain * curve(1) / statistics.median(around)


def host_beams(beams) -> Optional[Beams]:
    """Evaluated beams (a (tokens, conditionals) pair of device arrays, as
    ``Decoder._search`` returns them; or None) as numpy ``Beams``."""
    return None if beams is None else Beams(*(np.array(a) for a in beams))


def distribution_rows(
    distributions: Optional[mx.array], nodes: np.ndarray, counts: Optional[np.ndarray] = None
) -> Optional[list]:
    """Per row, the distributions (B, N, vocab) at its nodes (B, M), the
    first ``counts[b]`` of them (default all): (M, vocab) each, lazy; None
    when there are none."""
    if distributions is None:
        return None
    counts = [nodes.shape[1]] * nodes.shape[0] if counts is None else counts.tolist()
    return [distributions[b][mx.array(row[:n])] for b, (row, n) in enumerate(zip(nodes.tolist(), counts))]


def logprob_lists(logprobs: Optional[tuple], nodes: np.ndarray) -> Optional[list]:
    """Per row, ``StepOutput.logprobs`` of the choices at its nodes (B, M)
    (an accepted path's, the root first), from evaluated (chosen, top ids,
    top log-probabilities) arrays; None when there are none."""
    if logprobs is None:
        return None
    chosen, ids, values = (np.array(a) for a in logprobs)
    return [
        [(float(chosen[b, n]), list(zip(ids[b, n].tolist(), values[b, n].tolist()))) for n in row]
        for b, row in enumerate(nodes.tolist())
    ]


def generate_steps(
    redrafter: ReDrafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: Union[int, Sequence[int]] = 256,
    draft: Optional[DraftSettings] = None,
    choose: Chooser = greedy,
    eos_token_ids: Sequence[int] = (),
    prefill_step_size: int = PREFILL_STEP_SIZE,
    profile: Optional[StepProfile] = None,
    row_ids: Optional[Sequence[int]] = None,
    prompt_caches: Optional[Sequence] = None,
    cost_curve=None,
) -> Iterator[list[StepOutput]]:
    """Generate for a batch of tokenized prompts; yields, after the prefill
    and after each verification step, one ``StepOutput`` per active row.
    Rows that finish leave the batch. ``max_tokens``: one limit for every
    prompt, or one per prompt. ``row_ids`` give each prompt's index in
    the caller's whole input list (default 0, 1, ...): ``choose`` sees them,
    so a prompt's sampling seed does not depend on the batch it runs in.

    ``draft`` says what each step verifies (default ``DraftSettings()``).

    ``prompt_caches``: a ``PromptCache`` (or None) per prompt. A prompt
    starts from the longest prefix its cache shares with it, and before each
    yield its cache is set to the prompt and tokens so far, as far as their
    keys and values are computed (the last token's are not yet).

    ``profile``: a ``StepProfile`` that each phase's seconds are added to
    (for benchmarks; it costs extra synchronisations). ``cost_curve``: a
    fixed ``CostCurve`` to size trees by (benchmarks; None: this machine's,
    measured and kept true by the engine).
    """
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(limits) != len(prompts) or min(limits, default=0) < 0:
        raise UserError(f"max tokens must be at least 0, one for all prompts or one per prompt, got {max_tokens}")
    check_prompts(redrafter.base, prompts)
    if max(limits, default=0) == 0:
        return iter(())
    decoder = Decoder(
        redrafter,
        draft or DraftSettings(),
        choose,
        eos_token_ids,
        prefill_step_size=prefill_step_size,
        profile=profile,
        cost_batch_sizes=(len(prompts),),
        cost_curve=cost_curve,
    )
    # This machine's cost curve, measured now if it must be (announced on
    # stderr): before the caller's clock starts, not inside the first step.
    decoder.costs.measure(len(prompts))
    return _run(decoder, prompts, limits, row_ids, prompt_caches)


def _run(decoder: Decoder, prompts, max_tokens, row_ids, prompt_caches) -> Iterator[list[StepOutput]]:
    identity = decoder.redrafter.identity
    outputs = decoder.join(prompts, max_tokens, row_ids, prompt_caches)
    while outputs:
        if prompt_caches is not None:
            for out in outputs:
                cache = prompt_caches[out.row]
                if cache is None:
                    continue
                if out.finish_reason is not None:  # the row leaves the batch at the next step: its arrays now
                    cache.set(*decoder.prompt_cache(out.row), identity)
                else:  # taken when read (valid until the row leaves, when the above sets them)
                    cache.follow(lambda row=out.row: decoder.prompt_cache(row), identity)
        yield outputs
        outputs = decoder.step()
