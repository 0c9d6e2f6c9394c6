#!/usr/bin/env bash
# Issue 15's recipe changes at small scale, on a 2-core CPU (float32): equal
# data (the default model's greedy answers to 256 prompts it wrote itself)
# and equal steps; each run reports teacher-forced top-1 accuracy per depth on
# its held-out sequences (every 50th prompt). Every step resumes when rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=data/self-smollm2-135m
redrafter-mlx distill --self-prompts 256 --output $DATA --batch-size 64 --max-tokens 128 --workers 2
COMMON="--data $DATA --steps 150 --batch-size 512 --learning-rate 2e-3 --warmup 20 --num-draft-layers 1 --draft-vocab 4096 --eval-every 150 --save-every 150"
redrafter-mlx train $COMMON --output runs/ablation-512 --exit-dim 512
redrafter-mlx train $COMMON --output runs/ablation-576 --exit-dim 576
redrafter-mlx train $COMMON --output runs/ablation-576-warm --exit-dim 576 --warm-start
redrafter-mlx train $COMMON --output runs/ablation-576-warm-hidden --exit-dim 576 --warm-start --hidden-loss 1.0
for RUN in runs/ablation-*; do
    echo "$RUN $(tail -1 $RUN/train_log.jsonl)"
done
