"""Server throughput and latency with 1, 4 and 8 concurrent clients:
`redrafter-mlx serve` with its default drafting against the same server with
speculation off (`--drafter none --no-lookup --max-nodes 0`: plain decoding
through the same loop). Both servers run at once; each concurrency level is
measured on one, then the other, alternating which goes first.

    python3 bench/server_throughput.py --prompts data/prompts/dev.jsonl --requests 16 --max-tokens 128 --json bench/results/serving/server-throughput.json

Each level sends the same --requests prompts (the first of the file),
greedy chat completions of --max-tokens, each client taking the next
prompt when its last one is answered. Throughput is completion tokens over
the level's wall time; latency is each request's time to its whole answer.
"""

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from redrafter_mlx.prompts import read_prompts  # noqa: E402

SERVERS = {"redrafter": [], "plain": ["--drafter", "none", "--no-lookup", "--max-nodes", "0"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(extra: list, max_batch: int, model) -> tuple:
    port = free_port()
    command = [sys.executable, "-m", "redrafter_mlx.cli", "serve", "--port", str(port), "--max-batch", str(max_batch), "--prompt-cache-mb", "0", *extra]
    if model:
        command += ["--model", model]
    process = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            sys.exit(f"server {' '.join(extra)} did not start")
        time.sleep(0.5)


def level(url: str, prompts: list, clients: int, max_tokens: int) -> dict:
    def one(prompt):
        tic = time.perf_counter()
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=3600).json()
        return time.perf_counter() - tic, response

    tic = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - tic
    tokens = sum(r["usage"]["completion_tokens"] for _, r in results)
    steps = sum(r["redrafter"]["steps"] for _, r in results)
    return {
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "median_latency_s": statistics.median(t for t, _ in results),
        "tokens_per_step": sum(r["redrafter"]["tokens_per_step"] * r["redrafter"]["steps"] for _, r in results) / steps if steps else 0.0,
        "texts": [r["choices"][0]["message"]["content"] for _, r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--model")
    parser.add_argument("--json")
    args = parser.parse_args()
    prompts = read_prompts(args.prompts)[: args.requests]
    levels = [int(c) for c in args.clients.split(",")]
    servers = {name: start(extra, max(levels), args.model) for name, extra in SERVERS.items()}
    rows = []
    try:
        for i, clients in enumerate(levels):
            level(servers["plain"][1], prompts[:2], clients, 8)  # warm-up
            level(servers["redrafter"][1], prompts[:2], clients, 8)
            order = list(SERVERS) if i % 2 == 0 else list(SERVERS)[::-1]
            result = {name: level(servers[name][1], prompts, clients, args.max_tokens) for name in order}
            same = result["redrafter"].pop("texts") == result["plain"].pop("texts")
            row = {"clients": clients, **{f"{k}_{name}": v for name in SERVERS for k, v in result[name].items()}}
            row["speedup"] = row["tokens_per_s_redrafter"] / row["tokens_per_s_plain"]
            row["same_text"] = same
            rows.append(row)
            print(
                f"{clients} clients: ReDrafter {row['tokens_per_s_redrafter']:.1f} tokens/s (median latency {row['median_latency_s_redrafter']:.1f} s, "
                f"{row['tokens_per_step_redrafter']:.2f} tokens/step), plain {row['tokens_per_s_plain']:.1f} tokens/s "
                f"(median latency {row['median_latency_s_plain']:.1f} s): {row['speedup']:.2f}x; same text: {same}",
                flush=True,
            )
    finally:
        for process, _ in servers.values():
            process.send_signal(signal.SIGINT)
            process.wait(30)
    if args.json:
        summary = {"command": " ".join(sys.argv), "machine": f"{platform.machine()} {platform.system()}, float32 on the CPU unless Metal", "levels": rows}
        with open(args.json, "w") as f:
            f.write(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
