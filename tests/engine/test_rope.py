"""Per-token positions: a tree token is rotated as the model's own RoPE
module rotates a token at its position."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE, ProportionalRoPE, SuScaledRoPE, YarnRoPE

from redrafter_mlx.engine.rope import MatrixRotation, PairRotation, Rotations, TreeRoPE, install_tree_rope, pairing

HEAD_DIM = 16

ROPES = {
    "rope": lambda: nn.RoPE(HEAD_DIM, base=10000),
    "traditional": lambda: nn.RoPE(HEAD_DIM, traditional=True, base=500),
    "partial": lambda: nn.RoPE(HEAD_DIM // 2, base=10000),
    "scaled": lambda: nn.RoPE(HEAD_DIM, base=10000, scale=0.25),
    "llama3": lambda: Llama3RoPE(
        HEAD_DIM,
        scaling_config={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "yarn": lambda: YarnRoPE(
        HEAD_DIM, scaling_factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.5
    ),
    "su": lambda: SuScaledRoPE(
        HEAD_DIM,
        max_position_embeddings=1024,
        original_max_position_embeddings=64,
        short_factor=[1.0 + i / 8 for i in range(HEAD_DIM // 2)],
        long_factor=[2.0 + i / 4 for i in range(HEAD_DIM // 2)],
    ),
    "proportional": lambda: ProportionalRoPE(HEAD_DIM, rotated_dims=HEAD_DIM // 2, base=10000),
}


def one_by_one(rope, x, positions):
    """Each token rotated alone by the module at its position: (B, H, N, D)."""
    rows = []
    for b in range(x.shape[0]):
        tokens = [rope(x[b : b + 1, :, n : n + 1], offset=int(positions[b, n])) for n in range(x.shape[2])]
        rows.append(mx.concatenate(tokens, axis=2))
    return mx.concatenate(rows)


@pytest.mark.parametrize("by_rotations", [True, False], ids=["rotations", "rows"])
@pytest.mark.parametrize("name", sorted(ROPES))
def test_a_token_is_rotated_as_the_module_rotates_it_at_its_position(name, by_rotations):
    rope = ROPES[name]()
    tree = TreeRoPE(rope, Rotations(), by_rotations=by_rotations)
    positions = np.array([[40, 41, 41, 42, 43, 42], [3, 4, 4, 5, 900, 5]])
    x = mx.random.normal((2, 3, positions.shape[1], HEAD_DIM), key=mx.random.key(0))
    got = tree(x, offset=mx.array(positions, mx.int32))
    assert got.shape == x.shape and got.dtype == x.dtype
    np.testing.assert_allclose(np.array(got), np.array(one_by_one(rope, x, positions)), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("by_rotations", [True, False], ids=["rotations", "rows"])
def test_a_half_precision_input_keeps_its_dtype(by_rotations):
    rope = nn.RoPE(HEAD_DIM, base=10000)
    positions = np.array([[7, 8, 8, 9]])
    x = mx.random.normal((1, 2, 4, HEAD_DIM), key=mx.random.key(1)).astype(mx.float16)
    got = TreeRoPE(rope, Rotations(), by_rotations=by_rotations)(x, offset=mx.array(positions, mx.int32))
    assert got.dtype == mx.float16
    expected = one_by_one(rope, x.astype(mx.float32), positions)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(expected), atol=1e-2)


class MixingRoPE(nn.Module):
    """A rotation that is linear at each position but not made of pairs:
    RoPE followed by a fixed dense orthogonal matrix."""

    def __init__(self):
        super().__init__()
        self.inner = nn.RoPE(HEAD_DIM, base=10000)
        self.mix = mx.linalg.qr(mx.random.normal((HEAD_DIM, HEAD_DIM), key=mx.random.key(5)), stream=mx.cpu)[0]

    def __call__(self, x, offset=0):
        return self.inner(x, offset=offset) @ self.mix


@pytest.mark.parametrize("name", sorted(ROPES))
def test_every_rope_is_turned_by_pairs_as_its_matrices_would_turn_it(name):
    rope = ROPES[name]()
    rotations = Rotations()
    positions = mx.array([[40, 41, 41, 900], [3, 4, 5, 5]], mx.int32)
    rotation = rotations(rope, positions, HEAD_DIM)
    assert isinstance(rotation, PairRotation)
    x = mx.random.normal((2, 3, 4, HEAD_DIM), key=mx.random.key(4))
    by_matrices = MatrixRotation(Rotations.matrices(rope, positions, HEAD_DIM))(x)
    np.testing.assert_allclose(np.array(rotation(x)), np.array(by_matrices), atol=1e-6, rtol=1e-6)


def test_a_module_not_made_of_pairs_is_turned_by_its_whole_matrices():
    rope = MixingRoPE()
    tree = TreeRoPE(rope, Rotations(), by_rotations=True)
    positions = np.array([[7, 8, 8, 9, 300]])
    assert isinstance(tree.rotations(rope, mx.array(positions, mx.int32), HEAD_DIM), MatrixRotation)
    x = mx.random.normal((1, 2, positions.shape[1], HEAD_DIM), key=mx.random.key(6))
    got = tree(x, offset=mx.array(positions, mx.int32))
    np.testing.assert_allclose(np.array(got), np.array(one_by_one(rope, x, positions)), atol=2e-5, rtol=1e-5)


def test_pairing_finds_each_dimensions_partner_or_refuses():
    swap = np.eye(4)[[1, 0, 2, 3]]  # dimensions 0 and 1 trade places, 2 and 3 stay
    assert pairing(swap[None]).tolist() == [1, 0, 2, 3]
    rotation = np.array([[0.6, 0.8], [-0.8, 0.6]])
    assert pairing(np.stack([rotation, np.eye(2)])).tolist() == [1, 0]
    cycle = np.eye(3)[[1, 2, 0]]  # 0 -> 1 -> 2 -> 0: no partner is its partner's partner
    assert pairing(cycle[None]) is None
    assert pairing(np.ones((1, 3, 3))) is None  # every dimension mixes all


def test_a_single_offset_passes_straight_to_the_module():
    rope = nn.RoPE(HEAD_DIM, base=10000)
    x = mx.random.normal((1, 2, 5, HEAD_DIM), key=mx.random.key(2))
    tree = TreeRoPE(rope, Rotations())
    assert mx.array_equal(tree(x, offset=12), rope(x, offset=12))
    row_offsets = mx.array([12], mx.int32)  # one per batch row, as a batch's prefill hands it
    assert mx.array_equal(tree(x, offset=row_offsets), rope(x, offset=row_offsets))


def test_modules_that_rotate_alike_share_one_rotation_a_block():
    rotations = Rotations()
    alike = [TreeRoPE(nn.RoPE(HEAD_DIM, base=10000), rotations) for _ in range(3)]
    other = TreeRoPE(nn.RoPE(HEAD_DIM, base=1000000), rotations)
    offset = mx.array([[5, 6, 6]], mx.int32)
    made = [rotations(t.rope, offset, HEAD_DIM) for t in alike]
    assert made[0] is made[1] is made[2]
    assert rotations(other.rope, offset, HEAD_DIM) is not made[0]
    assert rotations.kind(other.rope, HEAD_DIM) != rotations.kind(alike[0].rope, HEAD_DIM)
    # The next block's offsets get a rotation of their own.
    assert rotations(alike[0].rope, mx.array([[7, 8, 8]], mx.int32), HEAD_DIM) is not made[0]


def test_install_wraps_every_rope_module_once_with_one_rotations():
    class Attention(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.rope = nn.RoPE(HEAD_DIM, base=base)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Attention(10000), Attention(10000), Attention(1000000)]

    model = Model()
    assert install_tree_rope(model) == 3
    wrapped = [layer.rope for layer in model.layers]
    assert all(isinstance(w, TreeRoPE) for w in wrapped)
    assert wrapped[0].rotations is wrapped[1].rotations is wrapped[2].rotations
    assert install_tree_rope(model) == 3  # installing again wraps nothing twice
    assert all(not isinstance(layer.rope.rope, TreeRoPE) for layer in model.layers)


def test_the_device_decides_by_default(monkeypatch):
    """Rotations on the CPU backend, the module's own rotation elsewhere."""
    import redrafter_mlx.engine.rope as rope_module

    made = []

    class Counting(Rotations):
        def __call__(self, rope, offset, dim):
            made.append(dim)
            return super().__call__(rope, offset, dim)

    tree = TreeRoPE(nn.RoPE(HEAD_DIM, base=10000), Counting())
    x = mx.random.normal((1, 2, 3, HEAD_DIM), key=mx.random.key(3))
    offset = mx.array([[4, 5, 5]], mx.int32)
    monkeypatch.setattr(rope_module, "rotations_pay", lambda: False)
    by_rows = tree(x, offset=offset)
    assert made == []
    monkeypatch.setattr(rope_module, "rotations_pay", lambda: True)
    np.testing.assert_allclose(np.array(tree(x, offset=offset)), np.array(by_rows), atol=2e-5)
    assert made == [HEAD_DIM]
