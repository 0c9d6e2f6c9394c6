"""Which nodes should a step keep? Greedy generation replayed at a fixed node
budget, with the engine's own candidate trees, on a greedy distillation
folder (no base-model pass: its answers and hidden states are the folder's).

At every step the candidate tree is built as ``Speculator.trees`` builds it
(the RNN's final and partial beams, one context-lookup continuation, the
datastore's continuations), its nodes ranked by a ranking rule, the best K
kept, and the step accepts the longest kept path that the greedy answer
follows. Acceptance statistics are carried from step to step and sequence to
sequence, as in a process that serves many requests. Reports tokens per
step at each K for each rule, and how well each rule's estimates are
calibrated (predicted against accepted, by source and depth).

Rules: ``engine`` (the engine's: each draft's calibrated conditionals
multiplied along its path), ``oracle`` (the K nodes of the answer's own path
first: the ceiling at K). Others are added here while they are studied.

    python3 bench/research/ranking/replay_ranking.py --data data/eval-tune-smollm2-135m --budgets 2,4,6,8
"""

import argparse
import json
from collections import defaultdict

import redrafter_mlx  # noqa: E402, F401  (loads OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
import numpy as np

from redrafter_mlx.drafting.beam_search import beam_search
from redrafter_mlx.drafting.budget import AcceptanceStats
from redrafter_mlx.drafting.datastore import load_datastore
from redrafter_mlx.drafting.drafter import load_drafter
from redrafter_mlx.drafting.lookup import LookupIndex
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.drafting.tree import beam_drafts, candidate_tree, datastore_drafts, lookup_drafts, prune
from redrafter_mlx.training.data import build_positions, cached_positions
from redrafter_mlx.training.replay import load_greedy_folder

SHIPPED = "redrafter_mlx/drafters/smollm2-135m-instruct"


def search_all(drafter, embed, hidden, windows, shape, batch_size=1024):
    """Beams (R, rows, L) and conditionals (R, rows, L - 1) at every position."""
    beams, probs = [], []
    for start in range(0, len(windows), batch_size):
        h = mx.array(hidden[start : start + batch_size].astype(np.float32))
        first = mx.array(windows[start : start + batch_size, 0])
        b, lp = beam_search(drafter, embed, h, first, *shape)
        beams.append(np.array(b))
        probs.append(np.array(mx.exp(lp)))
    return np.concatenate(beams), np.concatenate(probs)


def accepted_in(tree, target: list) -> tuple[int, list]:
    """The longest path of ``tree`` the target follows: (drafted tokens
    accepted, the nodes on it, root first)."""
    children = defaultdict(dict)
    for i in range(1, tree.num_nodes):
        children[tree.parents[i]][tree.tokens[i]] = i
    node, path = 0, [0]
    for token in target:
        node = children[node].get(token)
        if node is None:
            break
        path.append(node)
    return len(path) - 1, path


def oracle_prune(tree, budget: int, path: list):
    """The answer's own path first, then the engine's ranking."""
    on_path = set(path)
    tree = type(tree)(
        tree.tokens,
        tree.parents,
        tree.depths,
        [2.0 if i in on_path else p for i, p in enumerate(tree.probs)],
        tree.judged,
    )
    return prune(tree, budget)


def signature(tree, node: int) -> tuple:
    """What a node's acceptance is judged by under the ``combined`` rule: the
    sources that proposed it, its depth, and a bin of its best conditional."""
    sources = tuple(sorted({key[0].rstrip("0123456789") for key, _ in tree.judged[node]}))
    conditional = tree.probs[node] / max(tree.probs[tree.parents[node]], 1e-9)
    return sources, min(tree.depths[node], 4), min(int(conditional * 5), 4)


def recombined(tree, stats: AcceptanceStats):
    """The tree with each node's conditional re-estimated per signature."""
    probs = [1.0] + [0.0] * (tree.num_nodes - 1)
    for node in range(1, tree.num_nodes):
        conditional = tree.probs[node] / max(tree.probs[tree.parents[node]], 1e-9)
        probs[node] = probs[tree.parents[node]] * stats.estimate(("combined",) + signature(tree, node), conditional)
    return type(tree)(tree.tokens, tree.parents, tree.depths, probs, tree.judged)


def replay(sequences, beams, conditionals, starts, counts, datastore, settings, budget, rule):
    stats = AcceptanceStats()
    combined = AcceptanceStats()
    combined.PRIORS = {"combined": (1.0, 2.0)}
    steps = tokens = 0
    calibration = defaultdict(lambda: [0.0, 0.0])  # (source, depth) -> [predicted, accepted]
    for s in range(len(counts)):
        sequence = sequences.sequence(s).tolist()
        p = int(sequences.prompt_lengths[s])
        context = sequence[: p + 1]  # prompt and the first answer token (the prefill's)
        index = LookupIndex(context, settings.lookup_max_ngram)
        t = 0  # answer tokens after the first
        while t < counts[s] - 1:
            row = starts[s] + t
            root, target = context[-1], sequence[p + 1 + t : p + 1 + t + 32]
            drafts = [] if rule == "no-rnn" else beam_drafts(beams[row], conditionals[row], stats.estimate)
            drafts += lookup_drafts(index.propose(settings.lookup_length), stats.estimate)
            if datastore is not None:
                drafts += datastore_drafts(
                    datastore.propose(context, settings.beam_length - 1, settings.datastore_beams), stats.estimate
                )
            full = candidate_tree(root, drafts)
            kept = None
            if rule == "oracle":
                _, path = accepted_in(full, target)
                tree = oracle_prune(full, budget, path)
            elif rule == "combined":
                ranked = recombined(full, combined)
                order = sorted(range(1, full.num_nodes), key=lambda i: (-ranked.probs[i], ranked.depths[i], i))
                kept = [0] + sorted(order[:budget])
                tree = prune(ranked, budget)
            else:
                tree = prune(full, budget)
            accepted, path = accepted_in(tree, target)
            if kept is not None:
                for node in range(1, tree.num_nodes):
                    if tree.parents[node] in path:
                        original = kept[node]
                        conditional = full.probs[original] / max(full.probs[full.parents[original]], 1e-9)
                        combined.observe(("combined",) + signature(full, original), conditional, node in path)
            stats.observe_step([tree], [path], [accepted])
            for node in range(1, tree.num_nodes):
                if tree.parents[node] in path:
                    key = tree.judged[node][0][0]
                    bucket = calibration[(key[0].rstrip("0123456789"), min(key[1], 4))]
                    bucket[0] += tree.probs[node] / max(tree.probs[tree.parents[node]], 1e-9)
                    bucket[1] += node in path
            context.extend(sequence[p + 1 + t : p + 2 + t + accepted])
            t += accepted + 1
            steps += 1
            tokens += accepted + 1
    table = {f"{s}{d}": [round(v[0], 1), round(v[1], 1)] for (s, d), v in sorted(calibration.items())}
    return tokens / steps, table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a greedy distillation folder of prompts nobody tuned on")
    parser.add_argument("--drafter", default=SHIPPED)
    parser.add_argument("--budgets", default="2,4,6,8")
    parser.add_argument("--rules", default="engine,oracle")
    parser.add_argument("--shape", default="4x5")
    args = parser.parse_args()
    width, length = map(int, args.shape.split("x"))
    settings = DraftSettings(beam_width=width, beam_length=length)
    base, sequences, hidden = load_greedy_folder(args.data)
    drafter = load_drafter(args.drafter)
    datastore = load_datastore(args.drafter, base.vocab_size)
    positions = build_positions(sequences, length - 1, 0.0)
    counts = cached_positions(sequences)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    beams, conditionals = search_all(
        drafter, base.embed, hidden[positions.hidden_row], positions.tokens, settings.search_shape(drafter)
    )
    for budget in map(int, args.budgets.split(",")):
        for rule in args.rules.split(","):
            per_step, table = replay(sequences, beams, conditionals, starts, counts, datastore, settings, budget, rule)
            print(
                json.dumps(
                    {
                        "shape": args.shape,
                        "budget": budget,
                        "rule": rule,
                        "tokens_per_step": round(per_step, 3),
                        "calibration": table,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
