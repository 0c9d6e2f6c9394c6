"""Whether clients that hold connections, send slowly or walk away can
starve the others: `redrafter-mlx serve` (its default settings, the
embedded model unless --model) answers 8 normal clients alone, then the
same questions again while these are all active at once:

- --idle keep-alive connections: each asks GET /health, then stays open
  and idle until the server closes it (30 s after the answer), and opens
  again;
- --slow clients sending a chat request's body a byte a second (each gets
  a 408 at the server's read timeout, 30 s, and starts over);
- --leavers clients sending a long prompt (--leaver-words random words,
  more than one prefill chunk) whole, not streamed, and closing the
  connection 0.5-2 s later, during its prefill or its wait for one, then
  starting over after a second.

    python3 bench/server_stress.py --json bench/results/serving/server-stress.json

(--idle 1000 --slow 50 --leavers 50 by default: about 5 minutes on a
2-core CPU, where the normal clients wait behind the leavers' prefill,
each request at most --timeout. A quick check: --idle 100 --slow 5
--leavers 5 --duration 15 --read-timeout 5 --timeout 30. --leavers 0
measures the connections alone.)

Reported: the normal clients' median latency under load over alone (goal
at most 1.2x), the 5xx answers any client saw and the server counted (goal
0), that every abandoned request was freed (/health back to nothing
running or waiting once the load stops, how long that took, and the
prompt cache's bytes from /metrics within its bound), the server's
resident memory (VmRSS) and open descriptors before, at their peak during
the load, and after. The load runs in a process of its own (asyncio), so
that the normal clients' timings are not its Python's. Both phases ask the
same questions, greedy, so that they do the same work (reported: whether
the answers were the same); the answer store is off, so that the second
phase cannot draft from the first one's answers.
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from redrafter_mlx.blas import OPENBLAS_PATHS  # noqa: E402
from redrafter_mlx.serving.process import allow_open_files  # noqa: E402

CLIENTS = 8
CHAT = "/v1/chat/completions"
THINGS = (
    "a river, a lighthouse, bread, a violin, the moon, a glacier, a library, coffee, a bicycle, a volcano, chess, a forest, "
    "the ocean, a clock, honey, a bridge, a desert, rain, a telescope, a garden, paper, a mountain, snow, a compass, tea, "
    "a castle, a harbor, thunder, a map, wool, a candle, a canyon, silk, an orchard, a train, salt, a piano, a cave, ice, "
    "a windmill, a meadow, a kite, copper, a lake, a drum, fog, a market, a feather, glass, a tunnel, a seed, a storm, "
    "an island, a lantern, marble, a valley, a bell, sand, a raft, a comet, a spider, clay, a fountain, a canal"
).split(", ")
WORDS = (
    "time year people way day man thing woman life child world school state family student group country problem hand "
    "part place case week company system program question work government number night point home water room mother area "
    "money story fact month lot right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change morning reason research girl "
    "guy moment air teacher force education"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list, env: dict, log) -> tuple:
    port = free_port()
    process = subprocess.Popen(
        command + ["--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url, port
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            sys.exit(f"{' '.join(command)} did not start (its log: {log.name})")
        time.sleep(0.5)


def resident_mb(pid: int):
    """The process's resident memory in MB (VmRSS; ps where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024
    except OSError:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
        return int(out) / 1024 if out else None


def open_fds(pid: int):
    """The process's open descriptors (None where there is no /proc)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def metrics(url: str) -> dict:
    """/metrics as {(name, labels text): value}."""
    rows = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        match = re.match(r"redrafter_(\w+)(\{[^}]*\})? (\S+)$", line)
        if match:
            rows[(match.group(1), match.group(2) or "")] = float(match.group(3))
    return rows


def server_5xx(rows: dict) -> int:
    return int(
        sum(
            v for (name, labels), v in rows.items() if name == "requests_total" and re.search(r'status="5\d\d"', labels)
        )
    )


def normal_clients(url: str, prompts: list, max_tokens: int, timeout: float = 600.0) -> dict:
    """8 clients, each asking its share of ``prompts`` one after another:
    every request's seconds and status (a request over ``timeout`` seconds
    counts as timed out, its seconds as ``timeout``)."""

    def client(share):
        seen = []
        with httpx.Client(timeout=timeout) as http:
            for prompt in share:
                body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
                tic = time.perf_counter()
                steps = {}
                try:
                    response = http.post(url + CHAT, json=body)
                    status = response.status_code
                    if status == 200:
                        answer = response.json()
                        steps = dict(answer.get("redrafter", {}), text=answer["choices"][0]["message"]["content"])
                except httpx.TimeoutException:
                    status = "timed out"
                except httpx.TransportError as e:
                    status = f"transport error: {type(e).__name__}"
                seen.append((time.perf_counter() - tic, status, steps))
        return seen

    shares = [prompts[i::CLIENTS] for i in range(CLIENTS)]
    order = [p for share in shares for p in share]
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = [r for share in pool.map(client, shares) for r in share]
    seconds = [s if status == 200 else timeout for s, status, _ in results if status in (200, "timed out")]
    per_step = [steps["tokens_per_step"] for _, _, steps in results if steps.get("steps")]
    return {
        "requests": len(results),
        "answered": sum(1 for _, s, _ in results if s == 200),
        "timed_out": sum(1 for _, s, _ in results if s == "timed out"),
        "median_latency_s": statistics.median(seconds) if seconds else None,
        "p90_latency_s": statistics.quantiles(seconds, n=10)[-1] if len(seconds) > 1 else None,
        "median_tokens_per_step": statistics.median(per_step) if per_step else None,
        "statuses": sorted({str(status) for _, status, _ in results}),
        "errors_5xx": sum(1 for _, s, _ in results if isinstance(s, int) and s >= 500),
        "answers": {prompt: steps.get("text") for prompt, (_, _, steps) in zip(order, results)},
    }


# The load, in a process of its own -----------------------------------------


async def read_answer(reader) -> int:
    """The status of the HTTP answer on ``reader``, its body read."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    if length:
        await reader.readexactly(int(length.group(1)))
    return status


async def load(port: int, idle: int, slow: int, leavers: int, leaver_words: int, stop, tally: dict) -> None:
    async def idle_connection(i):
        await asyncio.sleep(i * 0.002)  # opened over a couple of seconds, not in one burst
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /health HTTP/1.1\r\nHost: stress\r\n\r\n")
                tally["idle_statuses"].append(await read_answer(reader))
                tally["idle_open"] += 1
                while not stop.is_set():  # idle until the server closes it
                    try:
                        if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                            break
                    except asyncio.TimeoutError:
                        pass
                tally["idle_open"] -= 1
                writer.close()
            except (OSError, asyncio.IncompleteReadError) as e:
                tally["idle_errors"].append(type(e).__name__)
                await asyncio.sleep(0.5)

    async def slow_client(i):
        body = json.dumps(
            {"messages": [{"role": "user", "content": f"Say hello to client {i}, slowly."}], "max_tokens": 8}
        ).encode()
        await asyncio.sleep(i * 0.05)
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    f"POST {CHAT} HTTP/1.1\r\nHost: stress\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                )
                tic, sent, status = time.monotonic(), 0, None
                while status is None and not stop.is_set():
                    try:
                        status = await asyncio.wait_for(read_answer(reader), 1.0)  # a byte a second until answered
                    except asyncio.TimeoutError:
                        if sent < len(body) - 1:
                            writer.write(body[sent : sent + 1])
                            sent += 1
                if status is not None:
                    tally["slow_statuses"].append(status)
                    tally["slow_seconds"].append(time.monotonic() - tic)
                writer.close()
            except (OSError, asyncio.IncompleteReadError) as e:
                tally["slow_errors"].append(type(e).__name__)
                await asyncio.sleep(0.5)

    async def leaver(i):
        rng = random.Random(i)
        await asyncio.sleep(i * 0.1)
        while not stop.is_set():
            prompt = " ".join(rng.choice(WORDS) for _ in range(leaver_words))
            body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 16}).encode()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    f"POST {CHAT} HTTP/1.1\r\nHost: stress\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                try:
                    status = await asyncio.wait_for(read_answer(reader), rng.uniform(0.5, 2.0))
                    tally["leaver_answered"].append(status)  # answered before it could leave
                except asyncio.TimeoutError:
                    tally["leaver_left"] += 1
                writer.close()
            except (OSError, asyncio.IncompleteReadError) as e:
                tally["leaver_errors"].append(type(e).__name__)
            await asyncio.sleep(1.0)

    tasks = (
        [idle_connection(i) for i in range(idle)]
        + [slow_client(i) for i in range(slow)]
        + [leaver(i) for i in range(leavers)]
    )
    await asyncio.gather(*tasks)


def run_load(port, idle, slow, leavers, leaver_words, stop, results) -> None:
    allow_open_files(idle + slow + leavers + 256)
    tally = {
        "idle_statuses": [],
        "idle_errors": [],
        "idle_open": 0,
        "slow_statuses": [],
        "slow_seconds": [],
        "slow_errors": [],
        "leaver_answered": [],
        "leaver_left": 0,
        "leaver_errors": [],
    }
    stopping = threading.Event()

    def watch():  # a multiprocessing Event cannot be awaited: mirrored into the loop's thread-safe view
        stop.wait()
        stopping.set()

    threading.Thread(target=watch, daemon=True).start()
    asyncio.run(load(port, idle, slow, leavers, leaver_words, stopping, tally))
    # Not gone before the stop is set (with no load, the tasks end at once):
    # a process that exits while its thread waits on the Event leaves the
    # Event's set() waiting for that thread.
    stopping.wait()
    results.put(
        {
            "idle_requests": len(tally["idle_statuses"]),
            "idle_statuses": sorted(set(tally["idle_statuses"])),
            "idle_5xx": sum(1 for s in tally["idle_statuses"] if s >= 500),
            "idle_errors": sorted(set(tally["idle_errors"])),
            "slow_answers": len(tally["slow_statuses"]),
            "slow_statuses": sorted(set(tally["slow_statuses"])),
            "slow_5xx": sum(1 for s in tally["slow_statuses"] if s >= 500),
            "slow_median_seconds_to_answer": statistics.median(tally["slow_seconds"])
            if tally["slow_seconds"]
            else None,
            "slow_errors": sorted(set(tally["slow_errors"])),
            "leavers_left": tally["leaver_left"],
            "leavers_answered_first": len(tally["leaver_answered"]),
            "leaver_5xx": sum(1 for s in tally["leaver_answered"] if s >= 500),
            "leaver_errors": sorted(set(tally["leaver_errors"])),
        }
    )


# ---------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model to serve (default: the embedded one)")
    parser.add_argument("--idle", type=int, default=1000, help="idle keep-alive connections held")
    parser.add_argument("--slow", type=int, default=50, help="clients sending their body a byte a second")
    parser.add_argument(
        "--leavers", type=int, default=50, help="clients sending a long prompt and leaving during its prefill"
    )
    parser.add_argument(
        "--leaver-words",
        type=int,
        default=2500,
        help="words of a leaver's prompt (more than a prefill chunk's 2,048 tokens)",
    )
    parser.add_argument("--requests", type=int, default=2, help="requests per normal client in each phase")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds a normal request may take before it counts as timed out"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens of a normal request")
    parser.add_argument(
        "--duration",
        type=float,
        default=40.0,
        help="seconds the load runs at least (the slow clients' 408s come at 30 s)",
    )
    parser.add_argument(
        "--ramp", type=float, default=5.0, help="seconds between starting the load and the normal clients"
    )
    parser.add_argument(
        "--prompt-cache-mb",
        type=float,
        default=1024,
        help="the server's --prompt-cache-mb (its bound, checked at the end)",
    )
    parser.add_argument("--read-timeout", type=float, help="the server's --read-timeout (default: its own, 30 s)")
    parser.add_argument("--prefill-share", type=float, help="the server's --prefill-share (default: its own, 0.2)")
    parser.add_argument("--json")
    args = parser.parse_args()
    allow_open_files(args.idle + args.slow + args.leavers + 256)
    blas = next((p for p in OPENBLAS_PATHS if os.path.exists(p)), None)
    env = dict(os.environ, PYTHONPATH=ROOT, **({"LD_PRELOAD": blas} if blas else {}))
    command = [
        sys.executable,
        "-m",
        "redrafter_mlx.cli",
        "serve",
        "--no-access-log",
        "--prompt-cache-mb",
        str(args.prompt_cache_mb),
        "--answer-store-mb",  # off, so that the loaded phase cannot draft from the answers of the phase alone
        "0",
    ]
    command += ["--model", args.model] if args.model else []
    command += ["--read-timeout", str(args.read_timeout)] if args.read_timeout else []
    command += ["--prefill-share", str(args.prefill_share)] if args.prefill_share else []
    needed = CLIENTS * args.requests
    if needed > len(THINGS):
        sys.exit(f"--requests {args.requests}: {CLIENTS} clients need {needed} prompts; {len(THINGS)} are written here")
    prompts = [f"In one sentence, what is {thing}?" for thing in THINGS][:needed]

    log = tempfile.NamedTemporaryFile("w", prefix="server-stress-", suffix=".log", delete=False)
    process, url, port = start(command, env, log)
    pid = process.pid
    try:
        normal_clients(url, ["Say hello.", "Name a colour."], args.max_tokens)  # warm-up, on prompts no phase asks
        before = {"rss_mb": resident_mb(pid), "fds": open_fds(pid)}
        alone = normal_clients(url, prompts, args.max_tokens)
        print(
            f"alone: median latency {alone['median_latency_s']:.2f} s (90th percentile {alone['p90_latency_s']:.2f} s) "
            f"over {alone['answered']} requests, "
            f"{alone['median_tokens_per_step']} tokens a step",
            flush=True,
        )

        stop, results = multiprocessing.Event(), multiprocessing.Queue()
        attack = multiprocessing.Process(
            target=run_load, args=(port, args.idle, args.slow, args.leavers, args.leaver_words, stop, results)
        )
        peak = {"rss_mb": before["rss_mb"], "fds": before["fds"], "connections_open": 0}
        sampling = threading.Event()

        def sample():
            while not sampling.is_set():
                peak["rss_mb"] = max(peak["rss_mb"] or 0, resident_mb(pid) or 0)
                peak["fds"] = max(peak["fds"] or 0, open_fds(pid) or 0)
                try:
                    peak["connections_open"] = max(
                        peak["connections_open"], metrics(url).get(("connections_open", ""), 0)
                    )
                except httpx.HTTPError:
                    pass
                sampling.wait(1.0)

        tic = time.monotonic()
        attack.start()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        time.sleep(args.ramp)
        loaded = normal_clients(url, prompts, args.max_tokens, args.timeout)
        print(
            f"under load: median latency {loaded['median_latency_s']:.2f} s (90th percentile {loaded['p90_latency_s']:.2f} s) "
            f"over {loaded['answered']} requests "
            f"({loaded['timed_out']} timed out at {args.timeout:g} s), {loaded['median_tokens_per_step']} tokens a step",
            flush=True,
        )
        time.sleep(max(0.0, args.duration - (time.monotonic() - tic)))
        stop.set()
        load_results = results.get(timeout=120)
        attack.join(30)
        sampling.set()
        sampler.join()

        settle = time.monotonic()
        health = httpx.get(url + "/health").json()
        while (health["running"] or health["waiting"]) and time.monotonic() - settle < 120:
            time.sleep(0.2)
            health = httpx.get(url + "/health").json()
        idle_after_s = time.monotonic() - settle
        time.sleep(2.0)  # the load's connections closed
        rows = metrics(url)
        after = {
            "rss_mb": resident_mb(pid),
            "fds": open_fds(pid),
            "connections_open": rows.get(("connections_open", ""), None),
        }
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()

    ratio = (
        loaded["median_latency_s"] / alone["median_latency_s"]
        if alone["median_latency_s"] and loaded["median_latency_s"]
        else None
    )
    cache_bytes = rows.get(("prompt_cache_bytes", ""), 0)
    errors_seen = (
        alone["errors_5xx"]
        + loaded["errors_5xx"]
        + load_results["idle_5xx"]
        + load_results["slow_5xx"]
        + load_results["leaver_5xx"]
    )
    summary = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs",
        "load": {
            "idle": args.idle,
            "slow": args.slow,
            "leavers": args.leavers,
            "leaver_words": args.leaver_words,
            "duration_s": args.duration,
            "read_timeout_s": args.read_timeout or 30.0,
            "prefill_share": args.prefill_share or 0.2,
        },
        "alone": alone,
        "under_load": loaded,
        "latency_ratio": ratio,
        "same_answers": alone["answers"] == loaded["answers"],
        "errors_5xx_seen": errors_seen,
        "errors_5xx_server": server_5xx(rows),
        "load_results": load_results,
        "idle_after_s": idle_after_s,
        "health_after": health,
        "prefill_share_after": rows.get(("prefill_share", "")),
        "prompt_cache_bytes": cache_bytes,
        "prompt_cache_bound_bytes": args.prompt_cache_mb * 2**20,
        "memory_and_fds": {"before": before, "peak": peak, "after": after},
        "server_log": log.name,
    }
    freed = health["running"] == 0 and health["waiting"] == 0
    print(
        f"median latency under load / alone: {ratio:.2f}x (goal <= 1.2x); 5xx seen {errors_seen}, counted by the server "
        f"{summary['errors_5xx_server']} (goal 0); the same answers alone and under load: {summary['same_answers']}"
    )
    print(
        f"every abandoned request freed: {freed} ({idle_after_s:.1f} s after the load stopped); prompt cache {cache_bytes / 2**20:.1f} MB "
        f"of {args.prompt_cache_mb:g} MB"
    )
    print(
        f"server memory {before['rss_mb']:.0f} MB before, {peak['rss_mb']:.0f} MB at peak, {after['rss_mb']:.0f} MB after; "
        f"open descriptors {before['fds']}, {peak['fds']}, {after['fds']}; connections open at peak {peak['connections_open']:.0f}"
    )
    print(f"load: {json.dumps(load_results)}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
