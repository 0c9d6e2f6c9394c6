"""A soak of `redrafter-mlx serve`: many mixed requests from a few clients
at once, with the server's resident memory sampled throughout.

    python3 bench/soak.py --requests 1000 --json bench/results/serving/soak-smollm2.json

The requests cycle through what clients send: chat completions (whole and
streamed), a tool round trip, completions, Anthropic messages, Responses
(with a developer message), long prompts (about a thousand tokens of a
standard-library module, each from another place in it, so the prompt cache
keeps taking new entries and must free old ones), and streams the client
drops after the first event. It reports failures (any answer that is not a
whole 200; a dropped stream is not one), the server's resident memory over
time (each sample with the prompt cache's bytes from /metrics), and how
much it moved over the second half of the run (over all of it, and over the
samples taken while the clients still sent, without the idle end where the
server gives memory back): a server whose memory is
bounded levels off, one that leaks keeps climbing. Start with 1,500
requests: the default prompt cache (1,024 MB) fills by about the 420th.

    python3 bench/soak.py --requests 1500 --json bench/results/serving/soak-smollm2-1500.json
"""

import argparse
import inspect
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from server_stress import metrics, resident_mb  # noqa: E402
from server_throughput import start  # noqa: E402

from redrafter_mlx.serving.prompts import read_prompts  # noqa: E402

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
KINDS = (
    "chat",
    "chat_stream",
    "tools",
    "completion",
    "anthropic",
    "anthropic_stream",
    "responses",
    "responses_stream",
    "long",
    "dropped",
)


def resident_bytes(pid: int) -> int:
    return int((resident_mb(pid) or 0) * 2**20)


def long_text(number: int, words: int) -> str:
    """About ``words`` words of a standard-library module, from a place that
    moves with ``number``."""
    source = inspect.getsource(__import__("typing")).split()
    start = (number * 997) % max(len(source) - words, 1)
    return " ".join(source[start : start + words])


def request(kind: str, prompt: str, number: int, max_tokens: int) -> tuple[str, dict, bool]:
    """(path, body, streamed) of one request of ``kind``."""
    user = {"role": "user", "content": prompt}
    if kind in ("chat", "chat_stream", "dropped"):
        return (
            "/v1/chat/completions",
            {"messages": [user], "max_tokens": max_tokens, "stream": kind != "chat"},
            kind != "chat",
        )
    if kind == "tools":
        call = {
            "id": f"call_{number}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
        }
        messages = [
            user,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"},
        ]
        return "/v1/chat/completions", {"messages": messages, "tools": [TOOL], "max_tokens": max_tokens}, False
    if kind == "completion":
        return "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens}, False
    if kind.startswith("anthropic"):
        body = {
            "model": "any",
            "system": "Answer briefly.",
            "messages": [user],
            "max_tokens": max_tokens,
            "stream": kind.endswith("stream"),
        }
        return "/v1/messages", body, body["stream"]
    if kind.startswith("responses"):
        body = {
            "model": "any",
            "input": [
                {"role": "developer", "content": [{"type": "input_text", "text": "Answer briefly."}]},
                {"role": "user", "content": [{"type": "input_text", "text": prompt}]},
            ],
            "max_output_tokens": max_tokens,
            "store": False,
            "stream": kind.endswith("stream"),
        }
        return "/v1/responses", body, body["stream"]
    if kind == "long":
        text = long_text(number, 500)
        return (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": text + "\n\nWhat does this code do?"}], "max_tokens": 16},
            False,
        )
    raise ValueError(kind)


def one(client: httpx.Client, url: str, kind: str, prompt: str, number: int, max_tokens: int) -> dict:
    path, body, streamed = request(kind, prompt, number, max_tokens)
    tic = time.perf_counter()
    try:
        if not streamed:
            response = client.post(url + path, json=body, timeout=600)
            ok = response.status_code == 200 and bool(response.json())
            status = response.status_code
        else:
            with client.stream("POST", url + path, json=body, timeout=600) as response:
                status, events = response.status_code, 0
                for line in response.iter_lines():
                    events += line.startswith("data:")
                    if kind == "dropped" and events:
                        break  # leaving the block closes the connection mid-answer
                ok = status == 200 and events > 0
    except httpx.HTTPError as e:
        return {
            "kind": kind,
            "ok": False,
            "status": None,
            "error": f"{type(e).__name__}: {e}",
            "seconds": time.perf_counter() - tic,
        }
    return {"kind": kind, "ok": ok, "status": status, "seconds": time.perf_counter() - tic}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prompts", default=os.path.join(ROOT, "data", "prompts", "heldout.jsonl"))
    parser.add_argument("--model", help="serve --model (default: the embedded model)")
    parser.add_argument("--serve-args", default="", help="more serve options, space-separated")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    prompts = [p for p in read_prompts(args.prompts) if isinstance(p, str)]
    cache = tempfile.mkdtemp(prefix="soak-")
    env = dict(os.environ, PYTHONPATH=ROOT, REDRAFTER_MLX_CACHE=cache)
    command = [sys.executable, "-m", "redrafter_mlx.cli", "serve", "--no-access-log"] + (
        ["--model", args.model] if args.model else []
    )
    command += args.serve_args.split()
    process, url = start(command, env)
    samples, done, loaded = [], threading.Event(), threading.Event()
    counter = itertools.count()
    completed = [0]

    def sample():
        tic = time.perf_counter()
        while not done.is_set():
            try:  # the prompt cache's bytes, which the memory bound allows for
                cache = metrics(url).get(("prompt_cache_bytes", ""))
            except httpx.HTTPError:
                cache = None
            samples.append(
                {
                    "seconds": round(time.perf_counter() - tic, 1),
                    "requests": completed[0],
                    "rss": resident_bytes(process.pid),
                    "prompt_cache_bytes": cache,
                    "loaded": loaded.is_set(),  # the clients still sending
                }
            )
            done.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    results = []
    try:
        with httpx.Client() as warm:  # the first request measures the cost curve: not part of the soak
            one(warm, url, "chat", prompts[0], 0, args.max_tokens)

        def client(_):
            with httpx.Client() as http:
                while (number := next(counter)) < args.requests:
                    kind = KINDS[number % len(KINDS)]
                    results.append(one(http, url, kind, prompts[number % len(prompts)], number, args.max_tokens))
                    completed[0] += 1
                    if completed[0] % 100 == 0:
                        print(
                            f"{completed[0]} requests, {resident_bytes(process.pid) / 2**20:.0f} MiB resident",
                            flush=True,
                        )

        tic = time.perf_counter()
        loaded.set()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(client, range(args.clients)))
        loaded.clear()
        seconds = time.perf_counter() - tic
        time.sleep(2.0)
        health = httpx.get(url + "/health").json()
    finally:
        done.set()
        sampler.join()
        process.terminate()
        process.wait(60)

    failures = [r for r in results if not r["ok"]]
    half = [s["rss"] for s in samples if s["requests"] >= args.requests // 2]
    busy = [s["rss"] for s in samples if s["requests"] >= args.requests // 2 and s.get("loaded")]
    middle, last = half[0], half[-1]
    summary = {
        "command": " ".join(["python3", "bench/soak.py"] + sys.argv[1:]),
        "requests": len(results),
        "failures": len(failures),
        "failed": failures[:20],
        "seconds": round(seconds, 1),
        "by_kind": {
            kind: {
                "count": sum(r["kind"] == kind for r in results),
                "failures": sum(r["kind"] == kind and not r["ok"] for r in results),
                "median_seconds": round(
                    statistics.median([r["seconds"] for r in results if r["kind"] == kind] or [0]), 3
                ),
            }
            for kind in KINDS
        },
        "rss_mib": {
            "start": round(samples[0]["rss"] / 2**20),
            "at_half": round(middle / 2**20),
            "end": round(last / 2**20),
            "second_half_max": round(max(half) / 2**20),
            "second_half_min": round(min(half) / 2**20),
        },
        "second_half_growth": round(last / middle - 1, 4),
        "second_half_spread": round(max(half) / min(half) - 1, 4),
        # The same, over the samples taken while the clients still sent (not
        # the idle end, where the server gives memory back).
        "second_half_spread_under_load": round(max(busy) / min(busy) - 1, 4) if busy else None,
        "second_half_under_load_mib": {
            "min": round(min(busy) / 2**20) if busy else None,
            "median": round(statistics.median(busy) / 2**20) if busy else None,
            "max": round(max(busy) / 2**20) if busy else None,
        },
        "health_at_end": health,
        "samples": samples,
    }
    print(json.dumps({k: v for k, v in summary.items() if k not in ("samples", "failed")}, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        samples = summary.pop("samples")  # a line each
        text = (
            json.dumps(summary, indent=1)[:-2]
            + ',\n "samples": [\n'
            + ",\n".join("  " + json.dumps(s) for s in samples)
            + "\n ]\n}\n"
        )
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
