"""Prompts files: JSONL, one prompt per line, in one of three fields.

- ``prompt``: a user message (the chat template is applied to it);
- ``messages``: a conversation ending where the model answers, a list of
  ``{"role", "content"}`` strings (the chat template is applied to it);
- ``tokens``: prompt token ids, used as they are.

``PromptLog`` appends the prompts that ``serve`` and ``chat`` answer to
such a file, so that ``distill --prompts`` can make a drafter's training
data from the very prompts the model serves.
"""

import json
import os
from pathlib import Path
from typing import Optional, Union

from ..errors import UserError

# A prompt as read: a user message, a conversation, or token ids.
Prompt = Union[str, list]


def _parse(record) -> Optional[Prompt]:
    """The prompt of one line's record, or None if it holds none."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("prompt"), str):
        return record["prompt"]
    messages = record.get("messages")
    if (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    tokens = record.get("tokens")
    if (
        isinstance(tokens, list)
        and tokens
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
    ):
        return tokens
    return None


def read_prompts(path: str) -> list[Prompt]:
    """The prompt of every line of a JSONL file (see the module docstring)."""
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
            raise UserError(f"{path}, line {number}, column {e.colno}: not valid JSON ({e.msg})") from None
        prompt = _parse(record)
        if prompt is None:
            raise UserError(
                f'{path}, line {number}: needs a "prompt" string, a "messages" list of {{"role", "content"}} strings, '
                'or a "tokens" list of token ids'
            )
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"prompts file {path} holds no prompts")
    return prompts


class PromptLog:
    """Appends prompts to a JSONL prompts file, one flushed line each.

    The file is only ever appended to. A line cut short by a crash is ended
    before the next is written, so it costs that one line (``read_prompts``
    names it), not the ones after. If writing fails (a full disk), the log
    says so once on ``warn`` and stops; what it holds is kept."""

    def __init__(self, path: str, warn=print):
        self.path, self.warn = path, warn
        try:
            self.file = open(path, "a", encoding="utf-8")
            if self.file.tell() > 0:
                with open(path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        self.file.write("\n")
        except OSError as e:
            raise UserError(f"cannot write the prompt log {path}: {e.strerror or e}") from None

    def add(self, prompt: Prompt) -> None:
        """Log a user message (str), a conversation (list of messages) or token ids (list of int)."""
        if self.file is None:
            return
        if isinstance(prompt, str):
            record = {"prompt": prompt}
        elif prompt and isinstance(prompt[0], dict):
            record = {"messages": prompt}
        else:
            record = {"tokens": [int(t) for t in prompt]}
        try:
            self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.file.flush()
        except OSError as e:
            self.warn(f"warning: the prompt log {self.path} stopped: {e.strerror or e}")
            self.close()

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
            self.file = None
