#!/usr/bin/env bash
# Issue 15's recipe changes at equal data and equal steps, judged by the
# issue's measure: greedy tokens per step replayed on all 352 dev responses,
# the RNN alone and with one context-lookup continuation in the tree, plus
# teacher-forced accuracy per depth (2-core CPU, float32). The data are the
# open-ended folders: greedy chat answers, answers to self-written prompts,
# sampled answers to the self-instruct seed tasks (670,000 positions). Every
# step resumes when rerun; results go to
# bench/results/recipe-ablation-dev.jsonl, one line per drafter.
# DATA replaces the folders (TAG then names the runs apart), TEMP > 0 adds
# depth-1 agreement with the base model's samples at that temperature.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-600}
DATA=${DATA:-"--data data/distill-smollm2-135m-chat --data data/self-smollm2-135m --data data/distill-smollm2-135m-seed-t0.7"}
TAG=${TAG:+$TAG-}
COMMON="$DATA --steps $STEPS --batch-size 512 --learning-rate 2e-3 --warmup 50 --draft-vocab 12288 --eval-every $STEPS --save-every 100"
WARM="--exit-dim 576 --warm-start"
declare -A RUNS=(
    [v3-recipe]="--exit-dim 512 --num-draft-layers 1"
    [warm-hidden]="$WARM --num-draft-layers 1 --hidden-loss 1"
    [warm-hidden-frozen]="$WARM --num-draft-layers 1 --hidden-loss 1 --freeze-head-steps $STEPS"
    [warm-hidden-frozen-3]="$WARM --num-draft-layers 3 --hidden-loss 1 --freeze-head-steps $STEPS"
    [warm-hidden-frozen-soft]="$WARM --num-draft-layers 1 --hidden-loss 1 --freeze-head-steps $STEPS --soft-targets 1"
)
for NAME in ${ONLY:-v3-recipe warm-hidden warm-hidden-frozen warm-hidden-frozen-3}; do
    RUN=runs/dev-ablation-$STEPS-$TAG$NAME
    [[ -f $RUN/model.safetensors ]] || redrafter-mlx train $COMMON ${RUNS[$NAME]} --output $RUN
    grep -q "\"$RUN\"" bench/results/recipe-ablation-dev.jsonl 2>/dev/null || \
        python3 bench/replay_acceptance.py --drafter $RUN --data data/eval-dev-smollm2-135m --all --shapes 1x5,4x5 --lookup ${TEMP:+--temp $TEMP} \
        | tail -1 >> bench/results/recipe-ablation-dev.jsonl
done
