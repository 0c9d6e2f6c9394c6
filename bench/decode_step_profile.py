"""Where a batched decode step of the base model spends its time on this CPU.

Prefills ``--batch`` of the shortest prompts of a prompts file, then times
plain decode steps (``distill_speed.raw_decode``: one token per row,
argmax, one sync), and the same step with parts taken out or measured alone:
- the matrix products of one step alone (every projection and the output
  head at the batch's row count), the step's floor through BLAS;
- the step with attention replaced by its query (no scores, no softmax);
- the SwiGLU activation of every layer alone, and ``exp`` per element.
Diagnostics only: the step without attention computes wrong tokens.

    PYTHONPATH=. python3 bench/decode_step_profile.py --prompts ../shared/data/prompts/train-chat.jsonl
"""

import argparse
import json
import sys
import time
from pathlib import Path

import redrafter_mlx  # noqa: F401  (OpenBLAS)
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.activations import swiglu

from redrafter_mlx.api import encode_prompt
from redrafter_mlx.base_model import BaseModel
from redrafter_mlx.loading import load_base_model
from redrafter_mlx.prompts import read_prompts

sys.path.insert(0, str(Path(__file__).parent))
from distill_speed import raw_decode  # noqa: E402


def seconds_per_call(function, *args, repeats: int = 20) -> float:
    for _ in range(3):
        mx.eval(function(*args))
    tic = time.perf_counter()
    for _ in range(repeats):
        mx.eval(function(*args))
    return (time.perf_counter() - tic) / repeats


def matmul_seconds(base: BaseModel, rows: int) -> float:
    """One step's matrix products, each timed alone at ``rows`` rows: every
    2-D weight of a layer times the number of layers, and the output head."""
    total = 0.0
    for _, weight in tree_flatten(base.model.layers[0].parameters()):
        if weight.ndim == 2:
            x = mx.random.normal((rows, weight.shape[1]))
            total += seconds_per_call(lambda a, b: a @ b.T, x, weight) * base.num_layers
    hidden = mx.random.normal((rows, base.hidden_size))
    return total + seconds_per_call(base.head, hidden, repeats=5)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()

    model, tokenizer = load_base_model(None, "float32")
    base = BaseModel(model)
    prompts = sorted((encode_prompt(tokenizer, p) for p in read_prompts(args.prompts)), key=len)[: args.batch]
    step = args.batch / raw_decode(base, prompts, args.steps)

    attention = mx.fast.scaled_dot_product_attention
    mx.fast.scaled_dot_product_attention = lambda q, k, v, scale, mask, sinks=None: q
    try:
        without_attention = args.batch / raw_decode(base, prompts, args.steps)
    finally:
        mx.fast.scaled_dot_product_attention = attention

    intermediate = model.layers[0].mlp.gate_proj.weight.shape[0]
    gate = mx.random.normal((args.batch, 1, intermediate))
    activation = seconds_per_call(swiglu, gate, gate) * base.num_layers
    exp_ns = seconds_per_call(mx.exp, gate, repeats=50) / gate.size * 1e9
    matmuls = matmul_seconds(base, args.batch)
    print(json.dumps(dict(
        batch=args.batch, context=max(map(len, prompts)), dtype="float32",
        step_ms=round(step * 1e3, 1), tokens_per_s=round(args.batch / step, 1),
        matmuls_alone_ms=round(matmuls * 1e3, 1), attention_ms=round((step - without_attention) * 1e3, 1),
        swiglu_ms=round(activation * 1e3, 1), exp_ns_per_element=round(exp_ns, 1),
    )))


if __name__ == "__main__":
    main()
