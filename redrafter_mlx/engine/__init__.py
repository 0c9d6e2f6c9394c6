"""The decoding engine: the tree KV cache and per-token RoPE plugged into an
unmodified mlx-lm model, prefill, the verification step, token choice
(greedy or exact sampling), acceptance, plain decoding, prompt caches and
the cost-curve measurement."""
