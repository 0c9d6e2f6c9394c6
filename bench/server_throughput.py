"""Server throughput and latency with 1, 4 and 8 concurrent clients:
`redrafter-mlx serve` with its default settings (prompt cache and answer
store on, as a user runs it) against `mlx_lm.server` on the same weights
(the model saved once as a float32 mlx-lm folder; OpenBLAS preloaded for
both). Both servers run at once; each concurrency level is measured on one,
then the other, alternating which goes first.

    python3 bench/server_throughput.py --prompts data/prompts/heldout.jsonl --requests 12 --max-tokens 128 --repeats 2 \\
        --json bench/results/serving/server-throughput-vs-mlx-lm.json

Each level asks prompts of its own (the file's first --requests prompts for
one client, the next --requests for the next level, ...): the answer store
drafts from earlier answers, so a level that repeated another's prompts
would measure the store, not decoding. Greedy chat completions of
--max-tokens, each client taking the next prompt when its last one is
answered. Each repeat starts both servers afresh. Throughput is completion
tokens over the level's wall time; latency is each request's time to its
whole answer.
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
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from redrafter_mlx.blas import OPENBLAS_PATHS  # noqa: E402
from redrafter_mlx.serving.prompts import read_prompts  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export(model, folder: Path) -> str:
    """The model (None: the embedded one) as a float32 mlx-lm folder."""
    from mlx_lm.utils import save_config, save_model

    from redrafter_mlx.loading.loader import load_base_model

    if not (folder / "config.json").exists():
        weights, tokenizer = load_base_model(model, "float32")
        save_model(folder, weights)
        save_config({k: v for k, v in vars(weights.args).items() if not k.startswith("_")}, folder / "config.json")
        tokenizer._tokenizer.save_pretrained(folder)
    return str(folder)


def start(command: list, env: dict) -> tuple:
    port = free_port()
    process = subprocess.Popen(
        command + ["--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            sys.exit(f"{' '.join(command)} did not start")
        time.sleep(0.5)


def stop(servers: dict) -> None:
    for process, _ in servers.values():
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:  # mlx_lm.server may not stop on SIGINT while a request thread lingers
            process.kill()


def level(url: str, prompts: list, clients: int, max_tokens: int) -> dict:
    def one(prompt):
        tic = time.perf_counter()
        body = {
            "model": "default_model",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=3600).json()
        if "usage" not in response:
            sys.exit(f"{url} answered {json.dumps(response)[:500]}")
        return time.perf_counter() - tic, response

    tic = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - tic
    tokens = sum(r["usage"]["completion_tokens"] for _, r in results)
    steps = sum(r.get("redrafter", {}).get("steps", 0) for _, r in results)
    per_step = sum(r["redrafter"]["tokens_per_step"] * r["redrafter"]["steps"] for _, r in results if "redrafter" in r)
    return {
        "tokens_per_s": tokens / wall,
        "median_latency_s": statistics.median(t for t, _ in results),
        "completion_tokens": tokens,
        "tokens_per_step": per_step / steps if steps else None,
        "texts": [r["choices"][0]["message"]["content"] for _, r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument(
        "--repeats", type=int, default=2, help="times every level is measured, each time on servers started afresh"
    )
    parser.add_argument("--model", help="model to serve (default: the embedded one)")
    parser.add_argument(
        "--folder",
        default=os.path.join(tempfile.gettempdir(), "redrafter-bench-model"),
        help="where the float32 mlx-lm folder is saved",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    texts = [p if isinstance(p, str) else p[-1]["content"] for p in read_prompts(args.prompts)]
    if len(texts) < args.requests * len(levels):
        sys.exit(
            f"{args.prompts} holds {len(texts)} prompts; {len(levels)} levels of {args.requests} need {args.requests * len(levels)}"
        )
    own = {clients: texts[i * args.requests : (i + 1) * args.requests] for i, clients in enumerate(levels)}
    folder = export(args.model, Path(args.folder))
    blas = next((p for p in OPENBLAS_PATHS if os.path.exists(p)), None)
    env = dict(os.environ, PYTHONPATH=ROOT, **({"LD_PRELOAD": blas} if blas else {}))
    commands = {
        "redrafter": [sys.executable, "-m", "redrafter_mlx.cli", "serve", "--model", folder],
        "mlx_lm": [sys.executable, "-m", "mlx_lm.server", "--model", folder, "--max-tokens", str(args.max_tokens)],
    }
    runs = {clients: {name: [] for name in commands} for clients in levels}
    for repeat in range(args.repeats):
        servers = {name: start(command, env) for name, command in commands.items()}
        try:
            for name in servers:
                level(servers[name][1], ["Say hello.", "Name a colour."], 2, 8)  # warm-up, on prompts no level asks
            for i, clients in enumerate(levels):
                order = list(servers) if (i + repeat) % 2 == 0 else list(servers)[::-1]
                for name in order:
                    runs[clients][name].append(level(servers[name][1], own[clients], clients, args.max_tokens))
        finally:
            stop(servers)
    rows = []
    for clients in levels:
        row = {"clients": clients}
        for name, results in runs[clients].items():
            row[f"tokens_per_s_{name}"] = statistics.median(x["tokens_per_s"] for x in results)
            row[f"median_latency_s_{name}"] = statistics.median(x["median_latency_s"] for x in results)
        row["tokens_per_step_redrafter"] = statistics.median(x["tokens_per_step"] for x in runs[clients]["redrafter"])
        row["ratio"] = row["tokens_per_s_redrafter"] / row["tokens_per_s_mlx_lm"]
        row["ratio_runs"] = [
            a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[clients]["redrafter"], runs[clients]["mlx_lm"])
        ]
        row["same_text"] = all(
            a["texts"] == b["texts"] for a, b in zip(runs[clients]["redrafter"], runs[clients]["mlx_lm"])
        )
        rows.append(row)
        print(
            f"{clients} clients: redrafter-mlx {row['tokens_per_s_redrafter']:.1f} tokens/s (median latency {row['median_latency_s_redrafter']:.1f} s, "
            f"{row['tokens_per_step_redrafter']:.2f} tokens/step), mlx_lm.server {row['tokens_per_s_mlx_lm']:.1f} tokens/s "
            f"(median latency {row['median_latency_s_mlx_lm']:.1f} s): {row['ratio']:.2f}x (runs {', '.join(f'{r:.2f}' for r in row['ratio_runs'])}); "
            f"same text: {row['same_text']}",
            flush=True,
        )
    if args.json:
        summary = {
            "command": " ".join(sys.argv),
            "machine": f"{platform.machine()} {platform.system()}, float32 on the CPU unless Metal, OpenBLAS for both",
            "levels": rows,
        }
        with open(args.json, "w") as f:
            f.write(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
