"""Dynamic tree attention: deduplicate drafts that share prefixes into one
prefix tree that the base model verifies in a single forward pass, keeping
only the nodes most likely to be accepted.

Drafts ``Mars is a red / Mars is reddish when / Mars is dark red`` share
``Mars is``; packed, they are 8 nodes instead of 12. Drafts come from any
deterministic source (the RNN's beams, context lookup, a datastore); each
drafted token carries an estimate of P(accepted | its prefix accepted), so each node has
P(accepted) = the product along its path (the best over the drafts through
it). The ``max_nodes`` most likely nodes form an ancestor-closed subtree,
since a node is never more likely than its parent. Node order keeps every
node after its ancestors; the root, the last token already chosen, is node
0. Built on the host from a few dozen drafted tokens per row.
"""

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

NO_TOKEN = -1  # pads beams past their end; matches no choice


@dataclass
class Draft:
    """One drafted continuation of a row.

    tokens: the drafted tokens after the root.
    keys: per token, the statistics key it is judged by (source and depth).
    estimates: per token, P(accepted | the tokens before it accepted).
    predicted: per token, the source's own prediction (the drafter's
        probability; 1 for lookup), what ``AcceptanceStats`` calibrates.
    """

    tokens: list
    keys: list
    estimates: list
    predicted: list


@dataclass
class RowTree:
    """One row's pruned tree, on the host.

    tokens, parents, depths: per node (parent -1 for the root).
    probs: per node, estimated P(accepted).
    judged: per node, the (key, predicted) pairs of the drafts through it.
    """

    tokens: list
    parents: list
    depths: list
    probs: list
    judged: list = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def leaves(self) -> list[int]:
        has_child = set(self.parents)
        return [i for i in range(self.num_nodes) if i not in has_child]

    def path(self, node: int) -> list[int]:
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]


def candidate_tree(root: int, drafts: list[Draft]) -> RowTree:
    """The prefix tree of all drafts (root first, each node after its
    parent), with each node's estimated P(accepted)."""
    tree = RowTree([root], [-1], [0], [1.0], [[]])
    children = [{}]
    for draft in drafts:
        node, prob = 0, 1.0
        for token, key, estimate, predicted in zip(draft.tokens, draft.keys, draft.estimates, draft.predicted):
            prob *= min(max(estimate, 0.0), 1.0)
            child = children[node].get(token)
            if child is None:
                child = children[node][token] = tree.num_nodes
                tree.tokens.append(token)
                tree.parents.append(node)
                tree.depths.append(tree.depths[node] + 1)
                tree.probs.append(prob)
                tree.judged.append([])
                children.append({})
            tree.probs[child] = max(tree.probs[child], prob)
            tree.judged[child].append((key, predicted))
            node, prob = child, tree.probs[child]
    return tree


def most_likely_nodes(tree: RowTree) -> list[float]:
    """P(accepted) of the non-root nodes, best first: the gain of keeping
    the first K is the sum of the first K."""
    return sorted(tree.probs[1:], reverse=True)


def most_likely_path(tree: RowTree) -> RowTree:
    """The tree's most likely root-to-leaf path, as a tree of its own: from
    the root, each time the child most likely to be accepted. What a model
    with recurrent layers verifies (``engine.recurrent``); pruned, it stays
    a path, since a node is never more likely than its parent."""
    children = {}
    for i in range(1, tree.num_nodes):
        children.setdefault(tree.parents[i], []).append(i)
    nodes = [0]
    while nodes[-1] in children:
        nodes.append(max(children[nodes[-1]], key=lambda i: (tree.probs[i], -i)))
    return RowTree(
        [tree.tokens[i] for i in nodes],
        list(range(-1, len(nodes) - 1)),
        list(range(len(nodes))),
        [tree.probs[i] for i in nodes],
        [tree.judged[i] for i in nodes],
    )


def prune(tree: RowTree, max_nodes: int) -> RowTree:
    """Keep the root and the ``max_nodes`` most likely other nodes (ties go
    to the shallower, then the earlier node, so parents come first), in
    depth-first order with the most likely child first: the most likely
    path is nodes 0, 1, 2, ..., so that when it is the one accepted its
    keys and values are in place already (nothing to copy at commit)."""
    ranked = sorted(range(1, tree.num_nodes), key=lambda i: (-tree.probs[i], tree.depths[i], i))
    chosen = set(ranked[:max_nodes])
    children: dict = {}
    for i in sorted(chosen):
        children.setdefault(tree.parents[i], []).append(i)
    kept, stack = [], [0]
    while stack:
        node = stack.pop()
        kept.append(node)
        stack += sorted(children.get(node, ()), key=lambda i: (tree.probs[i], -i))  # the most likely popped first
    new_index = {old: new for new, old in enumerate(kept)}
    return RowTree(
        [tree.tokens[i] for i in kept],
        [new_index[tree.parents[i]] if i else -1 for i in kept],
        [tree.depths[i] for i in kept],
        [tree.probs[i] for i in kept],
        [tree.judged[i] for i in kept],
    )


@dataclass
class Tree:
    """A batch of pruned trees as device arrays, padded to ``nodes`` per row.

    tokens: (batch, nodes) token id of each node.
    depths: (batch, nodes) depth of each node; the root is 0.
    mask: (batch, nodes, nodes) bool, node i may attend to node j: j is i or
        one of its ancestors (a padding node sees only itself).
    beams: (batch, leaves, length) the root-to-leaf paths' tokens, padded
        with NO_TOKEN; a padding beam repeats the first.
    unpack: (batch, leaves, length) the node index of each beam position
        (past a beam's end, its leaf), so ``tokens[unpack] == beams`` where
        beams hold a token.
    num_nodes: (batch,) host list of real nodes per row.
    """

    tokens: mx.array
    depths: mx.array
    mask: mx.array
    beams: mx.array
    unpack: mx.array
    num_nodes: list


def pack(rows: list[RowTree]) -> Tree:
    """Device arrays for a batch of row trees."""
    nodes = max(r.num_nodes for r in rows)
    paths = [[r.path(leaf) for leaf in r.leaves()] for r in rows]
    leaves = max(len(p) for p in paths)
    length = max(len(path) for p in paths for path in p)  # never past the nodes: the cache holds no more
    batch = len(rows)
    tokens = np.zeros((batch, nodes), np.int32)
    depths = np.zeros((batch, nodes), np.int32)
    mask = np.broadcast_to(np.eye(nodes, dtype=bool), (batch, nodes, nodes)).copy()
    beams = np.full((batch, leaves, length), NO_TOKEN, np.int32)
    unpack = np.zeros((batch, leaves, length), np.int32)
    for b, (row, row_paths) in enumerate(zip(rows, paths)):
        n = row.num_nodes
        tokens[b, :n], depths[b, :n] = row.tokens, row.depths
        for i in range(1, n):
            mask[b, i, :n] |= mask[b, row.parents[i], :n]
        row_paths = row_paths + [row_paths[0]] * (leaves - len(row_paths))
        for w, path in enumerate(row_paths):
            beams[b, w, : len(path)] = [row.tokens[i] for i in path]
            unpack[b, w, : len(path)] = path
            unpack[b, w, len(path) :] = path[-1]
    return Tree(
        mx.array(tokens),
        mx.array(depths),
        mx.array(mask),
        mx.array(beams),
        mx.array(unpack),
        [r.num_nodes for r in rows],
    )


def beam_drafts(beams: np.ndarray, conditionals: np.ndarray, estimate) -> list[Draft]:
    """One row's RNN beams as drafts. beams (W, L) with column 0 the root,
    each ending at its first NO_TOKEN (a partial beam), conditionals
    (W, L - 1) the drafter's probability of each drafted token given its
    prefix; ``estimate(key, predicted)`` calibrates them."""
    drafts = []
    for tokens, probs in zip(beams[:, 1:].tolist(), conditionals.tolist()):
        if NO_TOKEN in tokens:
            tokens = tokens[: tokens.index(NO_TOKEN)]
            probs = probs[: len(tokens)]
        keys = [("rnn", d) for d in range(1, len(tokens) + 1)]
        drafts.append(Draft(tokens, keys, [estimate(k, p) for k, p in zip(keys, probs)], probs))
    return drafts


def lookup_drafts(proposals: list, estimate) -> list[Draft]:
    """Context-lookup continuations ``(tokens, n)`` as drafts, judged per
    matched n-gram length and depth."""
    drafts = []
    for tokens, n in proposals:
        keys = [(f"lookup{n}", d) for d in range(1, len(tokens) + 1)]
        drafts.append(Draft(tokens, keys, [estimate(k, 1.0) for k in keys], [1.0] * len(tokens)))
    return drafts


def datastore_drafts(proposals: list, estimate, source: str = "datastore") -> list[Draft]:
    """Datastore (or answer store) continuations ``(tokens, shares, n)`` as
    drafts, judged per source, matched n-gram length and depth, each
    token's share its prediction."""
    drafts = []
    for tokens, shares, n in proposals:
        keys = [(f"{source}{n}", d) for d in range(1, len(tokens) + 1)]
        drafts.append(Draft(tokens, keys, [estimate(k, f) for k, f in zip(keys, shares)], shares))
    return drafts
