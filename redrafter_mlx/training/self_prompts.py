"""Prompts the base model writes itself, for distillation with no data set.

A chat model that is given its chat template up to the start of a user's
message, and nothing else, writes a plausible user message (the Magpie
method). ``write_self_prompts`` samples such user turns, drops the empty,
the truncated (no end of turn within ``max_tokens``) and the duplicates,
and keeps them in a JSONL prompts file that ``distill --prompts`` reads as
it is. The prompt of attempt k is sampled with ``row_seed(seed, k)``, so it
depends on nothing else: an interrupted run resumes from the file and ends
with the same prompts.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from .. import files
from ..errors import UserError

PROMPTS_FILE = "self-prompts.jsonl"  # beside the shards of a data folder
SOURCE = "self-prompts"
MARKER = "SELFPROMPTMARKER"


@dataclass
class UserTurn:
    """header: token ids of the chat template up to where a user's message
    begins (system turn and all); stop: token ids that end the message."""

    header: list
    stop: set


def user_turn(tokenizer) -> UserTurn:
    """Where the chat template puts a user's message, or one clear error."""
    if not tokenizer.has_chat_template:
        raise UserError(
            "writing its own prompts needs a model with a chat template (the model writes user turns of it)"
        )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": MARKER}], tokenize=False, add_generation_prompt=False
    )
    at = text.find(MARKER)
    if at <= 0:
        raise UserError("self-written prompts: the model's chat template does not show where a user's message begins")
    header = tokenizer.encode(text[:at], add_special_tokens=False)
    suffix = tokenizer.encode(text[at + len(MARKER) :], add_special_tokens=False)
    return UserTurn(header, set(tokenizer.eos_token_ids) | set(suffix[:1]))


def read_self_prompts(path: Path) -> list[dict]:
    """The records written so far ({"prompt", "source", "attempt"}), in order."""
    if not path.exists():
        return []
    try:
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        for record in records:
            if not (
                isinstance(record, dict)
                and isinstance(record.get("prompt"), str)
                and isinstance(record.get("attempt"), int)
            ):
                raise ValueError('every line needs a "prompt" string and an "attempt" number')
        return records
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"cannot read {path} ({e}); delete it to write the prompts again") from None


def _write_records(path: Path, records: list[dict]) -> None:
    files.write_text(
        path,
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
        "the prompts written before are kept: free space and run the same command again to resume",
    )


def write_self_prompts(
    base,
    decode,
    turn: UserTurn,
    count: int,
    path: Path,
    *,
    seed: int = 0,
    temp: float = 1.0,
    batch_size: int = 64,
    max_tokens: int = 128,
    max_attempts: int = 0,
    progress: bool = True,
) -> list[str]:
    """Sample user turns until ``count`` distinct prompts are in ``path``
    (resuming from what it holds) and return them. ``decode`` turns token
    ids into text. The file is rewritten whole after every batch of
    ``batch_size`` attempts. Gives up with an error (keeping what was
    written) after ``max_attempts`` attempts (default 20 per prompt).
    """
    from tqdm import tqdm

    from ..engine.autoregressive import autoregressive_steps
    from ..engine.sampling import SamplingSettings, make_chooser, row_seed

    if count < 1:
        raise UserError(f"the number of self-written prompts must be at least 1, got {count}")
    max_attempts = max_attempts or 20 * count
    records = read_self_prompts(path)[:count]
    seen = {r["prompt"] for r in records}
    attempt = max((r["attempt"] for r in records), default=-1) + 1
    bar = tqdm(
        total=count,
        initial=len(records),
        unit="prompt",
        desc="writing prompts",
        disable=not progress,
        dynamic_ncols=True,
    )
    while len(records) < count:
        if attempt >= max_attempts:
            raise UserError(
                f"the model wrote only {len(records)} distinct prompts in {attempt} attempts (kept in {path}); "
                "ask for fewer, or use a prompts file"
            )
        attempts = list(range(attempt, min(attempt + batch_size, max_attempts)))
        choose = make_chooser(SamplingSettings(temp=temp, row_seeds=[row_seed(seed, k) for k in attempts]))
        written = {}
        for step in autoregressive_steps(
            base, [turn.header] * len(attempts), max_tokens=max_tokens, choose=choose, eos_token_ids=sorted(turn.stop)
        ):
            for out in step:
                written.setdefault(out.row, []).extend(out.tokens)
                if out.finish_reason == "length":
                    written[out.row] = None  # truncated: no end of turn
        for row, k in enumerate(attempts):
            if written.get(row) is None or len(records) == count:
                continue
            text = decode(written[row]).strip()
            if text and text not in seen:
                seen.add(text)
                records.append({"prompt": text, "source": SOURCE, "attempt": k})
                bar.update(1)
        attempt = attempts[-1] + 1
        _write_records(path, records)
    bar.close()
    return [r["prompt"] for r in records]
