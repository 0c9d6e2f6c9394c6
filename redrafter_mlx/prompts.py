"""Prompts files: JSONL with a ``prompt`` field per line."""

import json
from pathlib import Path

from .errors import UserError


def read_prompts(path: str) -> list[str]:
    """The ``prompt`` field of every line of a JSONL file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"prompts file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read prompts file {path}: {e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}, line {number}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise UserError(f'{path}, line {number}: needs a "prompt" field holding a string')
        prompts.append(record["prompt"])
    if not prompts:
        raise UserError(f"prompts file {path} holds no prompts")
    return prompts
