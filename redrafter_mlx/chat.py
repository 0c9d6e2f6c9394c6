"""Interactive multi-turn chat, streaming each answer as ReDrafter accepts it."""

import signal
import time
from dataclasses import dataclass

from .api import stream_generate

HELP = "Commands: /reset clears the conversation, /stats shows speed figures, /quit leaves (or Ctrl-D). Ctrl-C stops an answer."


@dataclass
class Stats:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    step_tokens: int = 0

    def add(self, other: "Stats") -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.steps += other.steps
        self.step_tokens += other.step_tokens

    def describe(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        per_step = self.step_tokens / self.steps if self.steps else 0.0
        return f"{self.tokens} tokens, {rate:.1f} tokens/s, {per_step:.2f} tokens per step ({self.steps} steps)"


def answer(redrafter, tokenizer, messages: list, max_tokens: int, write, **generation) -> tuple[str, Stats, bool]:
    """Stream one answer; returns (text, stats, interrupted). Ctrl-C at any
    point, prompt processing included, ends the answer where it stands."""
    text, stats, interrupted = "", Stats(), False
    tic = time.perf_counter()
    try:
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        for response in stream_generate(redrafter, tokenizer, prompt_ids, max_tokens, **generation):
            write(response.text)
            text += response.text
            stats.tokens, stats.steps, stats.step_tokens = response.generation_tokens, response.steps, response.step_tokens
    except KeyboardInterrupt:
        interrupted = True
    stats.seconds = time.perf_counter() - tic
    return text, stats, interrupted


def chat_loop(redrafter, tokenizer, max_tokens: int, system_prompt=None, read=input, write=print, **generation) -> None:
    """Read a message, stream the answer, repeat; see HELP."""
    # A shell starts background jobs with SIGINT ignored, and Python then
    # never raises KeyboardInterrupt; Ctrl-C must stop an answer regardless.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    def out(segment: str) -> None:
        write(segment, end="", flush=True)

    def start() -> list:
        return [{"role": "system", "content": system_prompt}] if system_prompt else []

    messages, last, session = start(), Stats(), Stats()
    write(f"[ReDrafter chat. {HELP}]")
    while True:
        try:
            query = read(">> ")
        except EOFError:
            write()
            return
        except KeyboardInterrupt:
            write()
            continue
        command = query.strip()
        if command == "/quit":
            return
        if command == "/reset":
            messages = start()
            write("[conversation cleared]")
            continue
        if command == "/stats":
            write(f"[last answer: {last.describe()}]")
            write(f"[session: {session.describe()}]")
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": query})
        text, last, interrupted = answer(redrafter, tokenizer, messages, max_tokens, out, **generation)
        session.add(last)
        # What was shown is what the model said, so a stopped answer stays
        # in the conversation as it stands.
        messages.append({"role": "assistant", "content": text})
        write(" [stopped]" if interrupted else "")
