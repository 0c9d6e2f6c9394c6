#!/usr/bin/env bash
# Issue 15's lookup weighting, at equal data and equal steps: the v3 recipe
# (exit_dim 512, one residual block, 12,288 draft tokens) trained on the chat
# data distilled so far, with every target weighted alike and with targets
# that context lookup already drafts right weighted 0.3. Both drafters, and
# the shipped v3 for reference, are replayed on the greedy dev responses: the
# RNN alone and the RNN with one lookup continuation (the issue's measure).
# Every step resumes when rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=data/distill-smollm2-135m-chat
COMMON="--data $DATA --steps 300 --batch-size 512 --learning-rate 2e-3 --warmup 30 --exit-dim 512 --num-draft-layers 1 --draft-vocab 12288 --eval-every 300 --save-every 100"
redrafter-mlx train $COMMON --output runs/lookup-weight-1.0
redrafter-mlx train $COMMON --output runs/lookup-weight-0.3 --lookup-weight 0.3
for DRAFTER in redrafter_mlx/drafters/smollm2-135m-instruct runs/lookup-weight-1.0 runs/lookup-weight-0.3; do
    python3 bench/replay_acceptance.py --drafter $DRAFTER --data data/eval-dev-smollm2-135m --all --shapes 1x5,4x5 --lookup | tail -1
done
