"""How long should the floor's losing window be?

Greedy, 128 tokens, batch 1: per prompt, plain decoding, then the default
generation once per window length (``speculator.WINDOW`` set before each
run, each length with an acceptance history of its own), alternating.

    python3 bench/research/floor/floor_window.py PROMPTS EVERY NUM WINDOWS
    python3 bench/research/floor/floor_window.py data/prompts/tune.jsonl 2 24 8,32,100000
"""
import json, sys, statistics
import redrafter_mlx
from redrafter_mlx.drafting import speculator as S
from redrafter_mlx.engine.types import ReDrafter
from redrafter_mlx.engine.sampling import greedy
from redrafter_mlx.serving.api import encode_prompt
from redrafter_mlx.serving.bench import calibration, baseline_run, redrafter_run, Config
from redrafter_mlx.drafting.settings import DraftSettings

path, every, num, windows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(w) for w in sys.argv[4].split(",")]
rd, tok = redrafter_mlx.load()
texts = [json.loads(l)["prompt"] for l in open(path)][::every][:num]
eos = list(tok.eos_token_ids)
curve = calibration(rd, 1)
used = {w: ReDrafter(rd.base, rd.drafter, rd.identity, rd.drafter_identity, datastore=rd.datastore) for w in windows}
cfg = Config("auto", DraftSettings())
p0 = encode_prompt(tok, texts[0])
baseline_run(rd, [p0], 8, greedy, eos)
for w in windows:
    S.WINDOW = w
    redrafter_run(used[w], [p0], 128, greedy, eos, cfg, curve=curve)
res = {w: [] for w in windows}
stp = {w: [0, 0] for w in windows}
for i, t in enumerate(texts):
    p = encode_prompt(tok, t)
    base = baseline_run(rd, [p], 128, greedy, eos)
    line = []
    for w in windows:
        S.WINDOW = w
        r = redrafter_run(used[w], [p], 128, greedy, eos, cfg, curve=curve)
        assert r.tokens == base.tokens, "output differs from plain decoding"
        res[w].append(r.tokens_per_second / base.tokens_per_second)
        stp[w][0] += r.steps; stp[w][1] += r.step_tokens
        line.append(f"w{w} {res[w][-1]:.2f}x {r.step_tokens / max(r.steps, 1):.2f}")
    print(i + 1, ", ".join(line), flush=True)
for w in windows:
    print(f"window {w}: median {statistics.median(res[w]):.3f}x min {min(res[w]):.2f} max {max(res[w]):.2f}, tok/step {stp[w][1] / stp[w][0]:.2f}")
