"""When should a run turn the RNN off? Greedy, batch 1: per prompt, plain
decoding, then the default generation once per variant (each with an
acceptance history of its own), the variants' order reversed on every
other prompt. A variant sets module constants of ``drafting.speculator``;
``RNN_FIRST_STEPS`` exists only with ``rnn-first-steps.patch`` applied
(the RNN steps a run takes before either rule may turn the RNN off; 1 is
the engine as it was, a very large number keeps the RNN on throughout).
Run from the repository root, so that the patched package is imported.

    git apply bench/research/policy/rnn-first-steps.patch
    python3 bench/research/policy/rnn_switch.py data/prompts/tune.jsonl 2 24 128 old,first4,first8
    python3 bench/research/policy/rnn_switch.py data/prompts/tune.jsonl 2 24 128 old,always
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())

import redrafter_mlx  # noqa: E402
from redrafter_mlx.drafting import speculator as S  # noqa: E402
from redrafter_mlx.drafting.settings import DraftSettings  # noqa: E402
from redrafter_mlx.engine.sampling import greedy  # noqa: E402
from redrafter_mlx.engine.types import ReDrafter  # noqa: E402
from redrafter_mlx.serving.api import encode_prompt  # noqa: E402
from redrafter_mlx.serving.bench import Config, baseline_run, calibration, redrafter_run  # noqa: E402

VARIANTS = {"old": {"RNN_FIRST_STEPS": 1}, "first4": {"RNN_FIRST_STEPS": 4}, "first8": {"RNN_FIRST_STEPS": 8},
            "always": {"RNN_FIRST_STEPS": 10**9}}
DEFAULTS = {k: getattr(S, k) for k in dir(S) if k.isupper()}


def use(name):
    for k, v in {**DEFAULTS, **VARIANTS[name]}.items():
        setattr(S, k, v)


path, every, num, max_tokens, names = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5].split(",")
rd, tok = redrafter_mlx.load()
texts = [json.loads(line)["prompt"] for line in open(path)][::every][:num]
eos = list(tok.eos_token_ids)
curve = calibration(rd, 1)
pairs = {n: ReDrafter(rd.base, rd.drafter, rd.identity, rd.drafter_identity, datastore=rd.datastore) for n in names}
config = Config("auto", DraftSettings())
first = encode_prompt(tok, texts[0])
baseline_run(rd, [first], 8, greedy, eos)
for n in names:
    use(n)
    redrafter_run(pairs[n], [first], max_tokens, greedy, eos, config, curve=curve)
speedups, counts = {n: [] for n in names}, {n: [0, 0, 0] for n in names}
for i, text in enumerate(texts):
    prompt = encode_prompt(tok, text)
    base = baseline_run(rd, [prompt], max_tokens, greedy, eos)
    line = []
    for n in names if i % 2 == 0 else names[::-1]:
        use(n)
        run = redrafter_run(pairs[n], [prompt], max_tokens, greedy, eos, config, curve=curve)
        assert run.tokens == base.tokens, "output differs from plain decoding"
        speedups[n].append(run.tokens_per_second / base.tokens_per_second)
        for j, v in enumerate((run.steps, run.step_tokens, run.step_nodes)):
            counts[n][j] += v
        line.append(f"{n} {speedups[n][-1]:.2f}x {run.step_tokens / max(run.steps, 1):.2f}")
    print(i + 1, ", ".join(line), flush=True)
for n in names:
    s = speedups[n]
    print(f"{n}: median {statistics.median(s):.3f}x mean {statistics.mean(s):.3f} min {min(s):.2f} max {max(s):.2f}, "
          f"tok/step {counts[n][1] / counts[n][0]:.2f} nodes/step {counts[n][2] / counts[n][0]:.2f}")
