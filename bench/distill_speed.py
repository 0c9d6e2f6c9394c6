"""Distillation speed against a raw batched decode step of the same model.

All run on the same prompts (the shortest of a prompts file, as distill
orders them) at the same batch size, float32, greedy, alternating:
- raw: prefill one batch, then time plain decode steps (forward of one
  token per row + argmax, one sync per step), no bookkeeping;
- distill: ``response_stream`` (what ``redrafter-mlx distill`` runs),
  refilling the batch as rows finish, with the hidden states;
- distill with ``--workers`` processes (``parallel_stream``), each with its
  own batch.

    PYTHONPATH=. python3 bench/distill_speed.py --prompts ../shared/data/prompts/train-chat.jsonl --num-prompts 256
"""

import argparse
import json
import time

import redrafter_mlx  # noqa: F401  (OpenBLAS)
import mlx.core as mx

from redrafter_mlx.api import encode_prompt
from redrafter_mlx.base_model import BaseModel
from redrafter_mlx.distill import parallel_stream, response_stream
from redrafter_mlx.generate import prefill
from redrafter_mlx.loading import load_base_model
from redrafter_mlx.prompts import read_prompts
from redrafter_mlx.sampling import SamplingSettings


def raw_decode(base, prompts, steps):
    """Tokens/s of plain decode steps after prefilling ``prompts``."""
    layout, cache, hidden, logits = prefill(base, prompts)
    token = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(token)
    tic = time.perf_counter()
    for _ in range(steps):
        layout.begin_chunk()
        hidden, logits = base(token[:, None], cache)
        layout.end_chunk(1)
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(token)
    return len(prompts) * steps / (time.perf_counter() - tic)


def distill_rate(generate, prompts, batch_size):
    tic, tokens = time.perf_counter(), 0
    for _, response, _ in generate(prompts, batch_size, [0] * len(prompts)):
        tokens += len(response)
    return tokens / (time.perf_counter() - tic), tokens


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--num-prompts", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--raw-steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="cProfile one distill run instead")
    args = parser.parse_args()

    model, tokenizer = load_base_model(None, "float32")
    base = BaseModel(model)
    tokenized = sorted((encode_prompt(tokenizer, t) for t in read_prompts(args.prompts)), key=len)[: args.num_prompts]
    eos = tokenizer.eos_token_ids
    if args.profile:
        import cProfile
        import pstats

        generate = response_stream(base, args.max_tokens, SamplingSettings(), eos)
        cProfile.runctx("distill_rate(generate, tokenized, args.batch_size)", globals(), locals(), "/tmp/distill.prof")
        pstats.Stats("/tmp/distill.prof").sort_stats("cumulative").print_stats(40)
        return
    rows = []
    for r in range(args.rounds):
        raw = raw_decode(base, tokenized[: args.batch_size], args.raw_steps)
        one, tokens = distill_rate(response_stream(base, args.max_tokens, SamplingSettings(), eos), tokenized, args.batch_size)
        parallel = parallel_stream((None, "float32"), args.max_tokens, SamplingSettings(), eos, args.workers)
        many, many_tokens = distill_rate(parallel, tokenized, args.batch_size)
        rows.append(dict(round=r, raw_decode_tps=round(raw, 1), distill_tps=round(one, 1), distill_workers_tps=round(many, 1),
                         tokens=tokens, tokens_with_workers=many_tokens))
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps(dict(settings=vars(args), dtype="float32", rounds=rows)))


if __name__ == "__main__":
    main()
