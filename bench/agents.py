"""The agents people run, unchanged, against `redrafter-mlx serve`: Claude
Code (`claude -p`) and Codex (`codex exec`), installed from the npm registry,
each asked one question in a throw-away git folder with a home of its own
(nothing of the user's settings is read or written). Prints each agent's exit
status, answer and time, and the server's access log; the lines that are
errors are counted apart from the documented refusal of a prompt over the
model's context.

    python3 bench/agents.py --model gemma --json bench/results/agents/gemma3-270m.json
    python3 bench/agents.py --json bench/results/agents/smollm2-8k.json    # the default model: its 8K context is too short

Needs node and npm, and the network to reach the npm registry once
(``--npm`` keeps the install). Server options after ``--`` go to `serve`
as they are, for example ``-- --max-output-tokens 256``.
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}
REFUSAL = "context_length_exceeded"  # the access log's note on the documented context refusal


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install(folder: Path, agents: list) -> dict:
    """npm-install the agents' packages (the newest) into ``folder``; their versions."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "npm",
            "install",
            "--prefix",
            str(folder),
            "--no-audit",
            "--no-fund",
            *[f"{PACKAGES[a]}@latest" for a in agents],
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    versions = {}
    for agent in agents:
        out = subprocess.run(
            [str(folder / "node_modules" / ".bin" / agent), "--version"], capture_output=True, text=True
        )
        versions[agent] = out.stdout.strip()
    return versions


def start_server(model, port: int, extra: list, log: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "redrafter_mlx.cli",
        "serve",
        "--port",
        str(port),
        *(["--model", model] if model else []),
        *extra,
    ]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"), env=dict(os.environ, PYTHONPATH=ROOT)
    )
    while "serving " not in log.read_text():
        if process.poll() is not None:
            sys.exit(f"the server did not start:\n{log.read_text()}")
        time.sleep(0.5)
    return process


def served_context(url: str):
    """The served model's context in tokens, from /v1/models (None: unknown)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as answer:
        return json.load(answer)["data"][0].get("context_length")


def run_agent(agent: str, bin_folder: Path, url: str, question: str, timeout: float) -> dict:
    """One agent, one question, in a new git folder with a home of its own,
    told the served model's context as a user would tell it (neither agent
    knows a local model's window, and each compacts by it)."""
    context = served_context(url)
    home = Path(tempfile.mkdtemp(prefix=f"{agent}-home-"))
    work = Path(tempfile.mkdtemp(prefix=f"{agent}-work-"))
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    env = dict(os.environ, HOME=str(home))
    if agent == "claude":
        env.update(ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="local")
        if context:
            env.update(CLAUDE_CODE_MAX_CONTEXT_TOKENS=str(context))
        command = [str(bin_folder / "claude"), "-p", question, "--model", "local"]
    else:
        codex_home = home / ".codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(  # the window is a top-level key, before the provider's table
            'model = "local"\nmodel_provider = "redrafter"\n'
            + (f"model_context_window = {context}\n" if context else "")
            + '\n[model_providers.redrafter]\nname = "redrafter-mlx"\n'
            f'base_url = "{url}/v1"\nwire_api = "responses"\n'
        )
        env.update(CODEX_HOME=str(codex_home))
        command = [str(bin_folder / "codex"), "exec", question]
    tic = time.time()
    try:
        done = subprocess.run(
            command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = None, e.stdout or "", e.stderr or ""
        out, err = (x.decode() if isinstance(x, bytes) else x for x in (out, err))
    return {
        "agent": agent,
        "exit_status": code,
        "seconds": round(time.time() - tic, 1),
        "stdout": out[-2000:],
        "stderr": err[-2000:],
    }


def log_lines(log: Path) -> list:
    """The access log's lines: (method and path, status, note)."""
    lines = []
    for line in log.read_text().splitlines():
        match = re.match(r'\S+ "(\S+ \S+)" (\d{3}) [\d.]+s(?: \((\S+)\))?$', line)
        if match:
            lines.append((match.group(1), int(match.group(2)), match.group(3)))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=None,
        help="for serve: a model path, or 'gemma' for Gemma 3 270M (default: the embedded SmolLM2)",
    )
    parser.add_argument("--agents", default="claude,codex")
    parser.add_argument("--question", default="What is the capital of France?")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds each agent may take")
    parser.add_argument("--npm", default=None, help="folder to install the agents into (default: a new one)")
    parser.add_argument("--json", default=None, help="write the results here")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    agents = args.agents.split(",")
    model = args.model
    if model == "gemma":
        sys.path.insert(0, ROOT)
        from redrafter_mlx.loading.gguf import gemma3_270m_path

        model = gemma3_270m_path()
    npm = Path(args.npm or tempfile.mkdtemp(prefix="agents-npm-"))
    versions = install(npm, agents)
    print("agents:", versions, flush=True)
    log = Path(tempfile.mkdtemp(prefix="agents-serve-")) / "serve.log"
    port = free_port()
    server = start_server(model, port, extra, log)
    try:
        results = [
            run_agent(agent, npm / "node_modules" / ".bin", f"http://127.0.0.1:{port}", args.question, args.timeout)
            for agent in agents
        ]
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
    lines = log_lines(log)
    errors = [line for line in lines if line[1] >= 400 and line[2] != REFUSAL]
    refusals = [line for line in lines if line[2] == REFUSAL]
    for r in results:
        answer = r["stdout"].strip().splitlines()[-3:] or r["stderr"].strip().splitlines()[-3:]
        print(
            f"{r['agent']} {versions[r['agent']]}: exit {r['exit_status']} after {r['seconds']} s; last lines:",
            *answer,
            sep="\n  ",
        )
    print(f"server: {len(lines)} requests, {len(refusals)} refused as over the context, {len(errors)} other errors")
    for line in lines:
        print("  ", *line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": " ".join(sys.argv),
                    "model": args.model or "SmolLM2-135M-Instruct",
                    "versions": versions,
                    "serve_options": extra,
                    "results": results,
                    "requests": lines,
                    "other_errors": len(errors),
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
