"""Tokens per step and teacher-forced accuracy (depths 1-2) per prompt source
of dev, replayed on the greedy dev responses: the RNN alone at 4x5, with one
context-lookup continuation, and lookup alone. Run from the repository root:
    python3 bench/replay_by_source.py DRAFTER [DRAFTER ...]
"""
import sys, json
import redrafter_mlx
import numpy as np
from redrafter_mlx.base_model import BaseModel
from redrafter_mlx.distill import DataFolder
from redrafter_mlx.drafter import load_drafter
from redrafter_mlx.loading import load_base_model
from redrafter_mlx.replay import accepted_lengths, tokens_per_step, with_lookup
from redrafter_mlx.train import build_positions, cached_positions, compute_hidden_cache
sys.path.insert(0, "bench")
from replay_acceptance import teacher_forced_accuracy
base = BaseModel(load_base_model(None)[0])
folder = DataFolder("data/eval-dev-smollm2-135m"); seqs = folder.load()
hidden = compute_hidden_cache(base, folder, seqs, progress=False)
pos = build_positions(seqs, 5, 0.02, with_lookup=True)
counts = cached_positions(seqs); first = np.concatenate([[0], np.cumsum(counts)[:-1]])
src = [json.loads(l)["source"] for l in open("../shared/data/prompts/dev.jsonl")]
for path in sys.argv[1:]:
    d = load_drafter(path)
    for s in sorted(set(src)):
        keep = np.array([src[i] == s for i in seqs.prompt_index])
        rows = np.concatenate([np.arange(first[i], first[i] + counts[i]) for i in np.flatnonzero(keep)])
        w, h = pos.tokens[rows], hidden[pos.hidden_row[rows]]
        acc = teacher_forced_accuracy(d, getattr(d, "draft_token_ids", None), base.embed, h, w[:, :3], base.vocab_size)
        a = accepted_lengths(d, base.embed, h, w, 4)
        print(path, s, int(keep.sum()), "acc", acc, "4x5", round(tokens_per_step(a, counts[keep]), 3), "+lookup", round(tokens_per_step(with_lookup(a, pos.lookup_depth[rows], 5), counts[keep]), 3), "lookup", round(tokens_per_step(with_lookup(0*a, pos.lookup_depth[rows], 5), counts[keep]), 3), flush=True)
