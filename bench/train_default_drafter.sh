#!/usr/bin/env bash
# How the shipped drafter (v4) for SmolLM2-135M-Instruct is made and measured,
# on a 2-core Linux CPU (float32, OpenBLAS): one `redrafter-mlx make-drafter`
# run with a plan written by hand, the recipe v4 was made with. Every stage
# resumes when rerun (the work stays in runs/smollm2-135m-drafter-v4.make/).
#
# The plan's runs, in the order they are distilled:
#   greedy answers to the 4,224 shortest prompts of train.jsonl (training),
#   and to all of them (the datastore); answers at temperature 0.7 to its
#   2,048 shortest (seed 1), and eight each to the open-ended self-instruct
#   seed tasks the trainer does not hold out (seed 2); greedy answers to
#   256 + 768 + 1,536 user turns the model writes itself (seeds 0, 1, 2);
#   for the datastore only, greedy answers to the 5,376 shortest prompts of
#   train-chat.jsonl and to 1,536
#   more self-written turns (seed 3). Training: warm start from the model's
#   head (kept frozen), the hidden-state loss, one residual block, 12,288
#   draft tokens, 2,800 steps of 512 positions. The speed is measured on the
#   48 held-out requests at temperatures 0 and 0.7.
#
# Then the drafter is copied where the package ships it.

set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=data/prompts
RUN=runs/smollm2-135m-drafter-v4
SHIPPED=redrafter_mlx/drafters/smollm2-135m-instruct
mkdir -p runs

python3 - <<PY
import json
rows = [json.loads(line) for line in open("$PROMPTS/train.jsonl")]
with open("runs/prompts-self-instruct-seed.jsonl", "w") as f:
    for i, row in enumerate(rows):
        if row["source"] == "self-instruct-seed" and i % 50 != 0:
            f.write(json.dumps(row) + "\n")
steps = 2800
plan = {
    "runs": [
        {"name": "greedy-short", "prompts": "$PROMPTS/train.jsonl", "shortest": 4224, "temp": 0.0, "seed": 0, "max_tokens": 256, "train_only": True},
        {"name": "greedy", "prompts": "$PROMPTS/train.jsonl", "temp": 0.0, "seed": 0, "max_tokens": 256, "datastore_only": True},
        {"name": "t0.7", "prompts": "$PROMPTS/train.jsonl", "shortest": 2048, "temp": 0.7, "seed": 1, "max_tokens": 256},
        {"name": "seed-t0.7", "prompts": "runs/prompts-self-instruct-seed.jsonl", "temp": 0.7, "seed": 2, "samples": 8, "max_tokens": 256},
        {"name": "self", "self_prompts": 256, "temp": 0.0, "seed": 0, "max_tokens": 128},
        {"name": "self-s1", "self_prompts": 768, "temp": 0.0, "seed": 1, "max_tokens": 256},
        {"name": "self-s2", "self_prompts": 1536, "temp": 0.0, "seed": 2, "max_tokens": 256},
        {"name": "chat", "prompts": "$PROMPTS/train-chat.jsonl", "shortest": 5376, "temp": 0.0, "seed": 0, "max_tokens": 256, "datastore_only": True},
        {"name": "self-s3", "self_prompts": 1536, "temp": 0.0, "seed": 3, "max_tokens": 256, "datastore_only": True},
    ],
    "train": {"steps": steps, "batch_size": 512, "learning_rate": 2e-3, "warmup": 100, "exit_dim": 576, "warm_start": True,
              "freeze_head_steps": steps, "hidden_loss": 1.0, "num_draft_layers": 1, "draft_vocab": 12288, "eval_every": 700,
              "save_every": 200, "seed": 0},
    "measure": {"prompts_file": "$PROMPTS/heldout.jsonl", "prompts": 48, "max_tokens": 256, "temps": [0.0, 0.7]},
}
json.dump(plan, open("runs/smollm2-135m-drafter-v4.plan.json", "w"), indent=1)
PY

redrafter-mlx make-drafter --plan runs/smollm2-135m-drafter-v4.plan.json --output $RUN --workers 2

rm -rf "$SHIPPED" && cp -r "$RUN" "$SHIPPED"

# Greedy tokens per step and teacher-forced accuracy on all 352 dev prompts,
# 256 new tokens, replayed on the base model's greedy answers (made once, for
# evaluation only: never trained on); then the default settings against plain
# decoding on every 5th dev prompt.
redrafter-mlx distill --prompts $PROMPTS/dev.jsonl --output data/eval-dev-smollm2-135m --batch-size 64 --max-tokens 256 --workers 2
python3 bench/replay_acceptance.py --drafter $SHIPPED --data data/eval-dev-smollm2-135m --all --shapes 1x5,2x5,4x5,8x5 \
    --lookup > bench/results/drafter/replay-dev-greedy-v4.jsonl
redrafter-mlx bench --prompts $PROMPTS/dev.jsonl --every 5 --num-prompts 64 --max-tokens 256 --configs auto --calibrate \
    --json bench/results/speed/bench-v4-auto-batch1-dev64.json
