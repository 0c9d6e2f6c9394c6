"""What each step verifies: the RNN's beams, context-lookup continuations,
datastore continuations and earlier answers, merged into one prefix tree per
row and pruned to the nodes worth their verification cost.

``Speculator`` owns the per-run policy and hands each step one ``Plan``,
which the engine's ``Decoder.step`` executes. A plan's mode is

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
worth less than plain decoding decodes plainly. The RNN is turned off
while the steps without its beams produce more tokens per curve second
(tokens really produced, not estimated), and tried again now and then.

The search drafts as deep as the budget keeps its nodes: the RNN's nodes
beyond a depth or two rarely make the tree, and each depth of the search
costs as much as the first few. Every ``RESHAPE_STEPS``-th search (and the
first few) runs the whole beam length; the others stop at the deepest
depth whose RNN nodes those full searches' trees kept often enough.

A run that does not gain turns to plain decoding: when the budget verified
nothing for a few steps in a row, or when the last ``WINDOW`` drafting
steps produced fewer tokens per curve second than plain steps would. The
window is long because a step's accepted length varies widely: a run that
gains on average still has stretches of a few steps that do not, which
a short window, checked at every step, would take for a loss. It
drafts again after an interval of plain steps that doubles after each
retry that does not gain (so retries stay a small share of the time) and
shrinks back after one that does; a retry is judged after its first
``RETRY_WINDOW`` drafting steps. Real steps are held against the curve
elsewhere (the decoder's drift check), so these choices read no clock:
every rank of a split model makes them alike.
"""

from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .answers import AnswerStore
from .budget import AcceptanceStats, best_node_count
from .datastore import Datastore
from .lookup import LookupIndex
from .settings import DraftSettings
from .tree import RowTree, beam_drafts, candidate_tree, datastore_drafts, lookup_drafts, most_likely_nodes, most_likely_path, prune

RNN_RETRY_STEPS = 16  # with the RNN turned off, run it again every this many steps
EXPLORE_STEPS = 8  # every this many steps, verify one node more than the budget chose
RATE_MEMORY = 0.8  # weight of the past in the running estimate of lookup alone
MEASURED_MEMORY = 0.7  # weight of the past in the running measured tokens and seconds
CARRIED_WEIGHT = 4.0  # predicted mass (a few steps' worth) that earlier runs' statistics weigh as
WINDOW = 32  # drafting steps whose rate is held against plain decoding's
RETRY_WINDOW = 8  # drafting steps after which a retry is judged
IDLE_STEPS = 3  # steps in a row that verified nothing before a run turns plain (one on a retry)
PLAIN_STEPS = 16  # plain steps before drafting is tried again, at first
MAX_PLAIN_STEPS = 4096  # the longest interval the doubling reaches
RESHAPE_STEPS = 16  # every this many searches, one of the whole beam length
PROBE_STEPS = 32  # where the curve's trees are a guess, one step in this many verifies a small tree
PROBE_NODES = 4  # the nodes per row of such a step
KEPT_SHARE = 0.5  # a depth is searched while this share of full searches' trees kept an RNN node there


@dataclass
class Plan:
    """What one step does.

    mode: ``plain``, ``rnn`` or ``lookup``.
    trees: the tree each row verifies (None for a plain step).
    search: the RNN searches the next step's beams in this step's graph.
    search_length: their length, the root included (2 .. beam_length).
    ahead: a plain step issues the next step's plain pass before its own
        token is read (the next step is plain too).
    predicted: curve seconds this step is expected to take (drafting steps;
        the drift check holds real steps against it).
    one_node: curve seconds of a plain token (what the step is held against).
    """

    mode: str
    trees: Optional[list] = None
    search: bool = False
    search_length: int = 0
    ahead: bool = False
    predicted: float = 0.0
    one_node: float = 0.0


class Speculator:
    """Per-run drafting policy for a batch: ``track`` each prompt (its
    context list, the row tracker's, which grows as tokens are committed)
    before it drafts, ``drop`` it when it leaves; ``plan`` each step and
    ``observe`` what a drafting step accepted.

    history: what earlier runs of this model and drafter had accepted
    (``ReDrafter.acceptance``); this run starts from it and adds to it.
    datastore: the drafter's ``Datastore`` (None: no datastore drafts).
    answers: the process's ``AnswerStore`` of earlier answers (None: none).
    chains: each row verifies its most likely path only (a model with
    recurrent layers, which cannot verify a tree).

    A sampled row's drafts are accepted less often than a greedy row's, so
    their statistics are kept apart: every key carries the row's kind."""

    def __init__(self, settings: DraftSettings, has_drafter: bool, history: Optional[AcceptanceStats] = None,
                 datastore: Optional[Datastore] = None, answers: Optional[AnswerStore] = None, chains: bool = False):
        self.settings = settings
        self.chains = chains
        self.drafter_present = self.has_drafter = has_drafter  # (has_drafter: and its search can pay on this curve)
        self.datastore = datastore if settings.datastore_beams else None
        self.answers = answers
        self.contexts, self.kinds, self.indexes = {}, {}, {}
        self.history = history
        self.stats = AcceptanceStats() if history is None else history.as_prior(CARRIED_WEIGHT)
        self.rnn_on = has_drafter
        self.steps_off = 0
        self.lookup_estimate = None  # running estimated tokens per curve second without the RNN, before such steps ran
        self.measured = {"rnn": None, "lookup": None}  # running (tokens, curve seconds) of the steps of each mode
        self.window = deque(maxlen=WINDOW)  # (tokens, curve seconds, curve seconds of a plain token, rows) of recent drafting steps
        self.idle = 0  # steps in a row that verified nothing
        self.plain_left = 0  # plain steps still to run before drafting is tried again
        self.interval = PLAIN_STEPS  # plain steps before the next retry
        self.retrying = False  # drafting again after plain steps, not yet shown to gain
        self.steps = 0
        self.last: Optional[Plan] = None
        self.last_mode = "lookup"  # what the step being planned drafts with
        self.never = False  # this curve says no drafting can pay: the run is plain throughout
        self.curve = None  # the curve ``never`` and ``has_drafter`` were decided for
        self.searches = 0
        # Per full-length search: the depths its tree kept RNN nodes at (the
        # history's, which earlier runs of this pair filled).
        self.kept_depths = (history or self.stats).kept_depths

    # -- rows -------------------------------------------------------------

    def track(self, row: int, context: list, sampled: bool = False) -> None:
        """A prompt joins: it drafts from ``context``. A new prompt is a new
        chance for drafting, so the backoff of earlier retries starts over."""
        self.interval, self.plain_left, self.retrying, self.idle = PLAIN_STEPS, 0, False, 0
        self.window.clear()
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
        """Whether the settings fix the node count (no curve decides)."""
        return self.settings.max_nodes is not None

    @property
    def mode(self) -> str:
        """The next step's mode, as far as it is known before its plan."""
        if self.settings.max_nodes == 0 or self.plain_left or self.never:
            return "plain"
        return "rnn" if self.use_rnn() else "lookup"

    def use_rnn(self) -> bool:
        """Whether the next step drafts with the RNN (its search then runs
        in this step's graph)."""
        if not self.has_drafter or self.plain_left or self.never or self.settings.max_nodes == 0:
            return False
        if self.rnn_on:
            return True
        return (self.steps_off + 1) % RNN_RETRY_STEPS == 0

    def judge(self, cost) -> None:
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
        cheap_depth = max(settings.lookup_length if settings.lookup or self.answers is not None else 0,
                          settings.beam_length - 1 if self.datastore is not None else 0)
        rnn_depth = settings.beam_length - 1

        def best(depth: int, extra: float) -> float:  # tokens a second of a row
            return max(((1 + n) / (cost(n + 1) + cost.step_seconds + extra) for n in range(1, depth + 1)), default=0.0)

        plain = 1 / cost.plain
        with_rnn = best(rnn_depth, cost.draft_seconds)
        cheap = best(cheap_depth, 0.0)
        self.has_drafter = self.drafter_present and with_rnn > plain
        if not self.has_drafter:
            self.rnn_on = False
        self.never = max(cheap, with_rnn if self.has_drafter else 0.0) <= plain

    def plan(self, rows: list, roots: list, beams: Optional[np.ndarray], conditionals: Optional[np.ndarray], cost=None,
             ahead: bool = False, may_run_ahead: bool = True) -> Plan:
        """The step's plan. rows: the prompt of each batch row; roots: each
        row's last chosen token; beams (B, W, L) and conditionals
        (B, W, L - 1): the RNN's beams (partial ones ending at NO_TOKEN)
        and the drafter's probability of each drafted token, or None when
        it did not run (numpy arrays, or device arrays still being
        computed, read when the cheap drafts are made). cost: the cost curve (``CostCurve``) when
        ``max_nodes`` is None. ahead: the step's plain pass was already
        issued (it is plain whatever the policy). may_run_ahead: the engine
        can issue a plain pass before the last token is known (not when the
        token choice reads the tokens)."""
        self.steps += 1
        self.judge(cost)
        plan = self._plan(rows, roots, beams, conditionals, cost, ahead, may_run_ahead)
        if plan.trees is not None and beams is not None and beams.shape[-1] == self.settings.beam_length:
            self.kept_depths.append({t.depths[i] for t in plan.trees for i in range(1, t.num_nodes)
                                     if any(key[0] == "rnn" for key, _ in t.judged[i])})
        if plan.search:
            plan.search_length = self.search_length()
            self.searches += 1
        return plan

    def search_length(self) -> int:
        """How deep the next search drafts (the root included): the whole
        beam length every ``RESHAPE_STEPS``-th search and until enough full
        searches were seen, else one past the deepest depth their trees
        kept RNN nodes at in at least ``KEPT_SHARE`` of them."""
        full = self.settings.beam_length
        if len(self.kept_depths) < self.kept_depths.maxlen // 2 or self.searches % RESHAPE_STEPS == 0:
            return full
        kept = [sum(d in depths for depths in self.kept_depths) / len(self.kept_depths) for d in range(1, full)]
        deepest = max((d + 1 for d, share in enumerate(kept) if share >= KEPT_SHARE), default=1)
        return max(2, deepest + 1)

    def _probing(self, cost, step: int) -> bool:
        """Whether step ``step`` of the run verifies a small tree whatever
        the budget says: where the curve's trees are a guess (a context
        past the measured ones where no tree has run yet), a guess that
        makes every tree look dear would otherwise never be put right. One
        step in ``PROBE_STEPS`` until a tree has run there."""
        return cost is not None and cost.guessed and not self.forced and self.settings.max_nodes != 0 and step % PROBE_STEPS == 0

    def _plan(self, rows, roots, beams, conditionals, cost, ahead: bool, may_run_ahead: bool) -> Plan:
        one = 0.0 if cost is None else cost.plain
        if not ahead and self._probing(cost, self.steps):
            trees = [prune(t, PROBE_NODES) for t in self._candidate_trees(rows, roots, beams, conditionals)]
            if any(t.num_nodes > 1 for t in trees):
                search = self.use_rnn()
                predicted = cost(max(t.num_nodes for t in trees)) + cost.step_seconds + (cost.draft_seconds if search else 0.0)
                self.last = Plan("rnn" if beams is not None else "lookup", trees, search=search, predicted=predicted, one_node=one)
                return self.last
        if ahead or self.mode == "plain":
            if self.plain_left:
                self.plain_left -= 1
            self.last = Plan("plain", search=self.use_rnn(), one_node=one)
            self.last.ahead = may_run_ahead and self.mode == "plain" and not self._probing(cost, self.steps + 1)
            self.last.predicted = self._alone(cost, self.last.search)
            return self.last
        self.last_mode = "rnn" if beams is not None else "lookup"
        trees = self.trees(rows, roots, beams, conditionals, cost)
        mode = self.last_mode
        search = self.use_rnn()
        if trees is None:  # nothing worth verifying: this step decodes plainly
            self.idle += 1
            if self.idle >= (1 if self.retrying else IDLE_STEPS):
                self._turn_plain()
            self.last = Plan("plain", search=self.use_rnn(), one_node=one)
            self.last.predicted = self._alone(cost, self.last.search)
            return self.last
        self.idle = 0
        predicted = 0.0
        if cost is not None:  # what this step costs: its pass, the rest of a step, and the search it runs
            predicted = cost(max(t.num_nodes for t in trees)) + cost.step_seconds + (cost.draft_seconds if search else 0.0)
        self.last = Plan(mode, trees, search=search, predicted=predicted, one_node=one)
        return self.last

    @staticmethod
    def _alone(cost, search: bool) -> float:
        """Curve seconds of a plain step not pipelined (what the drift check
        holds it against): a pass of one token, a step's own work, and the
        search it runs."""
        return 0.0 if cost is None else cost(1) + cost.step_seconds + (cost.draft_seconds if search else 0.0)

    def trees(self, rows: list, roots: list, beams: Optional[np.ndarray], conditionals: Optional[np.ndarray], cost=None) -> Optional[list[RowTree]]:
        """The tree each row verifies, or None when the budget keeps no node
        (with a fixed ``max_nodes``, always the trees)."""
        if self.has_drafter and not self.rnn_on:
            self.steps_off += 1
        drafts = self._drafts(rows, beams, conditionals)
        candidates = [self._candidates(root, d) for root, d in zip(roots, drafts)]
        if self.forced:
            return [prune(t, self.settings.max_nodes) for t in candidates]
        gains = [most_likely_nodes(t) for t in candidates]
        extra = cost.step_seconds + (cost.draft_seconds if beams is not None else 0.0)
        count, _ = best_node_count(gains, cost, max(map(len, gains)), extra, plain_seconds=cost.plain)
        if count and self.steps % EXPLORE_STEPS == 0:
            # Nodes left out are never observed, so their estimates would
            # never recover: now and then one more is tried.
            count += 1
        if beams is not None and self.has_cheap_drafts and (self.measured["lookup"] is None or count == 0):
            cheap = [self._candidates(root, [d for d in row_drafts if d.keys[0][0] != "rnn"]) for root, row_drafts in zip(roots, drafts)]
            cheap_gains = [most_likely_nodes(t) for t in cheap]
            cheap_count, rate = best_node_count(cheap_gains, cost, max(map(len, cheap_gains)), cost.step_seconds, plain_seconds=cost.plain)
            past = self.lookup_estimate
            self.lookup_estimate = rate if past is None else RATE_MEMORY * past + (1 - RATE_MEMORY) * rate
            if count == 0 and cheap_count:
                # The beams are not worth their search, the cheap drafts are
                # worth their pass: this step goes without them, and so do
                # the next ones until the RNN is tried again.
                self.rnn_on = False
                self.last_mode = "lookup"
                return [prune(t, cheap_count) for t in cheap]
        if count == 0:
            return None
        return [prune(t, count) for t in candidates]

    def _drafts(self, rows: list, beams, conditionals) -> list:
        """Per row, its drafts: the RNN's beams (when it searched) and the cheap ones."""
        cheap = [self._cheap_drafts(row, self._estimate(row)) for row in rows]
        if beams is not None:  # read only now: the engine's search may still be running
            beams, conditionals = np.asarray(beams), np.asarray(conditionals)
        drafts = []
        for row, b, c, row_cheap in zip(rows, beams if beams is not None else [None] * len(rows),
                                        conditionals if beams is not None else [None] * len(rows), cheap):
            estimate = self._estimate(row)
            row_drafts = ([] if b is None else beam_drafts(b, c, estimate)) + row_cheap
            kind = self.kinds.get(row, "greedy")
            for draft in row_drafts:
                draft.keys = [(*key, kind) for key in draft.keys]
            drafts.append(row_drafts)
        return drafts

    def _candidate_trees(self, rows: list, roots: list, beams, conditionals) -> list[RowTree]:
        return [self._candidates(root, d) for root, d in zip(roots, self._drafts(rows, beams, conditionals))]

    def _turn_plain(self) -> None:
        """Plain steps for the current interval; a retry that did not gain
        doubles it (one that gains starts it over: ``observe``)."""
        if self.retrying:
            self.interval = min(2 * self.interval, MAX_PLAIN_STEPS)
        self.plain_left, self.idle, self.retrying = self.interval, 0, True
        self.window.clear()

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
        drafts = lookup_drafts(self.indexes[row].propose(settings.lookup_length), estimate) if row in self.indexes else []
        if self.datastore is not None:
            drafts += datastore_drafts(self.datastore.propose(context, settings.beam_length - 1, settings.datastore_beams), estimate)
        if self.answers is not None:
            drafts += datastore_drafts(self.answers.propose(context, settings.lookup_length), estimate, "answers")
        return drafts

    def rate(self, mode: str) -> Optional[float]:
        """Tokens per curve second of the steps verified with (``"rnn"``) or
        without (``"lookup"``) the RNN's beams: measured once such steps
        ran; before lookup-only steps ran, their rate is estimated from the
        RNN's steps (the RNN runs first, so it is always measured first)."""
        if self.measured[mode] is not None:
            tokens, seconds = self.measured[mode]
            return tokens / seconds
        return self.lookup_estimate if mode == "lookup" else None

    def observe(self, trees: list, paths: np.ndarray, num_accepted: np.ndarray) -> None:
        """After a drafting step: what was accepted (``accept``'s path and counts)."""
        paths, counts = paths.tolist(), num_accepted.tolist()
        self.stats.observe_step(trees, paths, counts)
        if self.history is not None:
            self.history.observe_step(trees, paths, counts)
        plan = self.last
        if plan is None or plan.mode == "plain" or self.forced:
            return
        tokens, past = float(np.sum(num_accepted + 1)), self.measured[plan.mode]
        m = MEASURED_MEMORY
        self.measured[plan.mode] = (tokens, plan.predicted) if past is None else (m * past[0] + (1 - m) * tokens, m * past[1] + (1 - m) * plan.predicted)
        if self.has_drafter and self.has_cheap_drafts and None not in (self.rate("rnn"), self.rate("lookup")):
            self.rnn_on = self.rate("rnn") >= self.rate("lookup")
        self.window.append((tokens, plan.predicted, plan.one_node, len(trees)))
        if len(self.window) >= (RETRY_WINDOW if self.retrying else WINDOW):
            if self._losing():
                self._turn_plain()
            elif self.retrying:  # a retry that gains: the next one comes soon again
                self.retrying, self.interval = False, PLAIN_STEPS

    def _losing(self) -> bool:
        """Whether the drafting steps in the window (the last ``WINDOW``, or
        a retry's first ``RETRY_WINDOW``) produced fewer tokens per curve
        second than plain steps would (one token per row each ``one_node``
        seconds)."""
        tokens, predicted, one_node, rows = (sum(column) for column in zip(*self.window))
        return tokens * one_node < rows * predicted
