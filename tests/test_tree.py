"""Tree packing on hand-made beams."""

import mlx.core as mx
import numpy as np

from redrafter_mlx.tree import pack_beams

# Mars=1 is=2 a=3 red=4 reddish=5 when=6 dark=7
MARS = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 7, 4]]


def packed(beams):
    tree = pack_beams(mx.array(beams))
    n = int(tree.num_nodes.max())
    return tree, tree.truncate(n), n


def test_shared_prefixes_pack_into_eight_nodes():
    tree, small, n = packed([MARS])
    assert n == 8
    assert small.tokens[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 4]
    assert small.depths[0].tolist() == [0, 1, 2, 3, 2, 3, 2, 3]
    assert small.unpack[0].tolist() == [[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 6, 7]]
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
    assert (np.array(small.mask[0]) == expected).all()


def test_round_trip_and_batch_rows_of_different_sizes():
    beams = [
        MARS,
        [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]],  # all identical: 4 nodes
        [[9, 8, 7, 6], [9, 5, 7, 6], [9, 5, 7, 0]],  # 4 + 3 + 1 = 8 nodes
    ]
    tree, small, n = packed(beams)
    assert tree.num_nodes.tolist() == [8, 4, 8]
    b = mx.array(beams)
    round_trip = mx.take_along_axis(small.tokens, small.unpack.reshape(3, -1), axis=-1).reshape(b.shape)
    assert (round_trip == b).all()
    # Padding nodes are never attended to.
    mask = np.array(small.mask[1])
    assert not mask[:, 4:].any()
    # Depth = beam position, for every beam position.
    depths = mx.take_along_axis(small.depths, small.unpack.reshape(3, -1), axis=-1).reshape(b.shape)
    assert (depths == mx.arange(4)).all()


def test_ancestors_are_exactly_the_prefix_nodes():
    rng = np.random.default_rng(0)
    beams = rng.integers(0, 3, size=(4, 6, 5))
    beams[:, :, 0] = 1
    tree, small, n = packed(beams.tolist())
    for row in range(4):
        tokens, depths, mask = (np.array(x[row]) for x in (small.tokens, small.depths, small.mask))
        unpack = np.array(small.unpack[row])
        for w in range(6):
            for l in range(5):
                node = unpack[w, l]
                assert tokens[node] == beams[row, w, l] and depths[node] == l
                assert set(np.flatnonzero(mask[node])) == set(unpack[w, : l + 1])
        # No two real nodes hold the same prefix.
        prefixes = {tuple(beams[row, w, : l + 1]) for w in range(6) for l in range(5)}
        assert int(tree.num_nodes[row]) == len(prefixes)
