"""The tree KV cache on hand-made contents: each stored vector is its own
label, so what moved where can be read back directly. And the contract of
one layer's cache (``StepCache``): every cache implements all of it, and it
holds all that mlx-lm's models ask of their caches."""

import inspect
import sys

import mlx.core as mx
import numpy as np
import pytest

from conftest import tiny_model
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.cache import (
    STEP,
    CacheLayout,
    StepCache,
    TreeKVCache,
    extend_batch,
)
from redrafter_mlx.engine.distributed import Skip, SkippedCache
from redrafter_mlx.engine.recurrent import RecurrentCache

HEADS, DIM = 2, 3


def labelled(batch: int, count: int, base: float) -> mx.array:
    """(batch, HEADS, count, DIM) whose entry [b, h, i, :] is base + 1000 b + i."""
    values = base + 1000 * np.arange(batch)[:, None] + np.arange(count)[None, :]
    return mx.array(np.broadcast_to(values[:, None, :, None], (batch, HEADS, count, DIM)).astype(np.float32))


def labels(buffer: mx.array, row: int, begin: int, end: int) -> list:
    return np.array(buffer[row, 0, begin:end, 0]).astype(int).tolist()


def fed(left_padding: list, prompt_length: int) -> tuple[CacheLayout, TreeKVCache]:
    """A layout and one layer's cache after a prompt chunk of ``prompt_length``
    positions (left padding included), labelled 0 .. prompt_length - 1 per row."""
    layout = CacheLayout(left_padding)
    cache = TreeKVCache(layout)
    layout.begin_chunk()
    keys = labelled(len(left_padding), prompt_length, 0)
    cache.update_and_fetch(keys, keys + 0.5)
    layout.end_chunk(prompt_length)
    return layout, cache


def verify_block(layout: CacheLayout, cache: TreeKVCache, nodes: int, label: float) -> None:
    """Feed a chain tree of ``nodes`` tokens labelled label + node index."""
    batch = layout.batch_size
    depths = mx.broadcast_to(mx.arange(nodes, dtype=mx.int32), (batch, nodes))
    layout.begin_tree(depths, mx.broadcast_to(mx.tril(mx.ones((nodes, nodes), mx.bool_)), (batch, nodes, nodes)))
    keys = labelled(batch, nodes, label)
    cache.update_and_fetch(keys, keys + 0.5)


def test_a_path_packed_in_order_stays_where_it_is():
    layout, cache = fed([0], 5)
    verify_block(layout, cache, 4, 100)
    before = cache.keys
    cache.commit_path(np.array([[0, 1, 2, 3]]), np.array([2]))
    assert cache.keys is before  # nothing copied
    layout.commit(np.array([3]))
    assert labels(cache.keys, 0, 0, 8) == [0, 1, 2, 3, 4, 100, 101, 102]


def test_an_accepted_branch_moves_behind_the_root_at_batch_1():
    layout, cache = fed([0], 5)
    verify_block(layout, cache, 6, 100)
    # Root (node 0), then nodes 3 and 5 accepted: they move to positions 6 and 7.
    cache.commit_path(np.array([[0, 3, 5, 5]]), np.array([2]))
    layout.commit(np.array([3]))
    assert labels(cache.keys, 0, 0, 8) == [0, 1, 2, 3, 4, 100, 103, 105]
    assert np.array(cache.values[0, 1, 5:8, 2]).tolist() == [
        100.5,
        103.5,
        105.5,
    ]  # values move with keys, every head and dim


def test_rows_of_different_lengths_commit_to_their_own_ends():
    layout, cache = fed([0, 0], 4)
    # Row 0 accepted 2 more tokens in an earlier step, row 1 none: row 1 has
    # junk between its end (5) and the block's start (7).
    verify_block(layout, cache, 3, 50)
    cache.commit_path(np.array([[0, 1, 2], [0, 1, 2]]), np.array([2, 0]))
    layout.commit(np.array([3, 1]))
    assert layout.lengths.tolist() == [7, 5] and layout.start == 7
    verify_block(layout, cache, 4, 200)  # block at 7 .. 10 for both rows
    cache.commit_path(np.array([[0, 2, 3], [0, 1, 3]]), np.array([1, 2]))
    layout.commit(np.array([2, 3]))
    assert labels(cache.keys, 0, 0, 9) == [0, 1, 2, 3, 50, 51, 52, 200, 202]
    assert labels(cache.keys, 1, 0, 8) == [1000, 1001, 1002, 1003, 1050, 1200, 1201, 1203]


def test_filter_keeps_rows_and_drops_the_padding_all_kept_rows_share():
    layout, cache = fed([3, 1, 2], 6)
    trim = layout.filter([0, 2])
    cache.filter(mx.array([0, 2]), trim)
    assert trim == 2 and layout.left_padding.tolist() == [1, 0] and layout.lengths.tolist() == [4, 4]
    assert labels(cache.keys, 0, 0, 4) == [2, 3, 4, 5] and labels(cache.keys, 1, 0, 4) == [2002, 2003, 2004, 2005]


def test_extending_a_batch_pads_the_shorter_side_on_the_left():
    layout, cache = fed([0], 5)
    other_layout, other = fed([1, 0], 3)
    extend_batch(layout, [cache], other_layout, [other])
    assert layout.left_padding.tolist() == [0, 3, 2] and layout.lengths.tolist() == [5, 5, 5]
    assert labels(cache.keys, 0, 0, 5) == [0, 1, 2, 3, 4]
    assert labels(cache.keys, 1, 3, 5) == [1, 2] and labels(cache.keys, 2, 2, 5) == [1000, 1001, 1002]
    keys, values = cache.rows_kv(2, 2, 5)
    assert keys.shape == (1, HEADS, 3, DIM) and np.array(values[0, 0, :, 0]).tolist() == [1000.5, 1001.5, 1002.5]


def test_buffers_grow_past_a_step_boundary_and_keep_their_contents():
    layout, cache = fed([0], STEP - 2)
    assert cache.keys.shape[2] == STEP
    verify_block(layout, cache, 5, 10000)  # needs STEP + 3 positions
    assert cache.keys.shape[2] == 2 * STEP
    cache.commit_path(np.array([[0, 1, 2, 3, 4]]), np.array([4]))
    layout.commit(np.array([5]))
    assert labels(cache.keys, 0, STEP - 4, STEP + 3) == [STEP - 4, STEP - 3, 10000, 10001, 10002, 10003, 10004]


def test_the_mask_hides_padding_and_another_rows_junk():
    layout, cache = fed([1, 0], 3)
    verify_block(layout, cache, 2, 50)
    cache.commit_path(np.array([[0, 1], [0, 1]]), np.array([1, 0]))
    layout.commit(np.array([2, 1]))  # row 0 ends at 5, row 1 at 4: position 4 of row 1 is junk
    tree_mask = mx.array([[[True, False], [True, True]]] * 2)
    layout.begin_tree(mx.array([[0, 1], [0, 1]], mx.int32), tree_mask)
    mask = np.array(layout.mask(2, None))[:, 0]  # (B, N, start + N)
    assert mask[0, 1].tolist() == [False, True, True, True, True, True, True]  # padding hidden
    assert mask[1, 0].tolist() == [True, True, True, True, False, True, False]  # junk at 4 hidden
    assert layout.offset.tolist() == [[4, 5], [4, 5]]  # per-token positions: length - padding + depth


# -- the contract ---------------------------------------------------------------

DECLARED = StepCache.__abstractmethods__
CACHES = [TreeKVCache, RecurrentCache, SkippedCache]
# What mlx-lm's recurrent layers ask of an ArraysCache beside ``cache[i]``
# (which RecurrentCache is): no other layer asks it of its cache.
ARRAYS_CACHE = {"lengths", "advance"}
# What mlx-lm asks for to tell a quantized cache (keys come packed): none is.
ABSENT = {"bits"}


def test_the_contract_declares_the_model_and_engine_sides_with_docstrings():
    assert DECLARED == {
        "offset",
        "make_mask",
        "update_and_fetch",
        "commit_path",
        "filter",
        "extend",
        "rows_kv",
        "state_arrays",
    }
    for name in DECLARED:
        member = StepCache.__dict__[name]
        assert (member.fget if isinstance(member, property) else member).__doc__, name
    assert StepCache.__annotations__["layout"] is CacheLayout


@pytest.mark.parametrize("cls", CACHES, ids=lambda c: c.__name__)
def test_every_cache_implements_every_declared_member_itself(cls):
    """Nothing of the contract is left to the declaring base."""
    assert not cls.__abstractmethods__
    for name in DECLARED:
        assert inspect.getattr_static(cls, name) is not StepCache.__dict__[name], name
    layout = CacheLayout([0, 1])
    cache = cls(layout, 2) if cls is RecurrentCache else cls(layout)
    assert cache.layout is layout


def watch(cache, asked: dict) -> None:
    """Record (in ``asked``, by the cache's class) every attribute that
    mlx-lm's models read of ``cache`` (not what the methods RecurrentCache
    inherits from mlx-lm's ArraysCache read of it)."""
    cls = type(cache)

    def __getattribute__(self, name):
        module = sys._getframe(1).f_globals.get("__name__", "")
        if module.startswith("mlx_lm.") and module != "mlx_lm.models.cache":
            asked.setdefault(cls, set()).add(name)
        return object.__getattribute__(self, name)

    cache.__class__ = type(f"Watched{cls.__name__}", (cls,), {"__getattribute__": __getattribute__})


def model_of(kind: str):
    if kind == "llama-skipped":  # its first layer, which the masks are read from, run by another rank
        model = tiny_model("llama")
        model.model.layers = [Skip(model.model.layers[0]), *model.model.layers[1:]]
        return model
    return tiny_model(kind)


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen3_next", "nemotron_h", "lfm2", "llama-skipped"])
def test_what_mlx_lm_models_ask_of_their_caches_is_declared(kind):
    """A prefill chunk (left-padded) and a tree pass: every attribute mlx-lm
    reads of a cache is in the contract (a recurrent layer's cache also
    answers as an ArraysCache)."""
    base = BaseModel(model_of(kind))
    layout, caches = base.make_cache([2, 0])
    asked = {}
    for cache in caches:
        watch(cache, asked)
    layout.begin_chunk()
    mx.eval(base(mx.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]]), caches))
    layout.end_chunk(5)
    depths = mx.broadcast_to(mx.arange(3, dtype=mx.int32), (2, 3))
    layout.begin_tree(depths, mx.broadcast_to(mx.tril(mx.ones((3, 3), mx.bool_)), (2, 3, 3)))
    mx.eval(base(mx.array([[8, 9, 10], [6, 7, 8]]), caches))
    for cls, names in asked.items():
        assert names <= DECLARED | ABSENT | (ARRAYS_CACHE if cls is RecurrentCache else set()), cls.__name__
    assert not any(hasattr(cache, name) for cache in caches for name in ABSENT)
    assert "update_and_fetch" in asked[TreeKVCache]
    assert "make_mask" in asked[SkippedCache if kind == "llama-skipped" else TreeKVCache]
    if base.recurrent:
        assert "make_mask" in asked[RecurrentCache]
