"""How many tree nodes to verify: the machine's own cost of a verification
pass against the expected number of accepted tokens.

A pass over N new tokens costs cost(N) seconds (``cost.CostCurve``); a tree
of K drafted nodes whose nodes are accepted with probabilities p_i yields
1 + sum(p_i) tokens in expectation (at most one node per depth is accepted,
so the expected accepted length is the sum over nodes). Each step keeps the
K that maximises (1 + sum of the K best p_i) / cost(K + 1); K = 0 is plain
decoding. The p_i come from the drafts' own predictions, calibrated by what
this run has seen accepted (``AcceptanceStats``), since a drafter's
probabilities are not calibrated and a lookup makes no prediction at all.
A run starts from what earlier runs of the same model and drafter saw
(``AcceptanceStats.as_prior``), weighted as a few steps' worth so that the
run's own statistics soon decide: a short answer has no steps to spend on
learning that the drafter is over-confident.
"""

from collections import defaultdict, deque
from typing import Optional

KEPT_SEARCHES = 8  # full-length searches whose kept depths are remembered


class AcceptanceStats:
    """Accepted versus predicted, per statistics key (source and depth).

    ``estimate(key, predicted)`` is ``predicted`` scaled by the key's
    accepted / predicted ratio so far, starting from a prior (ratio, weight
    in predicted mass) before anything is seen: ``priors``' entry for the
    key, else the source's default (``PRIORS``). Only drafted tokens whose
    prefix was accepted are observed, so the ratio is conditional.
    """

    # (accepted / predicted, weight in predicted mass) before a source is seen;
    # the datastore's shares run high (bench/research/datastore/).
    PRIORS = {"rnn": (1.0, 2.0), "lookup": (0.5, 2.0), "datastore": (0.8, 2.0), "answers": (0.8, 2.0)}

    def __init__(self, priors: Optional[dict] = None):
        self.priors = priors or {}
        self.accepted = defaultdict(float)
        self.predicted = defaultdict(float)
        # The depths the trees of the last full-length searches kept RNN
        # nodes at (``policy.SearchDepth.next_length``), carried from
        # run to run as the statistics are.
        self.kept_depths: deque = deque(maxlen=KEPT_SEARCHES)

    def _prior(self, key) -> tuple[float, float]:
        """A key's (ratio, weight) before its own observations: the earlier
        runs' (``priors``); else, for a copy (lookup, datastore, earlier
        answers) at a depth not seen yet, the ratio its source showed at the
        deepest shallower depth seen, since a copy that is right tends to
        stay right (the default prior would halve each deeper node's
        estimate, and a long copy would be verified a node deeper every few
        steps only); else the source's default."""
        if key in self.priors:
            return self.priors[key]
        source, default = key[0], self.PRIORS[key[0].rstrip("0123456789")]  # lookup3 -> lookup
        if source != "rnn" and len(key) > 1:
            for depth in range(key[1] - 1, 0, -1):
                shallower = (source, depth, *key[2:])
                if shallower in self.priors or self.predicted.get(shallower):
                    ratio, weight = self._prior(shallower)
                    return (
                        (ratio * weight + self.accepted.get(shallower, 0.0))
                        / (weight + self.predicted.get(shallower, 0.0)),
                        default[1],
                    )
        return default

    def as_prior(self, weight: float) -> "AcceptanceStats":
        """Fresh statistics whose priors are these ratios (prior included),
        each weighted as at most ``weight`` of predicted mass."""
        priors = {}
        for key, predicted in self.predicted.items():
            ratio, prior_weight = self._prior(key)
            seen = ratio * prior_weight + self.accepted[key]
            priors[key] = (seen / (prior_weight + predicted), min(weight, prior_weight + predicted))
        return AcceptanceStats(priors)

    def estimate(self, key, predicted: float) -> float:
        ratio, weight = self._prior(key)
        scale = (ratio * weight + self.accepted[key]) / (weight + self.predicted[key])
        return min(1.0, predicted * scale)

    def observe(self, key, predicted: float, accepted: bool) -> None:
        self.accepted[key] += float(accepted)
        self.predicted[key] += predicted

    def observe_step(self, rows: list, paths: list, num_accepted: list) -> None:
        """After a step: rows (RowTree), each row's packed accepted path and
        accepted count. Every verified node whose parent was accepted is one
        observation, for the draft whose estimate the node's was (the
        highest). Counted for every draft through it, a node that several
        sources agree on (accepted far more often than either alone) would
        lift the ratio of the weaker source, whose lone nodes would then be
        estimated too high."""
        for row, path, n in zip(rows, paths, num_accepted):
            accepted = set(path[: n + 1])
            for node in range(1, row.num_nodes):
                if row.parents[node] in accepted:
                    key, predicted = max(row.judged[node], key=lambda judged: self.estimate(*judged))
                    self.observe(key, predicted, node in accepted)


def best_node_count(
    gains: list[list[float]], cost, max_nodes: int, extra_seconds: float = 0.0, plain_seconds: Optional[float] = None
) -> tuple[int, float]:
    """The K in 0 .. max_nodes maximising expected tokens per second over the
    batch, sum over rows of (1 + the K best p_i) / (cost(K + 1) + extra);
    returns (K, that rate). K = 0 is a plain step: one token per row in
    ``plain_seconds`` (default: a pass of one token plus the extra).

    gains: per row, P(accepted) of its candidate nodes, best first.
    cost: n -> seconds of a verification pass of n new tokens per row.
    extra_seconds: what a drafting step costs besides its pass (its fixed
    cost, and producing the candidates).
    """
    best, best_rate = 0, len(gains) / (cost(1) + extra_seconds if plain_seconds is None else plain_seconds)
    totals = [0.0] * len(gains)
    for k in range(1, max_nodes + 1):
        for r, row in enumerate(gains):
            if k <= len(row):
                totals[r] += row[k - 1]
        rate = sum(1 + t for t in totals) / (cost(k + 1) + extra_seconds)
        if rate > best_rate:
            best, best_rate = k, rate
        if all(k >= len(row) for row in gains):
            break
    return best, best_rate
