"""Tree verification on hand-built trees: the walk follows the base model's
choice at every node, as long as a child holds it."""

import mlx.core as mx
import numpy as np

from redrafter_mlx.drafting.tree import RowTree, pack
from redrafter_mlx.engine.acceptance import accept


def tree_of(tokens: list, parents: list) -> RowTree:
    depths = [0]
    for parent in parents[1:]:
        depths.append(depths[parent] + 1)
    return RowTree(tokens, parents, depths, [1.0] * len(tokens), [[] for _ in tokens])


# Root 7 -> 1 -> 2 -> 3, and 7 -> 1 -> 4, and 7 -> 5. Packed node order is
# the order given: 0:7 1:1 2:2 3:3 4:4 5:5.
TREE = tree_of([7, 1, 2, 3, 4, 5], [-1, 0, 1, 2, 1, 0])


def run(trees: list, choices: list, hidden_size: int = 2):
    packed = pack(trees)
    nodes = packed.tokens.shape[1]
    padded = [c + [0] * (nodes - len(c)) for c in choices]
    # Each node's hidden state is its index, so next_hidden names the node.
    hidden = mx.broadcast_to(mx.arange(nodes, dtype=mx.float32)[None, :, None], (len(trees), nodes, hidden_size))
    return packed, accept(packed.beams, packed.unpack, mx.array(padded, mx.int32), hidden)


def test_the_walk_takes_the_deepest_path_the_choices_agree_with():
    # Choices after each node: 7 -> 1 (node 1), 1 -> 2 (node 2), 2 -> 3 (node 3), 3 -> 9 (bonus).
    packed, step = run([TREE], [[1, 2, 3, 9, 0, 0]])
    assert int(step.num_accepted[0]) == 3
    assert np.array(step.tokens)[0, :4].tolist() == [1, 2, 3, 9]
    assert np.array(step.path)[0, :4].tolist() == [0, 1, 2, 3]
    assert int(step.next_token[0]) == 9 and float(step.next_hidden[0, 0]) == 3.0


def test_a_side_branch_is_followed_when_the_choice_leaves_the_first_beam():
    # 7 -> 1, then 1 -> 4 (node 4, not node 2), then 4 -> 8: bonus.
    _, step = run([TREE], [[1, 4, 0, 0, 8, 0]])
    assert int(step.num_accepted[0]) == 2
    assert np.array(step.tokens)[0, :3].tolist() == [1, 4, 8]
    assert np.array(step.path)[0, :3].tolist() == [0, 1, 4]
    assert float(step.next_hidden[0, 0]) == 4.0


def test_no_child_holding_the_choice_gives_only_the_bonus_token():
    _, step = run([TREE], [[6, 2, 3, 0, 0, 0]])
    assert int(step.num_accepted[0]) == 0
    assert int(step.tokens[0, 0]) == 6 and int(step.path[0, 0]) == 0 and float(step.next_hidden[0, 0]) == 0.0


def test_rows_of_a_batch_walk_their_own_trees_and_padding_never_matches():
    small = tree_of([4, 5], [-1, 0])  # padded to TREE's 6 nodes and 3 beams
    _, step = run([TREE, small], [[5, 0, 0, 0, 0, 0], [5, 6]])
    assert np.array(step.num_accepted).tolist() == [1, 1]
    assert np.array(step.tokens)[:, :2].tolist() == [[5, 0], [5, 6]]
    assert np.array(step.path)[:, :2].tolist() == [[0, 5], [0, 1]]
    assert np.array(step.next_token).tolist() == [0, 6]
