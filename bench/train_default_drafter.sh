#!/usr/bin/env bash
# How the shipped drafter (v4) for SmolLM2-135M-Instruct is made and measured,
# on a 2-core Linux CPU (float32, OpenBLAS). Every step resumes when rerun.

set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=data/prompts
DATA=data/distill-smollm2-135m
RUN=runs/smollm2-135m-drafter-v4-self-2800
SHIPPED=redrafter_mlx/drafters/smollm2-135m-instruct

# 1. The base model's answers to task prompts (train.jsonl): greedy (~140
#    min), sampled at temperature 0.7 (stopped after the 2,048 shortest
#    prompts: rerun to extend it), and eight samples of each open-ended seed
#    task, leaving out the 8 whose greedy answers the trainer holds out.
redrafter-mlx distill --prompts $PROMPTS/train.jsonl --output $DATA --batch-size 64 --max-tokens 256
redrafter-mlx distill --prompts $PROMPTS/train.jsonl --output $DATA-t0.7 --batch-size 64 --max-tokens 256 --temp 0.7 --seed 1
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
#    The greedy folder without its 5 last shards (the 1,269 longest prompts,
#    nearly all P3 documents: 36 % of its prefill for 22 % of its positions).
mkdir -p $DATA-short
ln -sf ../distill-smollm2-135m/meta.json $DATA-short/meta.json
for I in $(seq -w 0 20); do ln -sf ../distill-smollm2-135m/shard-000$I.npz $DATA-short/shard-000$I.npz; done

# 2. Open-ended prompts the model writes itself (--self-prompts), answered
#    greedily: 256 + 768 + 1,536 prompts (~50 min in all).
redrafter-mlx distill --self-prompts 256 --output data/self-smollm2-135m --batch-size 64 --max-tokens 128 --workers 2
redrafter-mlx distill --self-prompts 768 --seed 1 --output data/self-smollm2-135m-s1 --batch-size 64 --max-tokens 256 --workers 2
redrafter-mlx distill --self-prompts 1536 --seed 2 --output data/self-smollm2-135m-s2 --batch-size 64 --max-tokens 256 --workers 2

# 3. Train (~65 min): warm start from the base model's head (kept frozen),
#    the hidden-state loss, one residual block, 12,288 draft tokens.
redrafter-mlx train --data $DATA-short --data $DATA-t0.7 --data $DATA-seed-t0.7 --data data/self-smollm2-135m \
    --data data/self-smollm2-135m-s1 --data data/self-smollm2-135m-s2 --output $RUN --steps 2800 --batch-size 512 \
    --learning-rate 2e-3 --warmup 100 --exit-dim 576 --warm-start --freeze-head-steps 2800 --hidden-loss 1 \
    --num-draft-layers 1 --draft-vocab 12288 --eval-every 700 --save-every 200

# 4. Ship it in float16, naming the base model it was made for.
python3 - <<PY
import redrafter_mlx  # first: it loads OpenBLAS before mlx.core
import mlx.core as mx
from pathlib import Path
from redrafter_mlx.drafting.drafter import load_drafter, read_config, save_drafter
redrafter, _ = redrafter_mlx.load(drafter="none")
drafter = load_drafter("$RUN")
drafter.set_dtype(mx.float16)  # floating arrays only: token ids stay int32
config = read_config(Path("$RUN") / "config.json")
save_drafter(drafter, "$SHIPPED", {
    "base_model": {"name": "SmolLM2-135M-Instruct", "identity": redrafter.identity},
    "training": config.get("training", {}),
})
PY

# 4b. Its datastore: the answers in every training data folder
#    made for this model (train-chat.jsonl's and a fourth self-prompts folder
#    included), prompts the trainer holds out left out.
redrafter-mlx distill --prompts $PROMPTS/train-chat.jsonl --output $DATA-chat --batch-size 64 --max-tokens 256 --workers 2
redrafter-mlx distill --self-prompts 1536 --seed 3 --output data/self-smollm2-135m-s3 --batch-size 64 --max-tokens 256 --workers 2
redrafter-mlx datastore --drafter $SHIPPED --data $DATA --data $DATA-t0.7 --data $DATA-seed-t0.7 --data $DATA-chat \
    --data data/self-smollm2-135m --data data/self-smollm2-135m-s1 --data data/self-smollm2-135m-s2 --data data/self-smollm2-135m-s3

# 5. Greedy tokens per step and teacher-forced accuracy on all 352 dev
#    prompts, 256 new tokens, replayed on the base model's greedy answers
#    (made once, for evaluation only: never trained on), each shape alone and
#    with one context-lookup continuation; then per prompt source.
redrafter-mlx distill --prompts $PROMPTS/dev.jsonl --output data/eval-dev-smollm2-135m --batch-size 64 --max-tokens 256
python3 bench/replay_acceptance.py --drafter $SHIPPED --data data/eval-dev-smollm2-135m --all --shapes 1x5,2x5,4x5,8x5 \
    --lookup > bench/results/drafter/replay-dev-greedy-v4.jsonl
python3 bench/replay_by_source.py $SHIPPED > bench/results/drafter/replay-dev-by-source-v4.jsonl

# 6. The default generate settings against plain decoding, alternating per
#    prompt, on every 5th dev prompt (64), 256 new tokens, greedy.
redrafter-mlx bench --prompts $PROMPTS/dev.jsonl --every 5 --num-prompts 64 --max-tokens 256 --configs auto --calibrate \
    --json bench/results/speed/bench-v4-auto-batch1-dev64.json
