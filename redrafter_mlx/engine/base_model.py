"""The base model as ReDrafter needs it: last-layer hidden states and logits
from one forward pass of an unmodified mlx-lm model.

mlx-lm models are ``Model(inputs, cache) -> logits`` around a backbone
``Model.model(inputs, cache) -> normed hidden states`` and an output head
(``lm_head``, or the tied input embedding). We call the backbone, apply the
head ourselves, and check once, on a probe input, that this reproduces the
model's own logits; models with anything else after the head are refused.
"""

import mlx.core as mx
import mlx.nn as nn

from ..errors import UserError
from .cache import CacheLayout, TreeKVCache
from .rope import install_tree_rope


class BaseModel:
    """An mlx-lm causal LM seen as ``tokens -> (hidden, logits)``.

    Attributes:
        model: the mlx-lm model itself (its RoPE modules are wrapped by
            ``TreeRoPE``, which changes nothing for ordinary calls).
        hidden_size, vocab_size, max_context, dtype: from the model.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        language_model = getattr(model, "language_model", model)  # multimodal wrappers
        self.backbone = getattr(language_model, "model", None)
        if self.backbone is None or not hasattr(self.backbone, "embed_tokens"):
            raise UserError(f"unsupported model type {type(model).__module__}: no backbone with embed_tokens")
        if "lm_head" in language_model:
            self.head = self.head_layer = language_model.lm_head
        else:
            self.head_layer = self.backbone.embed_tokens  # tied
            self.head = self.head_layer.as_linear
        self.num_layers = len(model.layers)
        if install_tree_rope(model) == 0:
            raise UserError("unsupported model: no RoPE module found to give tree tokens their positions")
        args = getattr(language_model, "args", None) or getattr(model, "args", None)
        text_args = getattr(args, "text_config", None) or args
        self.max_context = getattr(text_args, "max_position_embeddings", None)
        self.hidden_size, self.vocab_size = self._probe()
        self.dtype = self.embed(mx.array([0])).dtype  # what the model computes in

    def _probe(self) -> tuple[int, int]:
        """Check hidden -> head reproduces the model's logits; return sizes."""
        probe = mx.array([[1, 2, 3]])
        expected = self.model(probe)
        hidden = self.backbone(probe)
        logits = self.head(hidden)
        if logits.shape != expected.shape or not mx.allclose(logits, expected, atol=1e-3, rtol=1e-3):
            raise UserError(
                f"unsupported model type {type(self.model).__module__}: its logits are not "
                "head(last hidden state)"
            )
        return hidden.shape[-1], logits.shape[-1]

    def head_rows(self, token_ids: mx.array) -> mx.array:
        """Rows of the output head for some tokens, (n, hidden_size) float32:
        ``hidden @ head_rows(ids).T`` are the logits of those tokens only."""
        layer = self.head_layer
        if "scales" in layer:  # quantized
            weight = mx.dequantize(
                layer.weight[token_ids], layer.scales[token_ids], layer.biases[token_ids],
                group_size=layer.group_size, bits=layer.bits,
            )
        else:
            weight = layer.weight[token_ids]
        return weight.astype(mx.float32)

    def embed(self, tokens: mx.array) -> mx.array:
        """The input embedding the drafter shares, (...) -> (..., hidden_size)."""
        return self.backbone.embed_tokens(tokens)

    def make_cache(self, left_padding: list[int]) -> tuple[CacheLayout, list[TreeKVCache]]:
        layout = CacheLayout(left_padding)
        return layout, [TreeKVCache(layout) for _ in range(self.num_layers)]

    def __call__(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        """tokens (B, N) -> hidden (B, N, hidden_size), logits (B, N, vocab)."""
        hidden = self.backbone(tokens, cache=cache)
        return hidden, self.head(hidden)
