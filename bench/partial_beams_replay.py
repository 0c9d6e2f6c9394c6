"""Partial beams at equal verification cost, replayed on a greedy
distillation folder without the base model (greedy only).

A beam search of width W holds W partial beams at every depth; the final
beams extend only some of them. ``generate`` offers the tree the partial
beams too (``DraftSettings.partial_beams``) and keeps the nodes most likely
to be accepted. This replay compares, at every position, the tree of the
final beams with the tree of final and partial beams pruned to the same
number of nodes (the final beams' own node count, and fixed budgets), each
node ranked by the drafter's probability of its path, as ``prune`` ranks
them before ``generate`` has calibrated its estimates. A step accepts the
longest tree path that matches the base model's greedy continuation; with
``--lookup`` one context-lookup continuation of ``--lookup-length`` tokens
(generate's default unless given; 4 before session 25) joins both trees
unpruned (the longer agreeing prefix of the two counts, as
``replay.with_continuation``); with
``--datastore N``, N continuations from the drafter's datastore join them
too, unpruned (figures named ``+datastore``).

    python bench/partial_beams_replay.py --drafter DRAFTER --data data/eval-dev-smollm2-135m --shapes 4x5
"""

import argparse
import json

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx
import numpy as np

from redrafter_mlx.beam_search import beam_search
from redrafter_mlx.datastore import load_datastore
from redrafter_mlx.drafting import DraftSettings
from redrafter_mlx.drafter import load_drafter
from redrafter_mlx.errors import UserError
from redrafter_mlx.replay import datastore_lengths, load_greedy_folder, step_figures, with_continuation
from redrafter_mlx.train import build_positions, cached_positions
from redrafter_mlx.tree import beam_drafts, candidate_tree, prune


def accepted_in(tree, window) -> int:
    """Drafted tokens of the tree's longest path that matches window[1:]
    (window[0] is the root; -1 ends the sequence)."""
    children = {}
    for i in range(1, tree.num_nodes):
        children.setdefault(tree.parents[i], {})[tree.tokens[i]] = i
    node, depth = 0, 0
    for token in window[1:].tolist():
        node = children.get(node, {}).get(token)
        if node is None:
            return depth
        depth += 1
    return depth


def replay_shape(drafter, embed, hidden, windows, width, length, budgets, batch_size=1024) -> dict:
    """Per budget ("same" = the final beams' node count, or a number):
    (R,) drafts accepted with the final beams' tree and with the final and
    partial beams' tree, both pruned to it."""
    identity = lambda key, p: p
    out = {b: {"final": [], "partial": []} for b in ["same"] + budgets}
    nodes = []
    for start in range(0, len(windows), batch_size):
        window = windows[start : start + batch_size, :length]
        h = mx.array(hidden[start : start + batch_size].astype(np.float32))
        beams, logprobs = beam_search(drafter, embed, h, mx.array(window[:, 0]), width, length, partial=True)
        beams, probs = np.array(beams), np.array(mx.exp(logprobs))
        for row, (b, p) in enumerate(zip(beams, probs)):
            root, drafts = int(b[0, 0]), beam_drafts(b, p, identity)
            final, both = candidate_tree(root, drafts[:width]), candidate_tree(root, drafts)
            nodes.append(final.num_nodes - 1)
            out["same"]["final"].append(accepted_in(final, window[row]))
            out["same"]["partial"].append(accepted_in(prune(both, final.num_nodes - 1), window[row]))
            for budget in budgets:
                out[budget]["final"].append(accepted_in(prune(final, budget), window[row]))
                out[budget]["partial"].append(accepted_in(prune(both, budget), window[row]))
    out = {b: {k: np.array(v) for k, v in r.items()} for b, r in out.items()}
    return out, float(np.mean(nodes))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="The base model the data was distilled from (default: the embedded one).")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--data", required=True, help="A greedy distillation data folder, held out from the drafter's training.")
    parser.add_argument("--shapes", default="2x5,4x5,8x5")
    parser.add_argument("--budgets", default="4,8,12,16", help="Fixed node budgets, comma-separated, besides the final beams' own count.")
    parser.add_argument("--lookup", action="store_true")
    parser.add_argument("--lookup-length", type=int, default=DraftSettings.lookup_length, help="Tokens the lookup continuation drafts (default: generate's).")
    parser.add_argument("--datastore", type=int, default=0, help="Also add this many continuations from the drafter's datastore to both trees.")
    args = parser.parse_args()
    if args.lookup_length < 1:
        parser.error(f"--lookup-length must be at least 1, got {args.lookup_length}")

    base, sequences, hidden = load_greedy_folder(args.data, args.model)
    drafter = load_drafter(args.drafter)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    budgets = [int(b) for b in args.budgets.split(",") if b]
    positions = build_positions(sequences, max(length for _, length in shapes) - 1, 0.0, lookup_length=args.lookup_length if args.lookup else 0)
    counts = cached_positions(sequences)
    windows, row_hidden = positions.tokens, hidden[positions.hidden_row]
    lookup = positions.lookup_depth if args.lookup else None
    stored = None
    if args.datastore:
        datastore = load_datastore(args.drafter, base.vocab_size, required=True)
        stored = datastore_lengths(datastore, sequences, np.ones(len(counts), bool), windows.shape[1] - 1, args.datastore)
    for width, length in shapes:
        accepted, nodes = replay_shape(drafter, base.embed, row_hidden, windows, width, length, budgets)
        result = {"drafter": args.drafter, "data": args.data, "shape": f"{width}x{length}", "final_beam_nodes": round(nodes, 2)}
        for budget, runs in accepted.items():
            for kind, a in runs.items():
                result.update(step_figures(f"{kind}@{budget}", a, counts, lookup, args.lookup_length))
                if stored is not None:
                    result.update(step_figures(f"{kind}@{budget}+datastore", with_continuation(a, stored, length - 1), counts, lookup, args.lookup_length))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
