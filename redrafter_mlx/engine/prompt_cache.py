"""A prompt cache: the base model's keys and values for the tokens of a
conversation so far, so that the next turn prefills only what is new.

The engine reuses the longest common prefix of a cache's tokens and the new
prompt, so a cache may hold more than the prompt shares (an answer that was
stopped, or that the chat template writes back differently): only the
shared part is used, and the result is what a full prefill gives.

A model with recurrent layers (``engine.recurrent``) keeps, for those
layers, the state after all of the cache's tokens, which cannot be cut
back: such a cache is reused only by a prompt that starts with all of its
tokens (the next turn of the conversation), and otherwise not at all.
"""

import json
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx

from ..errors import UserError

FORMAT = 1


class PromptCache:
    """tokens: the token ids whose keys and values are held; keys, values:
    per layer of the base model, (1, kv_heads, len(tokens), head_dim); for
    a recurrent layer, keys holds the tuple of its state arrays (1, ...)
    after all the tokens, and values None.
    model: the identity of the model that made them ('' when unknown).

    pending: tokens the conversation holds after ``tokens``, whose keys
    and values are not computed yet. mlx-lm's API treats a cache as the
    whole conversation so far, its last answer's final token and
    end-of-sequence token included, and continues it with the next prompt:
    ``serving.generate`` keeps those tokens here.

    Empty until a generation given it (``prompt_cache=``) fills it; each
    step of that generation replaces the whole state at once, so a cache is
    consistent whenever the generation is interrupted. While the generation
    runs, the cache follows it (``follow``) and takes its arrays only when
    read: holding views of the running batch's buffers would make every
    step copy them whole instead of writing its keys in place.
    """

    def __init__(self, tokens: Sequence[int] = (), keys: Sequence = (), values: Sequence = (), model: str = ""):
        self._state = (list(tokens), list(keys), list(values))
        self._fetch: Optional[Callable[[], tuple]] = None
        self.model = model
        self.pending: list = []

    def _read(self) -> tuple:
        if self._fetch is not None:
            self._state, self._fetch = self._fetch(), None
        return self._state

    @property
    def tokens(self) -> list:
        return self._read()[0]

    @property
    def keys(self) -> list:
        return self._read()[1]

    @property
    def values(self) -> list:
        return self._read()[2]

    def __len__(self) -> int:
        return len(self.tokens)

    def set(self, tokens: list, keys: list, values: list, model: str) -> None:
        self._state, self._fetch, self.model = (tokens, keys, values), None, model

    def follow(self, fetch: Callable[[], tuple], model: str) -> None:
        """The state is what ``fetch()`` -> (tokens, keys, values) gives when
        the cache is next read (a running generation's state, which must be
        fetchable until then)."""
        self._fetch, self.model = fetch, model

    def clear(self) -> None:
        self._state, self._fetch, self.pending = ([], [], []), None, []

    @property
    def recurrent(self) -> bool:
        """Whether some layer's state is recurrent (reused whole or not at all)."""
        return any(v is None for v in self.values)

    def reusable(self, prompt: Sequence[int]) -> int:
        """Leading tokens of ``prompt`` this cache gives: their common
        prefix, at most all but the prompt's last token (which is always
        fed, for the logits of what follows it); with recurrent layers,
        all of the cache's tokens or none."""
        limit, tokens, n = min(len(self.tokens), len(prompt) - 1), self.tokens, 0
        while n < limit and tokens[n] == prompt[n]:
            n += 1
        if self.recurrent and n < len(tokens):
            return 0
        return n

    def arrays(self) -> list:
        """Every array the cache holds."""
        flat = []
        for k, v in zip(self.keys, self.values):
            flat += list(k) if v is None else [k, v]
        return flat

    def check(self, identity: str, num_layers: int) -> None:
        """Refuse a cache made by another model."""
        if self.tokens and ((self.model and identity and self.model != identity) or len(self.keys) != num_layers):
            raise UserError("the prompt cache was made by another model")

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def cut(self, length: int) -> "PromptCache":
        """A cache of the first ``length`` tokens (views of these arrays);
        not for recurrent layers, whose state is after all the tokens."""
        assert not self.recurrent, "a recurrent state cannot be cut"
        return PromptCache(
            self.tokens[:length],
            [k[..., :length, :] for k in self.keys],
            [v[..., :length, :] for v in self.values],
            self.model,
        )

    def compact(self) -> "PromptCache":
        """A copy that owns just its own memory (a cache a generation filled
        holds views of that generation's whole batch buffers)."""
        keys = [
            tuple(mx.contiguous(a) for a in k) if v is None else mx.contiguous(k)
            for k, v in zip(self.keys, self.values)
        ]
        values = [None if v is None else mx.contiguous(v) for v in self.values]
        mx.eval(keys, [v for v in values if v is not None])
        return PromptCache(self.tokens, keys, values, self.model)


def make_prompt_cache(model=None, max_kv_size: Optional[int] = None) -> PromptCache:
    """An empty cache to pass as ``prompt_cache=``. The arguments are
    mlx-lm's: any model (a cache fits the model that first fills it), and
    no ``max_kv_size`` (a cache keeps every token)."""
    if max_kv_size is not None:
        raise UserError("a prompt cache keeps every token: max_kv_size is not supported")
    return PromptCache()


def save_prompt_cache(path: str, cache: PromptCache, metadata: Optional[dict] = None) -> None:
    """Write a cache to a ``.safetensors`` file (written whole, then moved
    into place); ``metadata`` (str -> str) is kept beside it."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise UserError(f"a prompt cache file ends in .safetensors, got {path}")
    arrays, recurrent = {}, {}
    for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
        if v is None:
            recurrent[i] = len(k)
            for j, a in enumerate(k):
                arrays[f"state.{i}.{j}"] = mx.contiguous(a)
        else:
            arrays[f"keys.{i}"], arrays[f"values.{i}"] = mx.contiguous(k), mx.contiguous(v)
    info = {
        "format": str(FORMAT),
        "tokens": json.dumps(cache.tokens),
        "model": cache.model,
        "layers": str(len(cache.keys)),
        "pending": json.dumps(cache.pending),
    }
    info["recurrent"] = json.dumps(recurrent)
    info["metadata"] = json.dumps(metadata or {})
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata=info)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write the prompt cache {path} ({e})") from None


def load_prompt_cache(path: str, return_metadata: bool = False):
    """Read a cache written by ``save_prompt_cache``; with
    ``return_metadata``, returns (cache, metadata)."""
    try:
        arrays, info = mx.load(str(path), return_metadata=True)
        if info.get("format") != str(FORMAT):
            raise ValueError(f"format {info.get('format')!r}, expected {FORMAT}")
        layers = int(info["layers"])
        recurrent = {int(i): n for i, n in json.loads(info.get("recurrent", "{}")).items()}
        keys = [
            tuple(arrays[f"state.{i}.{j}"] for j in range(recurrent[i])) if i in recurrent else arrays[f"keys.{i}"]
            for i in range(layers)
        ]
        values = [None if i in recurrent else arrays[f"values.{i}"] for i in range(layers)]
        tokens = json.loads(info["tokens"])
        pending = json.loads(info.get("pending", "[]"))
        metadata = json.loads(info.get("metadata", "{}"))
        attention = [a for i in range(layers) if i not in recurrent for a in (keys[i], values[i])]
        if any(k.ndim != 4 or k.shape[2] != len(tokens) for k in attention):
            raise ValueError("key and value shapes do not match the tokens")
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read the prompt cache {path} ({e})") from None
    cache = PromptCache(tokens, keys, values, info.get("model", ""))
    cache.pending = pending
    return (cache, metadata) if return_metadata else cache
