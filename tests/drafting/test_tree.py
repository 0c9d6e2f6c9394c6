"""Prefix trees of hand-made drafts: deduplication, estimates, pruning and
the device arrays verification reads."""

import numpy as np

from redrafter_mlx.drafting.tree import (
    NO_TOKEN,
    Draft,
    beam_drafts,
    candidate_tree,
    most_likely_nodes,
    most_likely_path,
    pack,
    prune,
)

# Mars=1 is=2 a=3 red=4 reddish=5 when=6 dark=7
MARS = [[2, 3, 4], [2, 5, 6], [2, 7, 4]]


def drafts(token_lists, estimate=0.5):
    return [
        Draft(t, [("rnn", d + 1) for d in range(len(t))], [estimate] * len(t), [estimate] * len(t)) for t in token_lists
    ]


def test_shared_prefixes_pack_into_eight_nodes():
    tree = candidate_tree(1, drafts(MARS))
    assert tree.tokens == [1, 2, 3, 4, 5, 6, 7, 4]
    assert tree.depths == [0, 1, 2, 3, 2, 3, 2, 3]
    assert tree.parents == [-1, 0, 1, 2, 1, 4, 1, 6]
    assert tree.probs == [1.0, 0.5, 0.25, 0.125, 0.25, 0.125, 0.25, 0.125]
    packed = pack([tree])
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 0, 1, 0],
            [1, 1, 0, 0, 0, 0, 1, 1],
        ],
        dtype=bool,
    )
    assert (np.array(packed.mask[0]) == expected).all()
    assert packed.unpack[0].tolist() == [[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 6, 7]]
    assert packed.beams[0].tolist() == [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 7, 4]]


def test_a_shared_node_takes_the_best_estimate_and_every_draft_judges_it():
    rnn = Draft([2, 3], [("rnn", 1), ("rnn", 2)], [0.4, 0.5], [0.4, 0.5])
    lookup = Draft([2, 9], [("lookup3", 1), ("lookup3", 2)], [0.9, 0.9], [1.0, 1.0])
    tree = candidate_tree(1, [rnn, lookup])
    assert tree.tokens == [1, 2, 3, 9]
    assert np.allclose(tree.probs, [1.0, 0.9, 0.2, 0.81])
    assert tree.judged[1] == [(("rnn", 1), 0.4), (("lookup3", 1), 1.0)]


def test_pruning_keeps_the_most_likely_nodes_and_their_ancestors():
    tree = candidate_tree(1, drafts([[2, 3, 4]], 0.9) + drafts([[5, 6]], 0.5))
    assert most_likely_nodes(tree) == sorted(tree.probs[1:], reverse=True)
    small = prune(tree, 3)
    assert small.tokens == [1, 2, 3, 4]
    assert small.parents == [-1, 0, 1, 2]
    smaller = prune(tree, 2)
    assert smaller.tokens == [1, 2, 3]
    none = prune(tree, 0)
    assert none.tokens == [1] and none.leaves() == [0]


def test_a_partial_beam_ends_at_its_first_padding_token_and_can_outrank_a_final_one():
    """Final beam Mars is a red (the search's best of three tokens) and
    the partial beam Mars is reddish it held at depth 2: pruned to three
    nodes, the tree keeps reddish (0.6 x 0.5 = 0.3) and drops red
    (0.6 x 0.4 x 0.9 = 0.216)."""
    beams = np.array([[1, 2, 3, 4], [1, 2, 5, NO_TOKEN]])
    conditionals = np.array([[0.6, 0.4, 0.9], [0.6, 0.5, 0.0]])
    beam_list = beam_drafts(beams, conditionals, lambda key, p: p)
    assert [d.tokens for d in beam_list] == [[2, 3, 4], [2, 5]]
    assert beam_list[1].keys == [("rnn", 1), ("rnn", 2)] and beam_list[1].predicted == [0.6, 0.5]
    tree = prune(candidate_tree(1, beam_list), 3)
    assert tree.tokens == [1, 2, 5, 3]  # depth first, the most likely child first


def test_batches_pad_rows_of_different_sizes():
    rows = [candidate_tree(1, drafts(MARS)), prune(candidate_tree(8, drafts([[9, 9]])), 1), candidate_tree(5, [])]
    packed = pack(rows)
    assert packed.num_nodes == [8, 2, 1]
    assert packed.tokens.shape == (3, 8)
    assert packed.beams.shape == (3, 3, 4)
    beams, unpack, tokens = np.array(packed.beams), np.array(packed.unpack), np.array(packed.tokens)
    real = beams != NO_TOKEN
    assert (np.take_along_axis(tokens[:, None, :].repeat(3, 1), unpack, axis=2)[real] == beams[real]).all()
    assert beams[1, 0].tolist() == [8, 9, NO_TOKEN, NO_TOKEN]
    assert beams[2, 0].tolist() == [5, NO_TOKEN, NO_TOKEN, NO_TOKEN]
    mask = np.array(packed.mask)
    assert mask[1, :, :].tolist()[2] == [False, False, True, False, False, False, False, False]  # padding sees itself


def test_the_most_likely_path_comes_first_so_that_its_commit_moves_nothing():
    """Pruned nodes are in depth-first order, the most likely child first:
    the most likely path is nodes 0, 1, 2, ...; every node still comes after
    its parent."""
    drafts = [
        Draft([5, 6, 7], [("rnn", d) for d in (1, 2, 3)], [0.5, 0.5, 0.5], [0.5] * 3),
        Draft([8, 9], [("lookup", d) for d in (1, 2)], [0.9, 0.9], [0.9] * 2),
        Draft([8, 4], [("rnn", d) for d in (1, 2)], [0.9, 0.2], [0.9, 0.2]),
    ]
    tree = prune(candidate_tree(1, drafts), 5)
    assert tree.tokens[:3] == [1, 8, 9]
    assert all(tree.parents[i] < i for i in range(1, tree.num_nodes))
    assert most_likely_path(tree).tokens == tree.tokens[:3]
