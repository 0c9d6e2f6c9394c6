"""An agent's session replayed against `redrafter-mlx serve` and
`mlx_lm.server` on the same weights: turns that resend the whole
conversation, growing by a tool result and a short user message each, as
agents send them. Per turn: the time to the first token, the decode speed
after it, and the time to prefill only that turn's new tokens on a cache of
nothing (what a turn costs when the rest comes from the prompt cache).

    python3 bench/agent_session.py --model gemma --turns 8 --json bench/results/serving/agent-session-gemma3-270m.json

The session is made here from this Python's own standard library, never an
agent's own text: instructions (the reference docstrings of some modules),
tool schemas (some library functions' signatures and summaries), and, per
turn, the assistant's call to read a file, its result (a piece of a module's
source) and a user message. Its first turn is about ``--first`` tokens and
each turn adds about ``--step`` more. The assistant's turns in the history
are the fixed calls, not the model's answers, so both servers get the same
requests; each answer is greedy, ``--max-tokens`` long.

redrafter-mlx gets each turn as the agent sends it (``/v1/messages``, the
Anthropic dialect, streamed); mlx_lm.server, which has no such route and
whose model here has no chat template, gets the same prompt text as
``/v1/completions`` (the text redrafter-mlx renders for that turn), so the
two prefill the same tokens. Turns alternate between the two servers, each
started afresh with its prompt cache on.
"""

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from server_throughput import OPENBLAS_PATHS, export, start, stop  # noqa: E402

REFERENCE = [
    "os",
    "shutil",
    "pathlib",
    "subprocess",
    "json",
    "re",
    "glob",
    "fnmatch",
    "tempfile",
    "textwrap",
    "difflib",
    "logging",
    "argparse",
    "collections",
    "itertools",
    "functools",
    "dataclasses",
    "typing",
    "string",
    "datetime",
]
FUNCTIONS = [
    "shutil.copy",
    "shutil.move",
    "shutil.rmtree",
    "os.listdir",
    "os.makedirs",
    "os.remove",
    "os.rename",
    "os.walk",
    "glob.glob",
    "fnmatch.fnmatch",
    "json.dumps",
    "json.loads",
    "textwrap.wrap",
    "difflib.unified_diff",
    "re.sub",
    "re.findall",
    "subprocess.run",
    "tempfile.mkdtemp",
    "shutil.which",
    "os.path.join",
    "os.path.exists",
    "os.getcwd",
]
SOURCES = [
    "argparse",
    "configparser",
    "tarfile",
    "zipfile",
    "logging",
    "inspect",
    "pydoc",
    "difflib",
    "smtplib",
    "mailbox",
]
ASKS = [
    "Read the next part.",
    "What does this part do?",
    "Go on.",
    "Note anything odd, then read on.",
    "Keep going.",
    "Summarize so far, then continue.",
    "Read more.",
    "Anything to fix here?",
    "Continue.",
    "One more part.",
]


def tool(path: str) -> dict:
    module, _, name = path.rpartition(".")
    function = getattr(__import__(module, fromlist=[name]), name)
    properties = {}
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        properties[parameter.name] = {"type": "string", "description": f"the {parameter.name.replace('_', ' ')}"}
    summary = (inspect.getdoc(function) or path).split("\n\n")[0]
    return {
        "name": path.replace(".", "_"),
        "description": summary,
        "input_schema": {"type": "object", "properties": properties},
    }


def session(tokenizer, first: int, step: int, turns: int) -> list:
    """The requests of a session (Anthropic Messages bodies), turn by turn."""
    tools = [tool(f) for f in FUNCTIONS] + [
        {
            "name": "read_file",
            "description": "Read part of a file.",
            "input_schema": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "part": {"type": "integer"}},
                "required": ["path"],
            },
        }
    ]
    system, reference = "You are a careful assistant who reads code and answers briefly.\n\n# Reference\n", []
    size = lambda text: len(tokenizer.encode(text))  # noqa: E731
    base = size(json.dumps(tools)) + size(system)
    for module in REFERENCE:  # each module's docstring, then its functions' first paragraphs
        if base + sum(map(size, reference)) > first - 400:
            break
        imported = __import__(module)
        functions = [
            f"{name}: {inspect.getdoc(f).split(chr(10) * 2)[0]}"
            for name, f in sorted(vars(imported).items())
            if inspect.isfunction(f) and not name.startswith("_") and inspect.getdoc(f)
        ]
        reference.append(f"## {module}\n{inspect.getdoc(imported) or ''}\n" + "\n".join(functions) + "\n")
    system += "\n".join(reference)
    source = "\n".join(Path(inspect.getsourcefile(__import__(m))).read_text() for m in SOURCES)
    lines, at = source.splitlines(), 0
    messages = [{"role": "user", "content": f"Read {SOURCES[0]}.py part by part and tell me what you find."}]
    bodies = []
    for turn in range(turns):
        bodies.append(
            {
                "model": "local",
                "max_tokens": 0,
                "temperature": 0,
                "system": system,
                "tools": tools,
                "messages": list(messages),
                "stream": True,
            }
        )
        piece = []
        while size("\n".join(piece)) < step - 60 and at < len(lines):
            piece += lines[at : at + 40]
            at += 40
        call = {
            "type": "tool_use",
            "id": f"toolu_{turn}",
            "name": "read_file",
            "input": {"path": "source.py", "part": turn},
        }
        messages += [
            {"role": "assistant", "content": [call]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": "\n".join(piece)},
                    {"type": "text", "text": ASKS[turn % len(ASKS)]},
                ],
            },
        ]
    return bodies


def ours(url: str, body: dict) -> dict:
    """One turn through /v1/messages, streamed: time to the first text, the
    text, and the tokens after the first over the time after it."""
    tic, first, text, usage = time.perf_counter(), None, "", {}
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=3600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"turn failed: {response.status_code} {response.read().decode()[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "content_block_delta":  # text, or a tool call's input
                first = first or time.perf_counter()
                text += event["delta"].get("text", event["delta"].get("partial_json", ""))
            elif event["type"] == "content_block_start" and event["content_block"]["type"] == "tool_use":
                first = first or time.perf_counter()
                text += f"<call {event['content_block']['name']}>"
            elif event["type"] == "error":
                raise RuntimeError(f"turn failed: {event['error']}")
            elif event["type"] == "message_delta":
                usage = event["usage"]
    end = time.perf_counter()
    first = first or end  # an empty answer
    return {
        "ttft": first - tic,
        "decode_tps": (usage["output_tokens"] - 1) / (end - first) if end > first else 0.0,
        "text": text,
        "seconds": end - tic,
        "tokens": usage["output_tokens"],
        "cached": usage.get("cache_read_input_tokens", 0),
    }


def theirs(url: str, prompt: str, max_tokens: int) -> dict:
    """One turn through mlx_lm.server's /v1/completions, streamed."""
    body = {
        "model": "default_model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tic, first, text, tokens = time.perf_counter(), None, "", 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                if choice.get("text"):
                    first = first or time.perf_counter()
                    text += choice["text"]
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {
        "ttft": first - tic,
        "decode_tps": (tokens - 1) / (end - first) if end > first else 0.0,
        "text": text,
        "seconds": end - tic,
        "tokens": tokens,
    }


def answer_of(raw: str, reader) -> str:
    """mlx_lm.server's raw text as ``ours`` reports redrafter-mlx's answer:
    text, and each tool call as its marker and arguments where the model
    wrote it, read by the same parser (a call cut at the length limit stays
    text)."""
    tools, out, text = reader(), "", raw
    while True:
        called = len(tools.calls)
        out += tools.add(text)
        text = ""
        for call in tools.calls[called:]:
            arguments = call["arguments"]
            out += f"<call {call['name']}>" + (
                arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            )
        if len(tools.calls) == called:
            return out + tools.finish()


def prefill_alone(url: str, text: str) -> float:
    """Seconds to the first token of a prompt of just ``text`` (nothing of it cached)."""
    tic = time.perf_counter()
    response = httpx.post(
        url + "/v1/completions", json={"prompt": text, "max_tokens": 1, "temperature": 0}, timeout=3600
    )
    response.raise_for_status()
    return time.perf_counter() - tic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma", help="a model path, or 'gemma' for Gemma 3 270M")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--first", type=int, default=12000, help="tokens of the first turn, about")
    parser.add_argument("--step", type=int, default=1600, help="tokens each turn adds, about")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--folder",
        default=os.path.join(tempfile.gettempdir(), "redrafter-bench-gemma"),
        help="where the float32 mlx-lm folder is saved",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    import redrafter_mlx  # noqa: F401
    from redrafter_mlx.loading.gguf import gemma3_270m_path
    from redrafter_mlx.loading.loader import load_base_model
    from redrafter_mlx.serving.anthropic_api import conversation, tool_list
    from redrafter_mlx.serving.chat_format import ChatRenderer
    from redrafter_mlx.serving.tools import ToolCallText

    model = gemma3_270m_path() if args.model == "gemma" else args.model
    _, tokenizer = load_base_model(model, "float32")
    renderer = ChatRenderer(tokenizer)
    reader = lambda: ToolCallText(renderer.tools, tool_list(bodies[0]["tools"])[0])  # noqa: E731
    bodies = [dict(b, max_tokens=args.max_tokens) for b in session(tokenizer, args.first, args.step, args.turns)]
    texts = [renderer.text(conversation(b), tool_list(b["tools"])[0]) for b in bodies]
    lengths = [len(renderer.encode(conversation(b), tool_list(b["tools"])[0])) for b in bodies]
    folder = export(model, Path(args.folder))
    blas = next((p for p in OPENBLAS_PATHS if os.path.exists(p)), None)
    env = dict(os.environ, PYTHONPATH=ROOT, **({"LD_PRELOAD": blas} if blas else {}))
    servers = {
        "redrafter": start([sys.executable, "-m", "redrafter_mlx.cli", "serve", "--model", model], env),
        "mlx_lm": start([sys.executable, "-m", "mlx_lm.server", "--model", folder], env),
    }
    rows = []
    try:
        for server in servers.values():  # warm-up, on a prompt the session does not start with
            httpx.post(
                server[1] + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}, timeout=600
            )
        for turn, (body, text) in enumerate(zip(bodies, texts)):
            first, second = ("redrafter", "mlx_lm") if turn % 2 == 0 else ("mlx_lm", "redrafter")
            row = {"turn": turn + 1, "prompt_tokens": lengths[turn]}
            for name in (first, second):
                url = servers[name][1]
                row[name] = ours(url, body) if name == "redrafter" else theirs(url, text, args.max_tokens)
            new = text[len(texts[turn - 1]) :] if turn else text
            row["new_tokens"] = lengths[turn] - (lengths[turn - 1] if turn else 0)
            row["prefill_new_alone"] = prefill_alone(servers["redrafter"][1], new) if turn else None
            row["same_text"] = row["redrafter"]["text"] == answer_of(row["mlx_lm"]["text"], reader)
            rows.append(row)
            r, m = row["redrafter"], row["mlx_lm"]
            alone = (
                f", new tokens alone {row['prefill_new_alone']:.1f} s ({r['ttft'] / row['prefill_new_alone']:.2f}x)"
                if turn
                else ""
            )
            print(
                f"turn {turn + 1}: {lengths[turn]} tokens ({row['new_tokens']} new): first token {r['ttft']:.1f} s against "
                f"{m['ttft']:.1f} s{alone}; decode {r['decode_tps']:.1f} against {m['decode_tps']:.1f} tokens/s; "
                f"{r['cached']} cached; same text {row['same_text']}",
                flush=True,
            )
    finally:
        stop(servers)
    total = {name: sum(r[name]["seconds"] for r in rows) for name in servers}
    later = [r["redrafter"]["ttft"] / r["prefill_new_alone"] for r in rows[1:]]
    print(
        f"session: {total['redrafter']:.1f} s against {total['mlx_lm']:.1f} s ({total['redrafter'] / total['mlx_lm']:.2f}x); "
        f"first tokens of turns 2-{len(rows)} over their new tokens alone: median {statistics.median(later):.2f}x, highest {max(later):.2f}x"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {"command": " ".join(sys.argv), "total_seconds": total, "ttft_over_new_alone": later, "turns": rows},
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
