#!/usr/bin/env bash
# How the shipped drafter for SmolLM2-135M-Instruct is made and measured, on a
# 2-core Linux CPU (float32, OpenBLAS). Every step resumes when rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=../shared/data/prompts
DATA=data/distill-smollm2-135m
RUN=runs/smollm2-135m-drafter-v3
SHIPPED=redrafter_mlx/drafters/smollm2-135m-instruct

# 1. The base model's greedy responses to the training prompts (~140 min here),
#    and sampled ones (temperature 0.7; stopped after the 2,048 shortest
#    prompts, 89 min while sharing the CPU: rerun to extend it).
redrafter-mlx distill --prompts $PROMPTS/train.jsonl --output $DATA --batch-size 64 --max-tokens 256
redrafter-mlx distill --prompts $PROMPTS/train.jsonl --output $DATA-t0.7 --batch-size 64 --max-tokens 256 --temp 0.7 --seed 1
#    Open-ended tasks are only 175 of the 5,493 training prompts (the
#    self-instruct seed tasks): eight sampled responses to each, leaving out the
#    8 whose greedy responses the trainer holds out (every 50th line).
python3 - <<PY
import json
rows = [json.loads(line) for line in open("$PROMPTS/train.jsonl")]
with open("data/prompts-self-instruct-seed.jsonl", "w") as f:
    for i, row in enumerate(rows):
        if row["source"] == "self-instruct-seed" and i % 50 != 0:
            f.write(json.dumps(row) + "\n")
PY
redrafter-mlx distill --prompts data/prompts-self-instruct-seed.jsonl --output $DATA-seed-t0.7 --batch-size 64 --max-tokens 256 \
    --temp 0.7 --seed 2 --samples 8

# 2. Train on all three (hidden states come from distill's cache, else are
#    recomputed). 12,288 draft tokens cover 99.5 % of the generated tokens.
redrafter-mlx train --data $DATA --data $DATA-t0.7 --data $DATA-seed-t0.7 --output $RUN --steps 2800 --batch-size 512 \
    --learning-rate 2e-3 --warmup 100 --exit-dim 512 --num-draft-layers 1 --draft-vocab 12288 --eval-every 700 --save-every 200

# 3. Ship it in float16.
python3 - <<PY
import redrafter_mlx, mlx.core as mx
from redrafter_mlx.drafter import load_drafter, read_config, save_drafter
from pathlib import Path
drafter = load_drafter("$RUN")
drafter.set_dtype(mx.float16)  # floating arrays only: token ids stay int32
config = read_config(Path("$RUN") / "config.json")
save_drafter(drafter, "$SHIPPED", {"training": config.get("training", {})})
PY

# 4. Greedy tokens per step on the dev prompts, 256 new tokens: the base
#    model's greedy responses to dev.jsonl once (15 min; evaluation only,
#    never trained on), then every beam shape replayed on them (10 min), and
#    a real run over a spread-out subset as a check.
redrafter-mlx distill --prompts $PROMPTS/dev.jsonl --output data/eval-dev-smollm2-135m --batch-size 64 --max-tokens 256
python3 bench/replay_acceptance.py --drafter $SHIPPED --data data/eval-dev-smollm2-135m --all --shapes 1x5,2x5,4x5,8x5 \
    | tail -1 > bench/results/replay-dev-greedy.json
python3 bench/acceptance.py --drafter $SHIPPED --prompts $PROMPTS/dev.jsonl --every 16 --shapes 4x5 --out bench/results/acceptance-greedy-every16.json

# Sampled tokens per step, every 16th dev prompt.
for T in 0.7 1.0; do
    python3 bench/acceptance.py --drafter $SHIPPED --prompts $PROMPTS/dev.jsonl --every 16 --shapes 4x5 --temp $T --out bench/results/acceptance-temp$T-every16.json
done

# 5. Speed against autoregressive decoding, batch 1, 4 and 8 (the RNN's
#    beams alone; v3 was measured with the then `--beam-widths 4
#    --beam-lengths 5`, which verified the same tree).
for B in 1 4 8; do
    redrafter-mlx bench --prompts $PROMPTS/dev.jsonl --every 44 --num-prompts 8 --max-tokens 64 --configs rnn:4x5 \
        --batch-size $B --json bench/results/bench-batch$B.json
done
