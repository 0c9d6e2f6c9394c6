"""Interactive multi-turn chat, streaming each answer as ReDrafter accepts it."""

import signal
import threading
import time
from dataclasses import dataclass

from ..engine.prompt_cache import make_prompt_cache
from ..engine.sampling import SamplingSettings
from .api import encode_prompt, stream_steps

# What chat samples with when neither the user nor the model says otherwise:
# greedy decoding of a small model soon repeats itself, so a chat samples, as
# local chat apps do.
CHAT_SAMPLING = {"temp": 0.7, "top_p": 0.9}
# generation_config.json's sampling fields, as SamplingSettings names them.
GENERATION_CONFIG_FIELDS = {
    "temperature": "temp",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}

HELP = "Commands: /help lists them, /reset clears the conversation, /stats shows speed figures, /quit (or exit, quit, Ctrl-D) leaves. Ctrl-C stops an answer."
QUIT = ("/quit", "/exit", "exit", "quit")


def chat_sampling(recommended: dict, **given) -> SamplingSettings:
    """What ``chat`` samples with: each setting ``given`` (None: not given);
    for the rest, the model's recommendation when it ships one
    (``recommended``: its generation_config.json, where ``do_sample`` false
    recommends greedy decoding), else ``CHAT_SAMPLING``."""
    model = {
        field: recommended[key] for key, field in GENERATION_CONFIG_FIELDS.items() if recommended.get(key) is not None
    }
    if recommended.get("do_sample") is False:
        model = {"temp": 0.0}
    defaults = model or CHAT_SAMPLING
    return SamplingSettings(**dict(defaults, **{k: v for k, v in given.items() if v is not None}))


@dataclass
class Stats:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    step_tokens: int = 0
    first_token_seconds: float = 0.0  # from the message to its answer's first token
    cached_tokens: int = 0  # prompt tokens the conversation's cache held
    finish_reason: str = ""  # the last answer's: "stop", "length", or "" when interrupted

    def add(self, other: "Stats") -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.steps += other.steps
        self.step_tokens += other.step_tokens

    def describe(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        per_step = self.step_tokens / self.steps if self.steps else 0.0
        return f"{self.tokens} tokens, {rate:.1f} tokens/s, {per_step:.2f} tokens per step ({self.steps} steps)"

    def describe_prompt(self) -> str:
        return f"first token after {self.first_token_seconds:.2f} s, {self.cached_tokens} prompt tokens from the cache"


def answer(
    redrafter, tokenizer, messages: list, max_tokens: int, write, prompt_cache=None, stop=None, **generation
) -> tuple[str, Stats, bool]:
    """Stream one answer; returns (text, stats, interrupted). Ctrl-C at any
    point, prompt processing included, ends the answer where it stands.
    With ``prompt_cache``, only what the cache does not hold is prefilled,
    and the cache then holds the conversation with this answer. ``stop`` (a
    ``threading.Event``, set by ``chat_loop``'s Ctrl-C handler) also ends
    it at the next step, should library code have swallowed the
    KeyboardInterrupt."""
    text, stats, interrupted = "", Stats(), False
    tic = time.perf_counter()
    try:
        prompt_ids = encode_prompt(tokenizer, messages)
        for response in stream_steps(
            redrafter, tokenizer, prompt_ids, max_tokens, prompt_cache=prompt_cache, **generation
        ):
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            if response.num_accepted is None:
                stats.first_token_seconds, stats.cached_tokens = time.perf_counter() - tic, response.cached_tokens
            write(response.text)
            text += response.text
            stats.tokens, stats.steps, stats.step_tokens = (
                response.generation_tokens,
                response.steps,
                response.step_tokens,
            )
            stats.finish_reason = response.finish_reason or ""
    except KeyboardInterrupt:
        interrupted = True
    stats.seconds = time.perf_counter() - tic
    return text, stats, interrupted


def chat_loop(
    redrafter,
    tokenizer,
    max_tokens: int,
    system_prompt=None,
    read=input,
    write=print,
    prompt_log=None,
    dim=lambda text: text,
    **generation,
) -> None:
    """Read a message, stream the answer, repeat; see HELP. With
    ``prompt_log`` (a ``PromptLog``), each conversation answered is logged.
    A line starting with ``/`` is a command, never a message; ``exit`` or
    ``quit`` alone on a line leaves as ``/quit`` does. ``dim`` marks the
    notes written after an answer (a terminal dims them)."""
    # A shell starts background jobs with SIGINT ignored, and Python then
    # never raises KeyboardInterrupt; Ctrl-C must stop an answer regardless.
    # The handler also records the press, cleared before each answer.
    pressed = threading.Event()

    def on_ctrl_c(signum, frame):
        pressed.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)

    def out(segment: str) -> None:
        write(segment, end="", flush=True)

    def start() -> list:
        return [{"role": "system", "content": system_prompt}] if system_prompt else []

    # The conversation's keys and values, kept between turns; the engine
    # reuses whatever prefix of the next prompt it holds, so a stopped answer
    # or a template that writes an answer back differently costs only the
    # tokens that differ.
    messages, last, session, cache = start(), Stats(), Stats(), make_prompt_cache()
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
        if command.startswith("/") or command.lower() in QUIT:
            command = command.lower()  # commands are not case-sensitive
        if command in QUIT:
            return
        if command == "/help":
            write(f"[{HELP}]")
            continue
        if command == "/reset":
            messages = start()
            cache.clear()
            write("[conversation cleared]")
            continue
        if command == "/stats":
            write(f"[last answer: {last.describe()}; {last.describe_prompt()}]")
            write(f"[session: {session.describe()}]")
            continue
        if command.startswith("/"):
            write(f"[unknown command {command.split()[0]}; /help lists the commands]")
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": query})
        if prompt_log is not None:
            prompt_log.add(messages)
        pressed.clear()
        text, last, interrupted = answer(redrafter, tokenizer, messages, max_tokens, out, cache, pressed, **generation)
        session.add(last)
        # What was shown is what the model said, so a stopped answer stays
        # in the conversation as it stands.
        messages.append({"role": "assistant", "content": text})
        if interrupted:
            write(dim(" [stopped]"))
        elif last.finish_reason == "length":
            write(dim(f" [stopped at --max-tokens {max_tokens}]"))
        else:
            write("")
