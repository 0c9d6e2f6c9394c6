"""Verification for layers with recurrent or convolutional state (Gated
DeltaNet, Mamba2, short convolutions), plugged into unmodified mlx-lm models.

Such a layer keeps, per row, a state that sums up every token before it (in
mlx-lm an ``ArraysCache``: a convolution window and a recurrent matrix). A
state cannot be masked into a tree, and cannot be cut back: after a pass
over ``n`` tokens it is the state after all ``n``. So for models with such
layers the engine verifies a chain, each row's most likely path
(``drafting.tree.most_likely_path``), and its attention layers see it
through the tree mask as usual.

Committing the accepted prefix of a chain: when a row accepted the whole
chain, the state the pass left is already right. Otherwise the layer is run
again from the state it had before the pass, over the accepted tokens only,
with the inputs it was given in the pass (``RecordedMixer`` keeps them).
Only the recurrent mixers run again, not the model: their inputs at the
accepted positions are those of plain decoding, since every layer is causal.
Rows that accepted equally many tokens run together, so nothing is padded:
mlx-lm's recurrent layers take padding on the left only, and only from an
empty state.

Why this and not the state after every position kept during the pass: the
re-run goes through each family's own mlx-lm layer (any ``ArraysCache``
layer called with ``cache=``), where keeping every position's state means
writing each family's recurrence again. On the tests' tiny hybrids the
re-run of half a chain costs about 10-25 % of the pass
(``bench/research/recurrent/``), and the cost curve of such a model
includes it (``engine.calibrate``).
"""

import inspect
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache

from .cache import CacheLayout, StepCache


class RecurrentCache(ArraysCache, StepCache):
    """One recurrent layer's state, per row: ``cache[i]`` (B, ...) as the
    mlx-lm layer keeps it (``size`` arrays), never padded (rows joining a
    batch bring their own state; left padding of a prefill is masked).

    Between a verification pass and ``commit_path``, ``before`` holds the
    state from before the pass and ``recorded`` the layer's call.
    """

    def __init__(self, layout: CacheLayout, size: int):
        super().__init__(size)
        self.layout = layout
        self.before: Optional[list] = None
        self.recorded = None  # (module, bound arguments, name of the input argument)

    @property
    def offset(self):
        """The layout's positions (a recurrent layer itself reads none)."""
        return self.layout.offset

    def make_mask(
        self, num_tokens: int, return_array: bool = False, window_size: Optional[int] = None
    ) -> Optional[mx.array]:
        """(B, N) bool, which tokens of a prefill chunk are real (not left
        padding); None when all are, and always for a chain. (mlx-lm's
        ``create_ssm_mask`` passes ``num_tokens`` alone.)"""
        return self.layout.padding_mask(num_tokens)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """A recurrent layer keeps no keys and values: refused."""
        raise TypeError(
            "a recurrent layer's cache keeps no keys and values; an attention layer was given a recurrent layer's cache"
        )

    def advance(self, num_tokens: int) -> None:
        """Positions are the layout's: nothing to move."""

    def record(self, module: nn.Module, bound: inspect.BoundArguments, input_name: str) -> None:
        self.before = list(self.cache)
        self.recorded = (module, bound, input_name)

    def commit_path(self, path: np.ndarray, accepted: np.ndarray) -> None:
        """Make each row's state the one after its root and ``accepted``
        chain tokens (host arrays (B, P) and (B,)); lazy."""
        if self.recorded is None:
            return
        module, bound, input_name = self.recorded
        inputs = bound.arguments[input_name]
        width = inputs.shape[1]
        fed = accepted + 1
        assert all((path[b, :n] == np.arange(n)).all() for b, n in enumerate(fed)), (
            "recurrent layers verify chains only"
        )
        for n in sorted(set(fed[fed < width].tolist())):
            rows = np.flatnonzero(fed == n)
            whole = len(rows) == len(fed)
            index = None if whole else mx.array(rows)
            state = ArraysCache(len(self.cache))
            state.cache = [a if a is None or whole else a[index] for a in self.before]
            arguments = dict(bound.arguments)
            arguments[input_name] = inputs[:, :n] if whole else inputs[index, :n]
            if "mask" in arguments:
                arguments["mask"] = None
            arguments["cache"] = state
            module(**arguments)
            for i, a in enumerate(state.cache):
                if whole:
                    self.cache[i] = a
                else:
                    self.cache[i][index] = a
        self.before = self.recorded = None

    def filter(self, rows: mx.array, trim: int) -> None:
        """Keep ``rows`` (states have no positions to trim)."""
        self.cache = [None if a is None else a[rows] for a in self.cache]

    def extend(self, other: "RecurrentCache", *positions) -> None:
        """Append another batch's rows (states have no positions to align)."""
        self.cache = [None if a is None else mx.concatenate([a, b]) for a, b in zip(self.cache, other.cache)]

    def rows_kv(self, row: int, begin: int, end: int) -> tuple[tuple, None]:
        """A prompt cache's entry for one row: its state after its committed
        tokens (``begin`` and ``end`` are what the attention layers keep)."""
        return tuple(a[row : row + 1] for a in self.cache), None

    def state_arrays(self) -> list:
        """The state arrays (none before the layer is first fed)."""
        return [a for a in self.cache if a is not None]


class RecordedMixer(nn.Module):
    """Wraps a layer's recurrent mixer (the child module it calls with
    ``cache=``) so that a verification pass records the call for
    ``RecurrentCache.commit_path``; any other call passes straight through."""

    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.mixer = mixer
        self._signature = inspect.signature(mixer.__call__)
        self._input_name = next(iter(self._signature.parameters))

    def __call__(self, *args, **kwargs):
        bound = self._signature.bind(*args, **kwargs)
        cache = bound.arguments.get("cache")
        if isinstance(cache, RecurrentCache) and cache.layout.in_tree:
            cache.record(self.mixer, bound, self._input_name)
        return self.mixer(*args, **kwargs)


def takes_cache(module: nn.Module) -> bool:
    try:
        return "cache" in inspect.signature(module.__call__).parameters
    except (TypeError, ValueError):
        return False


def install_recorders(layers: list) -> int:
    """Wrap, in place, every child of each layer that takes ``cache=``
    (attention modules too: they pass through); returns how many."""
    count = 0
    for layer in layers:
        for name, child in list(layer.children().items()):
            if isinstance(child, RecordedMixer):
                count += 1
            elif isinstance(child, nn.Module) and takes_cache(child):
                layer[name] = RecordedMixer(child)
                count += 1
    return count
