"""What each step verifies: the RNN's beams, context-lookup continuations,
datastore continuations and earlier answers, merged into one prefix tree per
row and pruned to the nodes worth their verification cost.

``Speculator`` owns the per-run state: a lookup index per prompt, the
on-line acceptance statistics, and the mode of each step:

- ``rnn``: the RNN's beams join the cheap drafts;
- ``lookup``: the cheap drafts alone (lookup, datastore, earlier answers);
- ``plain``: nothing drafted: plain decoding, which the engine pipelines.

Within ``rnn`` and ``lookup`` the budget sizes each step's tree by the cost
curve. The RNN's search costs time too, so the tokens per curve second of
steps with and without its beams are compared (tokens really produced, not
estimated: the estimates that choose the nodes run high), the RNN is turned
off while the cheap drafts alone do better, and tried again now and then.

A run that does not gain turns to plain decoding: when the budget verified
nothing for a few steps in a row, or when the last ``WINDOW`` drafting
steps produced fewer tokens per second of the cost curve than plain steps
would (one token per row at the curve's cost of one node). Real steps are
held against the curve elsewhere (the decoder's drift check measures it
again when they part), so this choice reads no clock: every rank of a
split model makes it alike. It drafts again after ``PLAIN_STEPS`` steps.
"""

from collections import deque
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
WINDOW = 8  # drafting steps whose wall-clock rate is held against plain decoding's
IDLE_STEPS = 3  # steps in a row that verified nothing before a run turns plain
PLAIN_STEPS = 16  # plain steps before drafting is tried again


class Speculator:
    """Per-run drafting state for a batch: ``track`` each prompt (its
    context list, the row tracker's, which grows as tokens are committed)
    before it drafts, ``drop`` it when it leaves.

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
        self.has_drafter = has_drafter
        self.datastore = datastore if settings.datastore_beams else None
        self.answers = answers
        self.contexts, self.kinds, self.indexes = {}, {}, {}
        self.history = history
        self.stats = AcceptanceStats() if history is None else history.as_prior(CARRIED_WEIGHT)
        self.rnn_on = has_drafter
        self.steps_off = 0
        self.lookup_estimate = None  # running estimated tokens per curve second without the RNN, before such steps ran
        self.measured = {"rnn": None, "lookup": None}  # running (tokens, curve seconds) of the steps of each mode
        self.pending = None  # (mode, seconds on the cost curve) of the step being verified
        self.window = deque(maxlen=WINDOW)  # (tokens, curve seconds, curve seconds of one node, rows) of recent drafting steps
        self.idle = 0  # steps in a row that verified nothing
        self.plain_left = PLAIN_STEPS if settings.max_nodes == 0 else 0  # plain steps still to run
        self.steps = 0

    @property
    def mode(self) -> str:
        """The next step's: ``plain``, ``rnn`` or ``lookup``."""
        if self.plain_left or self.settings.max_nodes == 0:
            return "plain"
        return "rnn" if self.use_rnn() else "lookup"

    def track(self, row: int, context: list, sampled: bool = False) -> None:
        self.contexts[row] = context
        self.kinds[row] = "sampled" if sampled else "greedy"
        if self.settings.lookup:
            self.indexes[row] = LookupIndex(context, self.settings.lookup_max_ngram)

    def drop(self, row: int) -> None:
        for table in (self.indexes, self.contexts, self.kinds):
            table.pop(row, None)

    def use_rnn(self) -> bool:
        """Whether the next step drafts with the RNN (its search then runs
        in this step's graph)."""
        if not self.has_drafter or self.plain_left:
            return False
        if self.rnn_on:
            return True
        return (self.steps_off + 1) % RNN_RETRY_STEPS == 0

    def trees(self, rows: list, roots: list, beams: Optional[np.ndarray], conditionals: Optional[np.ndarray], cost=None, plain: bool = False) -> list[RowTree]:
        """The tree each row verifies. rows: the prompt of each batch row;
        roots: each row's last chosen token; beams (B, W, L) and
        conditionals (B, W, L - 1): the RNN's beams (partial ones ending at
        NO_TOKEN) and the drafter's probability of each drafted token, or
        None when it did not run.
        cost: the cost curve (``CostCurve``) when ``max_nodes`` is None.
        plain: the step is plain whatever the mode (its pass ran ahead)."""
        self.steps += 1
        self.pending = None
        if plain or self.plain_left or self.settings.max_nodes == 0:
            if self.plain_left and self.settings.max_nodes != 0:
                self.plain_left -= 1
            return [RowTree([root], [-1], [0], [1.0], [[]]) for root in roots]
        if self.has_drafter and not self.rnn_on:
            self.steps_off += 1
        drafts = []
        for row, b, c in zip(rows, beams if beams is not None else [None] * len(rows), conditionals if beams is not None else [None] * len(rows)):
            estimate = self._estimate(row)
            row_drafts = ([] if b is None else beam_drafts(b, c, estimate)) + self._cheap_drafts(row, estimate)
            kind = self.kinds.get(row, "greedy")
            for draft in row_drafts:
                draft.keys = [(*key, kind) for key in draft.keys]
            drafts.append(row_drafts)
        candidates = [self._candidates(root, d) for root, d in zip(roots, drafts)]
        if self.settings.max_nodes is not None:
            return [prune(t, self.settings.max_nodes) for t in candidates]
        gains = [most_likely_nodes(t) for t in candidates]
        draft_seconds = cost.draft_seconds if beams is not None else 0.0
        count, _ = best_node_count(gains, cost, max(map(len, gains)), draft_seconds)
        if self.steps % EXPLORE_STEPS == 0:
            # Nodes left out are never observed, so their estimates would
            # never recover: now and then one more is tried.
            count += 1
        self.idle = self.idle + 1 if count == 0 else 0
        self.pending = ("rnn" if beams is not None else "lookup"), cost(count + 1) + draft_seconds, cost(1)
        if beams is not None and self.has_cheap_drafts and self.measured["lookup"] is None:
            cheap_only = [most_likely_nodes(self._candidates(root, [d for d in row_drafts if d.keys[0][0] != "rnn"]))
                          for root, row_drafts in zip(roots, drafts)]
            rate = best_node_count(cheap_only, cost, max(map(len, cheap_only)))[1]
            past = self.lookup_estimate
            self.lookup_estimate = rate if past is None else RATE_MEMORY * past + (1 - RATE_MEMORY) * rate
        return [prune(t, count) for t in candidates]

    def _candidates(self, root: int, drafts: list) -> RowTree:
        tree = candidate_tree(root, drafts)
        return most_likely_path(tree) if self.chains else tree

    def _estimate(self, row: int):
        kind = self.kinds.get(row, "greedy")
        return lambda key, predicted: self.stats.estimate((*key, kind), predicted)

    @property
    def has_cheap_drafts(self) -> bool:
        """Whether steps can draft without the RNN (context lookup, datastore, earlier answers)."""
        return bool(self.indexes) or self.datastore is not None or self.answers is not None

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
        """After a step: what was accepted (``accept``'s path and counts)."""
        paths, counts = paths.tolist(), num_accepted.tolist()
        self.stats.observe_step(trees, paths, counts)
        if self.history is not None:
            self.history.observe_step(trees, paths, counts)
        if self.pending is None:
            return
        mode, predicted, one_node = self.pending
        tokens, past = float(np.sum(num_accepted + 1)), self.measured[mode]
        m = MEASURED_MEMORY
        self.measured[mode] = (tokens, predicted) if past is None else (m * past[0] + (1 - m) * tokens, m * past[1] + (1 - m) * predicted)
        if self.has_drafter and self.has_cheap_drafts and None not in (self.rate("rnn"), self.rate("lookup")):
            self.rnn_on = self.rate("rnn") >= self.rate("lookup")
        self.window.append((tokens, predicted, one_node, len(trees)))
        if self.idle >= IDLE_STEPS or self._losing():
            self.plain_left, self.idle = PLAIN_STEPS, 0
            self.window.clear()

    def _losing(self) -> bool:
        """Whether the last ``WINDOW`` drafting steps produced fewer tokens
        per curve second than plain steps would (one token per row each
        ``one_node`` seconds)."""
        if len(self.window) < WINDOW:
            return False
        tokens, predicted, one_node, rows = (sum(column) for column in zip(*self.window))
        return tokens * one_node < rows * predicted
