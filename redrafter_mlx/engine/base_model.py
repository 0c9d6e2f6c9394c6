"""The base model as ReDrafter needs it: last-layer hidden states and logits
from one forward pass of an unmodified mlx-lm model.

mlx-lm models are ``Model(inputs, cache) -> logits`` around a backbone
``Model.model(inputs, cache) -> normed hidden states`` (``Model.backbone``
in some) and an output head (``lm_head``, or the tied input embedding). We
call the backbone, apply the head ourselves, and check once, on a probe
input, that this reproduces the model's own logits; models with anything
else after the head are refused.

Each layer's cache is what the model's own ``make_cache`` asks for: keys and
values (``TreeKVCache``, sliding windows included) or a recurrent state
(``RecurrentCache``, for hybrid models: they verify chains, see
``engine.recurrent``).
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from ..errors import UserError
from .cache import CacheLayout, TreeKVCache
from .distributed import ONE_PROCESS, Ranks, Skip, SkippedCache, holds_cache
from .recurrent import RecurrentCache, install_recorders
from .rope import install_tree_rope


class BaseModel:
    """An mlx-lm causal LM seen as ``tokens -> (hidden, logits)``.

    Attributes:
        model: the mlx-lm model itself (its RoPE modules are wrapped by
            ``TreeRoPE``, which changes nothing for ordinary calls).
        hidden_size, vocab_size, max_context, dtype, query_heads: from the
            model.
        ranks: the processes the model is split over (``split_model``
            already applied), or None for one process.
    """

    def __init__(self, model: nn.Module, ranks: Ranks = ONE_PROCESS):
        self.model = model
        language_model = getattr(model, "language_model", model)  # multimodal wrappers
        kind = getattr(language_model, "model_type", None) or type(model).__module__
        self.backbone = getattr(language_model, "model", None) or getattr(language_model, "backbone", None)
        embedding = getattr(self.backbone, "embed_tokens", None) or getattr(self.backbone, "embeddings", None)
        if not isinstance(embedding, nn.Module):
            raise UserError(f"unsupported model type {kind}: no backbone with an input embedding (embed_tokens)")
        self.embedding = embedding
        if "lm_head" in language_model:
            self.head = self.head_layer = language_model.lm_head
        else:
            self.head_layer = embedding  # tied
            self.head = self.head_layer.as_linear
        self.layer_caches, self.windows = self._layer_caches(model, kind)
        self.num_layers = len(self.layer_caches)
        # Split over ranks (``engine.distributed``): the layers other ranks run.
        self.ranks = ranks
        self.skipped = self._skipped_caches(model.layers, kind)
        # Models with recurrent layers verify chains, one path per row.
        self.recurrent = any(size is not None for size in self.layer_caches)
        if install_tree_rope(model) == 0 and not self.recurrent:
            # Attention without positions would see a tree as a bag of tokens;
            # a hybrid's recurrent layers give a chain its order.
            raise UserError(f"unsupported model type {kind}: no RoPE module found to give tree tokens their positions")
        if self.recurrent and install_recorders(model.layers) == 0:
            raise UserError(f"unsupported model type {kind}: no layer calls a module with cache=")
        args = getattr(language_model, "args", None) or getattr(model, "args", None)
        text_args = getattr(args, "text_config", None) or args
        self.max_context = getattr(text_args, "max_position_embeddings", None)
        self.hidden_size, self.vocab_size = self._probe()
        # Attention's query heads, which its scores are sized by; where the
        # arguments do not say, as many as heads of 64 dimensions would be.
        self.query_heads = getattr(text_args, "num_attention_heads", None) or max(self.hidden_size // 64, 1)
        self.dtype = self.embed(mx.array([0])).dtype  # what the model computes in

    @staticmethod
    def _layer_caches(model: nn.Module, kind: str) -> tuple[list, list]:
        """Per cache the model takes: None for keys and values, else the
        number of state arrays of a recurrent layer; and the window of a
        sliding-window layer (the size of its ``RotatingKVCache``; None for
        others, and for a window that keeps its first tokens too)."""
        make = getattr(model, "make_cache", None)
        if make is None:
            return [None] * len(model.layers), [None] * len(model.layers)
        sizes, windows = [], []
        for i, c in enumerate(make()):
            if isinstance(c, (KVCache, RotatingKVCache)):
                sizes.append(None)
                windows.append(c.max_size if isinstance(c, RotatingKVCache) and not c.keep else None)
            elif type(c) is ArraysCache:
                sizes.append(len(c.cache))
                windows.append(None)
            else:
                raise UserError(
                    f"unsupported model type {kind}: layer {i} keeps a {type(c).__name__}, which the engine cannot verify a draft with"
                )
        return sizes, windows

    def _skipped_caches(self, layers: list, kind: str) -> list[bool]:
        """Per cache, whether its layer is one another rank runs. Caches
        follow the layers that keep one, in order (not every layer does)."""
        skipped = [isinstance(layer, Skip) for layer in layers]
        if not any(skipped):
            return [False] * self.num_layers
        if len(layers) == self.num_layers:
            return skipped
        owners = [i for i, layer in enumerate(layers) if holds_cache(layer)]
        if len(owners) != self.num_layers:
            raise UserError(
                f"cannot split model type {kind} into pipeline stages here: cannot tell which of its layers keeps which cache"
            )
        return [skipped[i] for i in owners]

    def _probe(self) -> tuple[int, int]:
        """Check hidden -> head reproduces the model's logits; return sizes."""
        probe = mx.array([[1, 2, 3]])
        expected = self.model(probe)
        hidden = self.backbone(probe)
        logits = self.head(hidden)
        if logits.shape != expected.shape or not mx.allclose(logits, expected, atol=1e-3, rtol=1e-3):
            raise UserError(
                f"unsupported model type {type(self.model).__module__}: its logits are not head(last hidden state)"
            )
        return hidden.shape[-1], logits.shape[-1]

    def head_rows(self, token_ids: mx.array) -> mx.array:
        """Rows of the output head for some tokens, (n, hidden_size) float32:
        ``hidden @ head_rows(ids).T`` are the logits of those tokens only."""
        layer = self.head_layer
        if "scales" in layer:  # quantized
            weight = mx.dequantize(
                layer.weight[token_ids],
                layer.scales[token_ids],
                layer.biases[token_ids],
                group_size=layer.group_size,
                bits=layer.bits,
            )
        else:
            weight = layer.weight[token_ids]
        return weight.astype(mx.float32)

    def embed(self, tokens: mx.array) -> mx.array:
        """The input embedding the drafter shares, (...) -> (..., hidden_size)."""
        return self.embedding(tokens)

    def make_cache(self, left_padding: list[int]) -> tuple[CacheLayout, list]:
        """A new batch's layout and per-layer caches (``TreeKVCache`` or
        ``RecurrentCache``, as the model's layers keep their state)."""
        layout = CacheLayout(left_padding)
        return layout, [
            # (a skipped recurrent layer's state stays empty)
            RecurrentCache(layout, size)
            if size is not None
            else SkippedCache(layout)
            if skipped
            else TreeKVCache(layout, window)
            for size, skipped, window in zip(self.layer_caches, self.skipped, self.windows)
        ]

    def __call__(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        """tokens (B, N) -> hidden (B, N, hidden_size), logits (B, N, vocab)."""
        hidden = self.backbone(tokens, cache=cache)
        return hidden, self.head(hidden)
