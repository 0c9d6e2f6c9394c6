"""How often a sampled token falls outside top-k: random logits over a
49,152-token vocabulary (SmolLM2's size), temperature 1, top-k 4, 40,000
draws each with its own seed; with the fixed uniforms and with the former
24-bit ones (which rounded to 1.0 once in 2**24 and made the noise infinite).

    python3 bench/out_of_support.py
"""

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_k

import redrafter_mlx.sampling as sampling
from redrafter_mlx.generate import TokenHistory

VOCAB, DRAWS, CHUNK = 49152, 40000, 1000


def out_of_support(logits, allowed) -> int:
    choose = sampling.make_chooser(sampling.SamplingSettings(temp=1.0, top_k=4, row_seeds=list(range(DRAWS))))
    bad = 0
    for start in range(0, DRAWS, CHUNK):
        rows = list(range(start, start + CHUNK))
        tokens = np.array(choose(mx.broadcast_to(logits, (CHUNK, 1, VOCAB)), TokenHistory(rows, [[0]] * CHUNK)))[:, 0]
        bad += int((~allowed[tokens]).sum())
    return bad


def main():
    logits = mx.random.normal((1, 1, VOCAB), key=mx.random.key(3)) * 3
    allowed = np.array(apply_top_k(logits[0], 4))[0] > -np.inf
    fixed = out_of_support(logits, allowed)
    sampling.open_uniform = lambda bits: ((bits >> 8).astype(mx.float32) + 0.5) / float(1 << 24)
    former = out_of_support(logits, allowed)
    print(f"outside top-4 of {DRAWS} draws: {fixed} now, {former} with 24-bit uniforms ({100 * former / DRAWS:.2f} %)")


if __name__ == "__main__":
    main()
