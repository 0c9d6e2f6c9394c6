#!/usr/bin/env bash
# How the shipped drafter for SmolLM2-135M-Instruct is made and measured, on a
# 2-core Linux CPU (float32, OpenBLAS). Every step resumes when rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=../shared/data/prompts
DATA=data/distill-smollm2-135m
RUN=runs/smollm2-135m-drafter
SHIPPED=redrafter_mlx/drafters/smollm2-135m-instruct

# 1. The base model's greedy responses to the training prompts (~80 min here).
redrafter-mlx distill --prompts $PROMPTS/train.jsonl --output $DATA --batch-size 64 --max-tokens 256

# 2. Train (hidden states come from distill's cache, else are recomputed).
redrafter-mlx train --data $DATA --output $RUN --steps 2500 --batch-size 512 --learning-rate 2e-3 \
    --warmup 100 --exit-dim 512 --num-draft-layers 1 --draft-vocab 4096 --eval-every 500 --save-every 250

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

# 4. Tokens per step on the dev prompts, 256 new tokens, greedy and sampled:
#    4x5 over all of dev.jsonl (53 min here); the other shapes over every
#    other prompt, and sampling over every 16th (CPU time). Per-prompt
#    figures are kept, so greedy 4x5 on a subset is recomputed from the full run.
python3 bench/acceptance.py --drafter $SHIPPED --prompts $PROMPTS/dev.jsonl --shapes 4x5 --out bench/results/acceptance-greedy.json
python3 bench/acceptance.py --drafter $SHIPPED --prompts $PROMPTS/dev.jsonl --every 2 --shapes 1x5,2x5,8x5 --out bench/results/acceptance-greedy-every2.json
for T in 0.7 1.0; do
    python3 bench/acceptance.py --drafter $SHIPPED --prompts $PROMPTS/dev.jsonl --every 16 --shapes 4x5 --temp $T --out bench/results/acceptance-temp$T-every16.json
done

# 5. Speed against autoregressive decoding, batch 1, 4 and 8.
for B in 1 4 8; do
    redrafter-mlx bench --prompts $PROMPTS/dev.jsonl --every 44 --num-prompts 8 --max-tokens 64 --beam-widths 4 \
        --beam-lengths 5 --batch-size $B --json bench/results/bench-batch$B.json
done
