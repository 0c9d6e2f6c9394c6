"""The text openings a pretrained model's drafter trains on: the first
words of each prompt of ``data/prompts/train.jsonl`` and
``train-chat.jsonl`` (sources and licences in ``data/prompts/README.md``),
cut at a word boundary after 12 to 40 words (a seeded choice per prompt),
given to the model as plain text to continue.

    python3 scripts/make_openings.py > data/prompts/openings-train.jsonl
"""

import json
import random
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent.parent / "data" / "prompts"

rng = random.Random(0)
for name in ("train.jsonl", "train-chat.jsonl"):
    for line in (PROMPTS / name).read_text().splitlines():
        row = json.loads(line)
        words = row["prompt"].split()
        if len(words) < 8:
            continue
        cut = min(len(words), rng.randint(12, 40))
        print(json.dumps({"id": f"opening-{row['id']}", "source": row["source"], "prompt": " ".join(words[:cut])}))
