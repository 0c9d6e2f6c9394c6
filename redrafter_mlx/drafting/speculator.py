"""What each step verifies: the RNN's beams, context-lookup continuations and
datastore continuations, merged into one prefix tree per row and pruned to
the nodes worth their verification cost.

``Speculator`` owns the per-run state: a lookup index per prompt, the
on-line acceptance statistics, the machine's cost curve, and whether the
RNN is worth running at all: its beam search costs time too, so the tokens
per second of steps with and without its beams are compared, and when
the cheap sources alone (lookup and datastore) do better it is turned off,
and tried again now and then.
A mode's rate counts the tokens its steps really produced (the estimates
that choose the nodes run high: the nodes kept are those whose estimates
came out highest) over their seconds on the cost curve; until steps
without the RNN (mode "lookup") have run, their rate is the estimate.
"""

from typing import Optional

import numpy as np

from .budget import AcceptanceStats, best_node_count
from .datastore import Datastore
from .lookup import LookupIndex
from .settings import DraftSettings
from .tree import RowTree, beam_drafts, candidate_tree, datastore_drafts, lookup_drafts, most_likely_nodes, prune

RNN_RETRY_STEPS = 16  # with the RNN turned off, run it again every this many steps
EXPLORE_STEPS = 8  # every this many steps, verify one node more than the budget chose
RATE_MEMORY = 0.8  # weight of the past in the running estimate of lookup alone
MEASURED_MEMORY = 0.7  # weight of the past in the running measured tokens and seconds
CARRIED_WEIGHT = 4.0  # predicted mass (a few steps' worth) that earlier runs' statistics weigh as


class Speculator:
    """Per-run drafting state for a batch: ``track`` each prompt (its
    context list, the row tracker's, which grows as tokens are committed)
    before it drafts, ``drop`` it when it leaves.

    history: what earlier runs of this model and drafter had accepted
    (``ReDrafter.acceptance``); this run starts from it and adds to it.
    datastore: the drafter's ``Datastore`` (None: no datastore drafts)."""

    def __init__(self, settings: DraftSettings, has_drafter: bool, history: Optional[AcceptanceStats] = None, datastore: Optional[Datastore] = None):
        self.settings = settings
        self.has_drafter = has_drafter
        self.datastore = datastore if settings.datastore_beams else None
        self.contexts = {}
        self.history = history
        self.stats = AcceptanceStats() if history is None else history.as_prior(CARRIED_WEIGHT)
        self.indexes = {}
        self.rnn_on = has_drafter
        self.lookup_estimate = None  # running estimated tokens/s without the RNN, before such steps ran
        self.measured = {"rnn": None, "lookup": None}  # running (tokens, seconds) of the steps of each mode
        self.pending = None  # (mode, seconds on the cost curve) of the step being verified
        self.steps_off = 0
        self.steps = 0

    def track(self, row: int, context: list) -> None:
        self.contexts[row] = context
        if self.settings.lookup:
            self.indexes[row] = LookupIndex(context, self.settings.lookup_max_ngram)

    def drop(self, row: int) -> None:
        self.indexes.pop(row, None)
        self.contexts.pop(row, None)

    def use_rnn(self) -> bool:
        """Whether the next step drafts with the RNN."""
        if not self.has_drafter:
            return False
        if self.rnn_on:
            return True
        self.steps_off += 1
        return self.steps_off % RNN_RETRY_STEPS == 0

    def trees(self, rows: list, roots: list, beams: Optional[np.ndarray], conditionals: Optional[np.ndarray], cost=None) -> list[RowTree]:
        """The tree each row verifies. rows: the prompt of each batch row;
        roots: each row's last chosen token; beams (B, W, L) and
        conditionals (B, W, L - 1): the RNN's beams (partial ones ending at
        NO_TOKEN) and the drafter's probability of each drafted token, or
        None when it did not run.
        cost: the cost curve (``CostCurve``) when ``max_nodes`` is None."""
        estimate = self.stats.estimate
        cheap = [self._cheap_drafts(r, estimate) for r in rows]
        rnn = [[] for _ in rows] if beams is None else [beam_drafts(b, c, estimate) for b, c in zip(beams, conditionals)]
        candidates = [candidate_tree(root, a + b) for root, a, b in zip(roots, rnn, cheap)]
        self.pending = None
        if self.settings.max_nodes is not None:
            return [prune(t, self.settings.max_nodes) for t in candidates]
        gains = [most_likely_nodes(t) for t in candidates]
        draft_seconds = cost.draft_seconds if beams is not None else 0.0
        count, _ = best_node_count(gains, cost, max(map(len, gains)), draft_seconds)
        self.steps += 1
        if self.steps % EXPLORE_STEPS == 0:
            # Nodes left out are never observed, so their estimates would
            # never recover: now and then one more is tried.
            count += 1
        mode = "rnn" if beams is not None else "lookup"
        self.pending = mode, cost(count + 1) + draft_seconds
        if beams is not None and self.has_cheap_drafts and self.measured["lookup"] is None:
            cheap_only = [most_likely_nodes(candidate_tree(root, d)) for root, d in zip(roots, cheap)]
            rate = best_node_count(cheap_only, cost, max(map(len, cheap_only)))[1]
            past = self.lookup_estimate
            self.lookup_estimate = rate if past is None else RATE_MEMORY * past + (1 - RATE_MEMORY) * rate
        return [prune(t, count) for t in candidates]

    @property
    def has_cheap_drafts(self) -> bool:
        """Whether steps can draft without the RNN (context lookup or datastore)."""
        return bool(self.indexes) or self.datastore is not None

    def _cheap_drafts(self, row: int, estimate) -> list:
        """A row's drafts that need no drafter run: context lookup's and the datastore's."""
        settings = self.settings
        drafts = lookup_drafts(self.indexes[row].propose(settings.lookup_length), estimate) if row in self.indexes else []
        if self.datastore is not None:
            drafts += datastore_drafts(self.datastore.propose(self.contexts[row], settings.beam_length - 1, settings.datastore_beams), estimate)
        return drafts

    def rate(self, mode: str) -> Optional[float]:
        """Tokens per second of the steps verified with (``"rnn"``) or
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
        mode, seconds = self.pending
        tokens = float(np.sum(num_accepted + 1))
        past = self.measured[mode]
        m = MEASURED_MEMORY
        self.measured[mode] = (tokens, seconds) if past is None else (m * past[0] + (1 - m) * tokens, m * past[1] + (1 - m) * seconds)
        if self.has_drafter and self.has_cheap_drafts and None not in (self.rate("rnn"), self.rate("lookup")):
            self.rnn_on = self.rate("rnn") >= self.rate("lookup")
