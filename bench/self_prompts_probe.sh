#!/usr/bin/env bash
# Issue 15: how much of the default drafter's data should come from prompts the
# model writes itself. Each source's first 165,000 response positions train the
# same one-layer probe for the same 200 steps (bench/context_drafter_probe.py,
# no attention: the RNN's depth 1), measured on the dev greedy replay per dev
# source. Results append to runs/context-probe/results.jsonl
# (bench/results/self-prompts-probe-dev.jsonl; bench/results/recipe-ablation-dev.md, session 18).
set -euo pipefail
common=(--max-positions 165000 --variants none --steps 200 --warmup 20 --batch-tokens 4096
        --dev data/eval-dev-smollm2-135m --dev-prompts ../shared/data/prompts/dev.jsonl)
probe() { PYTHONPATH=. python3 bench/context_drafter_probe.py "$@" "${common[@]}"; }
probe --data data/self-smollm2-135m --data data/self-smollm2-135m-s1
probe --data data/distill-smollm2-135m-chat
probe --data data/distill-smollm2-135m-seed-t0.7
probe --data data/distill-smollm2-135m-short
probe --data data/self-smollm2-135m --data data/self-smollm2-135m-s1:1 --data data/distill-smollm2-135m-chat
probe --data data/self-smollm2-135m --data data/self-smollm2-135m-s1:1 --data data/distill-smollm2-135m-short
