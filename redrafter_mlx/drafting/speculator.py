"""What each step verifies: the RNN's beams, context-lookup continuations,
datastore continuations and earlier answers, merged into one prefix tree per
row and pruned to the nodes worth their verification cost.

``Speculator`` owns the per-run policy and hands each step one immutable
``Plan``, which the engine's ``Decoder.step`` carries out (and prompts
joining the batch a ``JoinPlan``). A plan's mode is

- ``rnn``: the RNN's beams join the cheap drafts;
- ``lookup``: the cheap drafts alone (lookup, datastore, earlier answers);
- ``plain``: nothing drafted: plain decoding, which the engine pipelines as
  mlx-lm does (``Plan.ahead``: the next pass is issued before this one's
  token is read).

The cost curve prices every choice (``cost.CostCurve``): a tree pass of n
nodes, the step's fixed cost besides its pass, the RNN's search, and one
plain token. So a run whose drafting cannot pay on this machine whatever is
accepted (a pass so cheap that the fixed cost alone outweighs it) is plain
from its first step and never tries. Within ``rnn`` and ``lookup`` the
budget sizes each step's tree by the curve, and a step whose best tree is
worth less than plain decoding decodes plainly.

The policy's running state is in three parts (``policy``): the RNN switch
(the RNN is turned off while steps without its beams produce more tokens
per curve second, and tried again now and then), the back-off (a run that
does not gain turns to plain decoding for a while, longer after each retry
that does not gain) and the search depth (the search drafts as deep as the
budget keeps its nodes). Real steps are held against the curve elsewhere
(the decoder's drift check), so these choices read no clock: every rank of
a split model makes them alike.
"""

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Optional

import numpy as np

from .answers import AnswerStore
from .budget import AcceptanceStats, best_node_count
from .datastore import Datastore
from .lookup import LookupIndex
from .policy import Backoff, RnnSwitch, SearchDepth
from .settings import DraftSettings
from .tree import (
    RowTree,
    beam_drafts,
    candidate_tree,
    datastore_drafts,
    lookup_drafts,
    most_likely_nodes,
    most_likely_path,
    prune,
)

EXPLORE_STEPS = 8  # every this many steps, verify one node more than the budget chose
CARRIED_WEIGHT = 4.0  # predicted mass (a few steps' worth) that earlier runs' statistics weigh as
PROBE_STEPS = 32  # where the curve's trees are a guess, one step in this many verifies a small tree
PROBE_NODES = 4  # the nodes per row of such a step, and of a retry's first step when the budget keeps none

Mode = Literal["plain", "rnn", "lookup"]


class Beams(NamedTuple):
    """The RNN's beams for the next step, one set per batch row.

    tokens (B, W, L): each row's W beams, the root first (partial ones end
    at NO_TOKEN); conditionals (B, W, L - 1): the drafter's probability of
    each drafted token. numpy arrays, or device arrays still being computed
    (the plan reads them after it made the cheap drafts)."""

    tokens: Any
    conditionals: Any

    @property
    def length(self) -> int:
        """L: the beams' length, the root included."""
        return self.tokens.shape[-1]

    def rows(self, keep: list) -> "Beams":
        """The beams of the rows ``keep`` (indices), in that order."""
        return Beams(*(np.asarray(a)[keep] for a in self))

    def joined(self, other: "Beams") -> "Beams":
        """These rows' beams, then ``other``'s (of the same length)."""
        return Beams(*(np.concatenate([np.asarray(a), b]) for a, b in zip(self, other)))


@dataclass(frozen=True)
class Plan:
    """What one step does.

    mode: ``plain``, ``rnn`` or ``lookup``.
    trees: the tree each row verifies (None for a plain step).
    search: the RNN searches the next step's beams in this step's graph.
    search_length: their length, the root included (2 .. beam_length; 0
        without a search).
    ahead: a plain step issues the next step's plain pass before its own
        token is read (the next step is plain too).
    predicted: curve seconds this step is expected to take (the drift check
        holds real steps against it).
    one_node: curve seconds of a plain token (what the step is held against).
    """

    mode: Mode
    trees: Optional[tuple] = None
    search: bool = False
    search_length: int = 0
    ahead: bool = False
    predicted: float = 0.0
    one_node: float = 0.0


@dataclass(frozen=True)
class JoinPlan:
    """What the prefill of prompts joining the batch does besides choosing
    their first tokens: whether the RNN searches their first step's beams
    (search), and how long (search_length, the root included)."""

    search: bool
    search_length: int


class TreeChoice(NamedTuple):
    """The budget's choice of a drafting step's trees (``Speculator._choose_trees``).

    trees: one per row, or None when the budget keeps no node; lookup_rate:
    the tokens per curve second the cheap drafts alone were estimated to
    bring, when they were judged; without_rnn: the beams were not worth
    their search and the cheap drafts alone are verified; candidates: per
    row, the whole tree of its drafts the budget chose from."""

    trees: Optional[tuple]
    lookup_rate: Optional[float] = None
    without_rnn: bool = False
    candidates: tuple = ()


class Speculator:
    """Per-run drafting policy for a batch: ``track`` each prompt (its
    context list, the row tracker's, which grows as tokens are committed)
    before it drafts (``plan_join`` tracks the prompts joining a batch),
    ``drop`` it when it leaves; ``plan`` each step and ``observe`` what a
    drafting step accepted. Only ``plan``, ``plan_join`` and ``observe``
    change the policy's state.

    history: what earlier runs of this model and drafter had accepted
    (``ReDrafter.acceptance``); this run starts from it and adds to it.
    datastore: the drafter's ``Datastore`` (None: no datastore drafts).
    answers: the process's ``AnswerStore`` of earlier answers (None: none).
    chains: each row verifies its most likely path only (a model with
    recurrent layers, which cannot verify a tree).

    A sampled row's drafts are accepted less often than a greedy row's, so
    their statistics are kept apart: every key carries the row's kind."""

    def __init__(
        self,
        settings: DraftSettings,
        has_drafter: bool,
        history: Optional[AcceptanceStats] = None,
        datastore: Optional[Datastore] = None,
        answers: Optional[AnswerStore] = None,
        chains: bool = False,
    ):
        self.settings = settings
        self.chains = chains
        self.datastore = datastore if settings.datastore_beams else None
        self.answers = answers
        self.contexts, self.kinds, self.indexes = {}, {}, {}
        self.history = history
        self.stats = AcceptanceStats() if history is None else history.as_prior(CARRIED_WEIGHT)
        self.rnn = RnnSwitch(has_drafter)
        self.backoff = Backoff()
        self.depth = SearchDepth(settings.beam_length, (history or self.stats).kept_depths)
        self.steps = 0
        self.last: Optional[Plan] = None  # the last step's plan (``observe`` judges by it)
        self.never = False  # this curve says no drafting can pay: the run is plain throughout
        self.curve = None  # the curve ``never`` and ``rnn.usable`` were decided for

    # -- rows -------------------------------------------------------------

    def track(self, row: int, context: list, sampled: bool = False) -> None:
        """A prompt joins: it drafts from ``context``. A new prompt is a new
        chance for drafting: the back-off of earlier retries starts over, and
        the RNN drafts again if it was turned off."""
        self.backoff.restart()
        self.rnn.retry()
        self.contexts[row] = context
        self.kinds[row] = "sampled" if sampled else "greedy"
        if self.settings.lookup:
            self.indexes[row] = LookupIndex(context, self.settings.lookup_max_ngram)

    def drop(self, row: int) -> None:
        for table in (self.indexes, self.contexts, self.kinds):
            table.pop(row, None)

    # -- the policy ----------------------------------------------------------

    @property
    def forced(self) -> bool:
        """Whether the settings fix the node count (no curve sizes the trees)."""
        return self.settings.max_nodes is not None

    @property
    def mode(self) -> Mode:
        """The next step's mode, as far as it is known before its plan."""
        if self.settings.max_nodes == 0 or self.backoff.resting or self.never:
            return "plain"
        return "rnn" if self.use_rnn() else "lookup"

    def use_rnn(self) -> bool:
        """Whether the next step drafts with the RNN (its search then runs
        in this step's graph)."""
        if self.backoff.resting or self.never or self.settings.max_nodes == 0:
            return False
        return self.rnn.wanted()

    def plan_join(
        self, rows: list, contexts: list, sampled: list, cost=None, running: bool = False, beams: Optional[Beams] = None
    ) -> JoinPlan:
        """Prompts join the batch as ``rows``, drafting from ``contexts``
        (``sampled``: per row, whether its tokens are sampled). cost: the
        curve of the batch with them, at their longest prompt: what can pay
        on it is known before their first search. Joining a ``running``
        batch, they search as it does (``beams``: its beams, or None);
        starting one, the whole beam length when the RNN drafts."""
        self._judge(cost)
        for row, context, s in zip(rows, contexts, sampled):
            self.track(row, context, s)
        if running:
            return JoinPlan(beams is not None, 0 if beams is None else beams.length)
        return JoinPlan(self.use_rnn(), self.settings.beam_length)

    def plan(
        self,
        rows: list,
        roots: list,
        beams: Optional[Beams] = None,
        cost=None,
        ahead: bool = False,
        may_run_ahead: bool = True,
    ) -> Plan:
        """The step's plan. rows: the prompt of each batch row; roots: each
        row's last chosen token; beams: the RNN's beams, or None when it did
        not search. cost: the cost curve (``CostCurve``) unless the settings
        fix the node count. ahead: the step's plain pass was already issued
        (it is plain whatever the policy). may_run_ahead: the engine can
        issue a plain pass before the last token is known (not when the
        token choice reads the tokens)."""
        self.steps += 1
        self._judge(cost)
        mode, trees, run_ahead = self._decide(rows, roots, beams, cost, ahead, may_run_ahead)
        search = self.use_rnn()
        if trees is not None and beams is not None:
            self.depth.keep(trees, beams.length)
        length = self.depth.next_length() if search else 0
        one_node = 0.0 if cost is None else cost.plain
        self.last = Plan(mode, trees, search, length, run_ahead, self._predicted(cost, trees, search), one_node)
        return self.last

    def _decide(self, rows, roots, beams, cost, ahead: bool, may_run_ahead: bool) -> tuple:
        """The step's (mode, trees or None, whether it runs ahead); the
        back-off and the RNN switch take note."""
        if not ahead and self._probing(cost, self.steps):
            trees = tuple(prune(t, PROBE_NODES) for t in self._candidate_trees(rows, roots, beams))
            if any(t.num_nodes > 1 for t in trees):
                return ("rnn" if beams is not None else "lookup"), trees, False
        if ahead or self.mode == "plain":
            if self.backoff.plain_step():  # the next step retries, the RNN's beams (searched in this one) with it
                self.rnn.retry()
            return "plain", None, may_run_ahead and self.mode == "plain" and not self._probing(cost, self.steps + 1)
        choice = self._choose_trees(rows, roots, beams, cost)
        self.rnn.drafted(choice.lookup_rate, choice.without_rnn)
        if choice.trees is None and self.backoff.testing:
            # A retry the budget would leave empty would learn nothing, and
            # the statistics that make every tree look dear (earlier
            # prompts', maybe) would never meet this prompt's drafts.
            trees = tuple(prune(t, PROBE_NODES) for t in choice.candidates)
            if self._could_pay(trees, cost, beams is not None):
                self.backoff.verified(True)
                return ("rnn" if beams is not None else "lookup"), trees, False
        self.backoff.verified(choice.trees is not None)
        if choice.trees is None:  # nothing worth verifying: this step decodes plainly
            return "plain", None, False
        return ("lookup" if choice.without_rnn or beams is None else "rnn"), choice.trees, False

    def _judge(self, cost) -> None:
        """Decide, once per curve, what can pay at all: a drafting step's
        best case (every node of the largest tree accepted) against plain
        decoding. The RNN is kept off where its search alone forbids it; a
        run is plain throughout where nothing can pay."""
        if cost is None or cost is self.curve or self.forced:
            return
        self.curve = cost
        # At most one path is accepted: a step gains at most its deepest
        # draft, and the RNN at most its beams' length.
        settings = self.settings
        cheap_depth = max(
            settings.lookup_length if settings.lookup or self.answers is not None else 0,
            settings.beam_length - 1 if self.datastore is not None else 0,
        )
        rnn_depth = settings.beam_length - 1

        def best(depth: int, extra: float) -> float:  # tokens a second of a row
            return max(((1 + n) / (cost(n + 1) + cost.step_seconds + extra) for n in range(1, depth + 1)), default=0.0)

        plain = 1 / cost.plain
        with_rnn = best(rnn_depth, cost.draft_seconds)
        cheap = best(cheap_depth, 0.0)
        self.rnn.judge(with_rnn > plain)
        self.never = max(cheap, with_rnn if self.rnn.usable else 0.0) <= plain

    def _probing(self, cost, step: int) -> bool:
        """Whether step ``step`` of the run verifies a small tree whatever
        the budget says: where the curve's trees are a guess (a context
        past the measured ones where no tree has run yet), a guess that
        makes every tree look dear would otherwise never be put right. One
        step in ``PROBE_STEPS`` until a tree has run there."""
        return (
            cost is not None
            and cost.guessed
            and not self.forced
            and self.settings.max_nodes != 0
            and step % PROBE_STEPS == 0
        )

    @staticmethod
    def _could_pay(trees: tuple, cost, searched: bool) -> bool:
        """Whether verifying ``trees`` would beat plain steps if every row's
        deepest draft were accepted (a test that cannot pay is not run)."""
        if cost is None or all(t.num_nodes == 1 for t in trees):
            return False
        seconds = cost(max(t.num_nodes for t in trees)) + cost.step_seconds + (cost.draft_seconds if searched else 0.0)
        return sum(1 + max(t.depths) for t in trees) / seconds > len(trees) / cost.plain

    @staticmethod
    def _predicted(cost, trees: Optional[tuple], search: bool) -> float:
        """Curve seconds of the step: its pass (of one token when it is
        plain: what the drift check holds a plain step not pipelined
        against), the rest of a step, and the search it runs."""
        if cost is None:
            return 0.0
        nodes = 1 if trees is None else max(t.num_nodes for t in trees)
        return cost(nodes) + cost.step_seconds + (cost.draft_seconds if search else 0.0)

    def trees(self, rows: list, roots: list, beams: Optional[Beams] = None, cost=None) -> Optional[tuple]:
        """The tree each row verifies, or None when the budget keeps no node
        (with a fixed ``max_nodes``, always the trees); changes nothing."""
        return self._choose_trees(rows, roots, beams, cost).trees

    def _choose_trees(self, rows: list, roots: list, beams: Optional[Beams], cost) -> TreeChoice:
        """The budget's trees for a drafting step, and what it saw of the
        cheap drafts alone; changes nothing (``_decide`` passes it on)."""
        drafts = self._drafts(rows, beams)
        candidates = [self._candidates(root, d) for root, d in zip(roots, drafts)]
        if self.forced:
            return TreeChoice(
                tuple(prune(t, self.settings.max_nodes) for t in candidates), candidates=tuple(candidates)
            )
        gains = [most_likely_nodes(t) for t in candidates]
        extra = cost.step_seconds + (cost.draft_seconds if beams is not None else 0.0)
        count, _ = best_node_count(gains, cost, max(map(len, gains)), extra, plain_seconds=cost.plain)
        if count and self.steps % EXPLORE_STEPS == 0:
            # Nodes left out are never observed, so their estimates would
            # never recover: now and then one more is tried.
            count += 1
        rate = None
        if beams is not None and self.has_cheap_drafts and (self.rnn.measured["lookup"] is None or count == 0):
            cheap = [
                self._candidates(root, [d for d in row_drafts if d.keys[0][0] != "rnn"])
                for root, row_drafts in zip(roots, drafts)
            ]
            cheap_gains = [most_likely_nodes(t) for t in cheap]
            cheap_count, rate = best_node_count(
                cheap_gains, cost, max(map(len, cheap_gains)), cost.step_seconds, plain_seconds=cost.plain
            )
            if count == 0 and cheap_count:
                # The beams are not worth their search, the cheap drafts are
                # worth their pass: this step goes without them, and so do
                # the next ones until the RNN is tried again.
                return TreeChoice(
                    tuple(prune(t, cheap_count) for t in cheap), rate, without_rnn=True, candidates=tuple(candidates)
                )
        return TreeChoice(
            None if count == 0 else tuple(prune(t, count) for t in candidates), rate, candidates=tuple(candidates)
        )

    def _drafts(self, rows: list, beams: Optional[Beams]) -> list:
        """Per row, its drafts: the RNN's beams (when it searched) and the cheap ones."""
        estimates = [self._estimate(row) for row in rows]
        cheap = [self._cheap_drafts(row, estimate) for row, estimate in zip(rows, estimates)]
        drafts = cheap
        if beams is not None:  # read only now: the engine's search may still be running
            tokens, conditionals = np.asarray(beams.tokens), np.asarray(beams.conditionals)
            drafts = [
                beam_drafts(b, c, estimate) + row_cheap
                for b, c, estimate, row_cheap in zip(tokens, conditionals, estimates, cheap)
            ]
        for row, row_drafts in zip(rows, drafts):
            kind = self.kinds.get(row, "greedy")
            for draft in row_drafts:
                draft.keys = [(*key, kind) for key in draft.keys]
        return drafts

    def _candidate_trees(self, rows: list, roots: list, beams: Optional[Beams]) -> list[RowTree]:
        return [self._candidates(root, d) for root, d in zip(roots, self._drafts(rows, beams))]

    def _candidates(self, root: int, drafts: list) -> RowTree:
        tree = candidate_tree(root, drafts)
        return most_likely_path(tree) if self.chains else tree

    def _estimate(self, row: int):
        kind = self.kinds.get(row, "greedy")
        return lambda key, predicted: self.stats.estimate((*key, kind), predicted)

    @property
    def has_cheap_drafts(self) -> bool:
        """Whether steps can draft without the RNN (context lookup, datastore, earlier answers)."""
        return bool(self.settings.lookup) or self.datastore is not None or self.answers is not None

    def _cheap_drafts(self, row: int, estimate) -> list:
        """A row's drafts that need no drafter run: context lookup's, the
        datastore's and the earlier answers'."""
        settings, context = self.settings, self.contexts.get(row, [])
        drafts = (
            lookup_drafts(self.indexes[row].propose(settings.lookup_length), estimate) if row in self.indexes else []
        )
        if self.datastore is not None:
            drafts += datastore_drafts(
                self.datastore.propose(context, settings.beam_length - 1, settings.datastore_beams), estimate
            )
        if self.answers is not None:
            drafts += datastore_drafts(self.answers.propose(context, settings.lookup_length), estimate, "answers")
        return drafts

    def observe(self, trees: list, paths: np.ndarray, num_accepted: np.ndarray) -> None:
        """After a drafting step: what was accepted (``accept``'s path and counts)."""
        paths, counts = paths.tolist(), num_accepted.tolist()
        self.stats.observe_step(trees, paths, counts)
        if self.history is not None:
            self.history.observe_step(trees, paths, counts)
        plan = self.last
        if plan is None or plan.mode == "plain" or self.forced:
            return
        tokens = float(np.sum(num_accepted + 1))
        self.rnn.observe(plan.mode, tokens, plan.predicted, self.has_cheap_drafts)
        self.backoff.observe(tokens, plan.predicted, plan.one_node, len(trees))
