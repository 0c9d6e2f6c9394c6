"""The ``redrafter-mlx`` command line (installed as ``redrafter_mlx.cli``).

Option groups shared by several commands (the model, drafting, sampling)
are declared once, as argparse parent parsers, with destinations named like
the fields of the settings they fill (``DraftSettings``,
``SamplingSettings``, ``TrainConfig``), which check their own values. Each
command is a function of the parsed arguments that calls the library.
"""

import argparse
import dataclasses
import json
import os
import sys
import tempfile

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)
from redrafter_mlx.errors import UserError

API_KEY_ENV = "REDRAFTER_MLX_API_KEY"

# Options taken out because they measured no gain (bench/research/README.md);
# given, they get one error line.
REMOVED = {
    "--lookup-beams": "one context-lookup continuation per step is kept",
    "--soft-targets": "training on the base model's distribution measured no gain",
    "--hidden-dropout": "dropout on the hidden state measured no gain",
    "--lookup-weight": "weighing lookup's targets measured no gain",
}
REMOVED_FROM_TRAIN = {"--no-rnn": "the drafter trains with its RNN", "--rnn": "the drafter trains with its RNN"}


class Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported as one ``error:`` line."""

    def error(self, message):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def auto_int(text: str):
    """A whole number, or ``auto`` (None: the library chooses)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number or 'auto', got {text!r}") from None


def at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = f"whole number >= {low}"
    return parse


def settings(kind, args: argparse.Namespace, **extra):
    """A settings dataclass from the parsed options named like its fields;
    options left unset (None) keep the dataclass's defaults."""
    names = {f.name for f in dataclasses.fields(kind)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    return kind(**dict(given, **extra))


def option_group(title: str, options: list) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group(title)
    for flags, kwargs in options:
        group.add_argument(*flags, **kwargs)
    return parent


MODEL = option_group("model", [
    (["--model", "-m"], dict(help="mlx-lm / Hugging Face folder, Hub id, or .gguf file (default: the embedded SmolLM2-135M-Instruct)")),
    (["--dtype"], dict(choices=["float32", "float16", "bfloat16", "native"], help="compute dtype of the base model; native keeps the file's (default: float32 on the CPU, native on Metal)")),
])
DRAFTER = option_group("drafter", [
    (["--drafter", "-d"], dict(help="drafter folder, or 'none' for context lookup only (default: the drafter shipped for this model, else lookup only)")),
])
DRAFTING = option_group("drafting", [
    (["--beam-width"], dict(type=auto_int, metavar="N|auto", help="beams the RNN drafts per step (auto: 4)")),
    (["--beam-length"], dict(type=auto_int, metavar="N|auto", help="tokens per beam counting the last verified one, so N - 1 drafted (auto: 5)")),
    (["--max-nodes"], dict(type=auto_int, metavar="N|auto", help="drafted nodes verified per step; auto sizes each step's tree by this machine's measured cost; 0 is plain decoding (auto)")),
    (["--no-lookup"], dict(dest="lookup", action="store_false", default=None, help="do not draft by context lookup")),
    (["--lookup-length"], dict(type=int, metavar="N", help="tokens a context-lookup continuation drafts (16)")),
    (["--lookup-max-ngram"], dict(type=int, metavar="N", help="longest context suffix context lookup matches (3)")),
    (["--datastore-beams"], dict(type=int, metavar="N", help="continuations per step from the drafter's datastore, when it has one; 0 turns it off (2)")),
])
SAMPLING = option_group("sampling", [
    (["--temp"], dict(type=float, help="temperature; 0 is greedy (0; chat: the model's recommendation, else 0.7)")),
    (["--top-p"], dict(type=float, help="keep the most likely tokens up to this probability mass (1: all; chat: 0.9)")),
    (["--top-k"], dict(type=int, help="keep the k most likely tokens (0: all)")),
    (["--min-p"], dict(type=float, help="drop tokens less likely than this times the most likely one (0: none)")),
    (["--repetition-penalty"], dict(type=float, help="penalty above 1 for tokens among the last 20 (off)")),
    (["--seed"], dict(type=int, help="random seed; prompt i of a list samples with its own seed derived from (seed, i) (0)")),
])
PROMPT_LOG = option_group("prompt log", [
    (["--log-prompts"], dict(metavar="FILE", help="append each prompt answered to this JSONL file, which `distill --prompts` reads")),
])
SPLIT = option_group("several machines (started by mlx.launch)", [
    (["--split"], dict(choices=["pipeline", "tensor"], default="pipeline", help="how the model is split over the launched ranks: pipeline stages of layers, or tensor parallel where the heads divide (pipeline)")),
])
ANSWERS = option_group("earlier answers", [
    (["--answer-store-mb"], dict(type=float, default=64, metavar="MB", help="memory for the answers produced so far, which later steps also draft from; 0 turns it off (64)")),
])


def fail(message: str) -> None:
    raise UserError(message)


def answer_store(megabytes: float):
    from redrafter_mlx.drafting.answers import answer_store as make

    if megabytes < 0:
        fail(f"--answer-store-mb takes a size of 0 or more, got {megabytes}")
    return make(megabytes)


def load_pair(args, ranks=None):
    from redrafter_mlx.loading.loader import load

    drafter = getattr(args, "drafter", None)
    if drafter == "none" and getattr(args, "beam_width", None) is not None:
        fail("--beam-width sets the RNN drafter's search; it does not go with --drafter none")
    return load(args.model, drafter, dtype=dtype_of(args), ranks=ranks)


def join_ranks(args):
    """The ranks this process was launched with by mlx.launch (None when it
    runs alone). Only rank 0 writes to standard output."""
    from redrafter_mlx.engine import distributed

    if not distributed.launched():
        return None
    ranks = distributed.join(args.split)
    if ranks.rank > 0:
        sys.stdout = open(os.devnull, "w")
    return ranks


def dtype_of(args) -> str:
    return "auto" if args.dtype is None else (None if args.dtype == "native" else args.dtype)


def draft_settings(args):
    from redrafter_mlx.drafting.settings import DraftSettings

    return settings(DraftSettings, args)


def sampling_settings(args, **defaults):
    from redrafter_mlx.engine.sampling import SamplingSettings

    given = {k: v for k, v in vars(args).items() if v is not None}
    return settings(SamplingSettings, argparse.Namespace(**dict(defaults, **given)))


def prompt_log(args):
    from redrafter_mlx.serving.prompts import PromptLog

    return PromptLog(args.log_prompts, warn=lambda line: print(line, file=sys.stderr)) if args.log_prompts else None


# -- commands -----------------------------------------------------------------


def generate(args):
    """Generate text from a prompt, or from each prompt of a file (batched)."""
    from redrafter_mlx.engine.sampling import make_chooser
    from redrafter_mlx.serving.prompts import read_prompts

    draft, choose = draft_settings(args), make_chooser(sampling_settings(args))
    texts = read_prompts(args.prompts) if args.prompts else None
    prompt = args.prompt
    if prompt == "-" and texts is None:
        try:
            prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as e:
            fail(f"the prompt on standard input is not UTF-8 text ({e})")
    ranks = join_ranks(args)
    redrafter, tokenizer = load_pair(args, ranks)
    _generate(args, redrafter, tokenizer, draft, choose, texts, prompt, ranks.size if ranks else 1)
    if ranks is not None:  # only a normal end: a rank that fails leaves without a word, which ends the others
        ranks.end()


def _generate(args, redrafter, tokenizer, draft, choose, texts, prompt, num_ranks):
    from redrafter_mlx.serving.api import batch_generate, encode_prompt, stream_generate

    options = dict(vars(draft), choose=choose, chat_template=not args.ignore_chat_template)
    if texts is not None:
        for result in batch_generate(redrafter, tokenizer, texts, args.max_tokens, batch_size=args.batch_size, **options):
            tps = len(result.tokens) / result.seconds if result.seconds else 0.0
            print(json.dumps(summary(result.text, result.tokens, result.prompt_tokens, result.steps, result.step_tokens, result.step_nodes, tps, result.finish_reason)), flush=True)
        return
    prompt_ids = encode_prompt(tokenizer, prompt, chat_template=not args.ignore_chat_template)
    text, tokens, last = "", [], None
    for last in stream_generate(redrafter, tokenizer, prompt_ids, args.max_tokens, **options):
        text += last.text
        tokens += last.tokens
        if not args.json:
            print(last.text, end="", flush=True)
    steps, step_tokens, step_nodes, tps = (last.steps, last.step_tokens, last.step_nodes, last.generation_tps) if last else (0, 0, 0, 0.0)
    if args.json:
        out = summary(text, tokens, len(prompt_ids), steps, step_tokens, step_nodes, tps, last.finish_reason if last else "length")
        out.update(prompt_tps=last.prompt_tps if last else 0.0, peak_memory_gb=last.peak_memory if last else 0.0, ranks=num_ranks)
        print(json.dumps(out))
        return
    print()
    if steps:
        print(f"[{len(tokens)} tokens, {tps:.1f} tokens/s, {step_tokens / steps:.2f} tokens/step, prompt {len(prompt_ids)} tokens]", file=sys.stderr)


def summary(text, tokens, prompt_tokens, steps, step_tokens, step_nodes, generation_tps, finish_reason) -> dict:
    return {
        "text": text,
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "generation_tokens": len(tokens),
        "steps": steps,
        "tokens_per_step": step_tokens / steps if steps else 0.0,
        "nodes_per_step": step_nodes / steps if steps else 0.0,
        "generation_tps": generation_tps,
        "finish_reason": finish_reason,
    }


def chat(args):
    """Chat with the model; answers stream as they are accepted."""
    from redrafter_mlx.engine.sampling import make_chooser
    from redrafter_mlx.serving.chat import chat_loop, chat_sampling

    draft, log = draft_settings(args), prompt_log(args)
    redrafter, tokenizer = load_pair(args)
    redrafter.answers = answer_store(args.answer_store_mb)
    if not tokenizer.has_chat_template:
        fail("this model's tokenizer has no chat template; use `redrafter-mlx generate`")
    sampling = chat_sampling(redrafter.generation_config, temp=args.temp, top_p=args.top_p, top_k=args.top_k,
                             min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    chat_loop(redrafter, tokenizer, args.max_tokens, args.system_prompt, prompt_log=log, choose=make_chooser(sampling), **vars(draft))


def serve(args):
    """Serve the model over the OpenAI and Anthropic HTTP APIs, batching concurrent requests."""
    from redrafter_mlx.serving.server import run_server

    draft, log = draft_settings(args), prompt_log(args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.prompt_cache_mb < 0 or args.shutdown_timeout < 0 or args.keep_alive <= 0:
        fail("--prompt-cache-mb and --shutdown-timeout take 0 or more, --keep-alive more than 0")
    ranks = join_ranks(args)
    if ranks is not None and ranks.rank > 0:  # the HTTP server is rank 0's; this rank follows its steps
        from redrafter_mlx.serving.scheduler import follow

        redrafter, tokenizer = load_pair(args, ranks)
        redrafter.answers = answer_store(args.answer_store_mb)
        follow(redrafter, tokenizer.eos_token_ids, draft, args.max_batch)
        ranks.end()
        return
    sock = listen(args.host, args.port)
    if api_key is None and not is_loopback(args.host):
        print(f"warning: serving beyond this machine ({args.host}) with no API key: anyone who can reach it may use it (--api-key)", file=sys.stderr)
    redrafter, tokenizer = load_pair(args, ranks)
    redrafter.answers = answer_store(args.answer_store_mb)
    name = os.path.basename(args.model.rstrip("/")) if args.model else "SmolLM2-135M-Instruct"
    print("measuring this machine's verification cost (cached after the first time)...", file=sys.stderr)
    run_server(redrafter, tokenizer, draft, sock, name, max_batch=args.max_batch, max_tokens=args.max_tokens,
               cache_bytes=int(args.prompt_cache_mb * 2**20), max_body_bytes=args.max_body_bytes, prompt_log=log,
               api_key=api_key, max_queue=args.max_queue, shutdown_timeout=args.shutdown_timeout, keep_alive=args.keep_alive,
               announce=lambda line: print(line, file=sys.stderr))
    if ranks is not None:
        ranks.end()


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def listen(host: str, port: int):
    """A socket bound to host:port, or one clear error (a port in use)."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        fail(f"cannot listen on {host}:{port} ({e.strerror or e})")
    return sock


def bench(args):
    """Measure plain decoding against ReDrafter on the same prompts."""
    from tqdm import tqdm

    from redrafter_mlx.engine.sampling import make_chooser
    from redrafter_mlx.serving import bench as benchmark
    from redrafter_mlx.serving.api import encode_prompt
    from redrafter_mlx.serving.prompts import read_prompts

    configs = benchmark.parse_configs(args.configs)
    if args.repetition_penalty is not None:
        fail("bench compares against mlx-lm's own loop, which cannot apply --repetition-penalty here")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("--plot needs matplotlib: pip install matplotlib")
    choose = make_chooser(sampling_settings(args))
    texts = (read_prompts(args.prompts) if args.prompts else benchmark.DEFAULT_PROMPTS)[:: args.every][: args.num_prompts]
    ranks = join_ranks(args)
    redrafter, tokenizer = load_pair(args, ranks)
    if redrafter.drafter is None and any(c.name.startswith(("rnn", "both")) for c in configs):
        fail("the rnn and both configurations need a drafter")
    env = dict(benchmark.environment(redrafter), ranks=ranks.size if ranks else 1, split=ranks.split if ranks else None)
    print(f"device {env['device']}, BLAS {env['blas']}, dtype {env['dtype']}, mlx {env['mlx']}, mlx-lm {env['mlx_lm']}"
          + (f", {ranks.size} ranks ({ranks.split})" if ranks else ""))
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    curve = benchmark.calibration(redrafter, min(args.batch_size, len(prompts)), refresh=args.calibrate)
    print(benchmark.format_curve(curve))
    runs = args.repeats * -(-len(prompts) // args.batch_size) * len(configs)
    with tqdm(total=runs, unit="run", desc="bench", file=sys.stderr, disable=bool(ranks and ranks.rank > 0)) as bar:
        results = benchmark.run_benchmark(
            redrafter, prompts, configs, max_tokens=args.max_tokens, batch_size=args.batch_size, repeats=args.repeats,
            choose=choose, eos=list(tokenizer.eos_token_ids), progress=bar.update, curve=curve,
        )
    print(benchmark.format_table(results))
    mismatched = [r.name for r in results if r.mismatches]
    if mismatched:
        print(f"WARNING: ReDrafter output differs from plain decoding for {', '.join(mismatched)}", file=sys.stderr)
    if args.json and not (ranks and ranks.rank > 0):
        used = dict(model=args.model or "default", drafter=args.drafter or "default", drafter_sha256=redrafter.drafter_identity or None,
                    model_identity=redrafter.identity, prompts=args.prompts or "built-in", every=args.every, num_prompts=len(prompts),
                    max_tokens=args.max_tokens, temp=args.temp or 0.0, top_p=args.top_p or 1.0, seed=args.seed or 0,
                    batch_size=args.batch_size, repeats=args.repeats)
        with open(args.json, "w") as f:
            json.dump(benchmark.report(results, used, env, curve), f, indent=2)
    if args.plot and not (ranks and ranks.rank > 0):
        benchmark.plot_speedups(results, args.plot, f"speed-up, {env['device']} {env['dtype']}, batch {args.batch_size}")
    if ranks is not None:
        ranks.end()


def distill(args):
    """Generate distillation data: the base model's own answers to prompts."""
    from redrafter_mlx.training.distill import distill_command

    if (args.prompts is None) == (args.self_prompts is None):
        fail("give either --prompts FILE or --self-prompts N")
    totals = distill_command(args.output, args.model, dtype_of(args), sampling_settings(args), prompts=args.prompts,
                             self_prompts=args.self_prompts, limit=args.limit, max_tokens=args.max_tokens,
                             batch_size=args.batch_size, samples=args.samples, workers=args.workers)
    print(f"{totals['new_responses']} responses, {totals['new_tokens']} new tokens in {totals['seconds']:.0f} s; "
          f"{args.output} holds {totals['responses']} responses to {totals['prompts']} prompts")


def train(args):
    """Train a drafter on distilled data (resumes from its checkpoint)."""
    from redrafter_mlx.training.train import TrainConfig, train_drafter

    result = train_drafter(args.data, args.output, settings(TrainConfig, args, dtype=args.drafter_dtype), args.model, dtype_of(args),
                           resumed=lambda step: print(f"resuming from step {step}"))
    print(f"drafter written to {args.output}: {json.dumps(result)}")


def datastore(args):
    """Add a datastore to a drafter (its base model's distilled answers).

    Each step then also drafts what the model most often wrote after the
    context's last tokens. Answers to the prompts training holds out are
    left out."""
    from redrafter_mlx.training.datastore import add_datastore

    path, tokens, answers = add_datastore(args.drafter, args.data)
    print(f"datastore written to {path}: {tokens:,} tokens of {answers:,} answers, {path.stat().st_size / 1e6:.1f} MB")


def convert(args):
    """Convert a drafter trained with PyTorch into the MLX drafter format."""
    from redrafter_mlx.convert import convert_checkpoint

    config = {}
    if args.config:
        try:
            with open(args.config) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            fail(f"cannot read --config {args.config}: {e}")
    fields = dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size, exit_dim=args.exit_dim, num_draft_layers=args.num_draft_layers, rnn=args.rnn)
    config.update({k: v for k, v in fields.items() if v is not None})
    done = convert_checkpoint(args.torch_path, args.mlx_path, dtype=args.dtype, quantize_bits=args.q_bits if args.quantize else None,
                              base_model=args.base_model, config=config or None)
    for note in done["notes"]:
        print(note)
    print(f"wrote {done['tensors']} tensors ({done['bytes'] / 1e6:.1f} MB) to {done['path']}")


# -- the parser ---------------------------------------------------------------


def build_parser() -> Parser:
    parser = Parser(prog="redrafter-mlx", description="ReDrafter speculative decoding for mlx-lm models.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    commands.required = True

    def command(function, *parents, **kwargs) -> Parser:
        doc = function.__doc__.strip()
        sub = commands.add_parser(function.__name__, parents=list(parents), help=doc.split("\n")[0].rstrip("."), description=doc, **kwargs)
        sub.set_defaults(run=function)
        return sub

    p = command(generate, MODEL, DRAFTER, DRAFTING, SAMPLING, SPLIT)
    p.add_argument("--prompt", "-p", default="hello", help="message for the model; '-' reads it from standard input (hello)")
    p.add_argument("--prompts", metavar="FILE", help='JSONL file with a "prompt", "messages" or "tokens" per line: one JSON line per prompt, in order')
    p.add_argument("--batch-size", "-b", type=at_least(1), default=1, help="with --prompts: prompts generated together (1)")
    p.add_argument("--max-tokens", "-n", type=at_least(0), default=256, help="most new tokens (256)")
    p.add_argument("--ignore-chat-template", action="store_true", help="encode the prompt as it is, without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text, tokens and speed figures")

    p = command(chat, MODEL, DRAFTER, DRAFTING, SAMPLING, PROMPT_LOG, ANSWERS)
    p.add_argument("--max-tokens", "-n", type=at_least(0), default=512, help="most new tokens per answer (512)")
    p.add_argument("--system-prompt", help="system message at the start of the conversation")

    p = command(serve, MODEL, DRAFTER, DRAFTING, PROMPT_LOG, ANSWERS, SPLIT)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1; 0.0.0.0 serves other machines too)")
    p.add_argument("--port", type=int, default=8080, help="port (8080)")
    p.add_argument("--max-batch", type=at_least(1), default=8, help="requests decoded together; more wait their turn (8)")
    p.add_argument("--max-tokens", "-n", type=at_least(0), default=512, help="new tokens for a request that names no max_tokens (512)")
    p.add_argument("--prompt-cache-mb", type=float, default=1024, help="memory for finished requests' keys and values, reused by the next turn; 0 turns it off (1024)")
    p.add_argument("--max-body-bytes", type=at_least(1), default=4 << 20, help="largest request body accepted, 413 above (4 MiB)")
    p.add_argument("--api-key", help=f"a key every route but /health then needs (Authorization: Bearer KEY or x-api-key: KEY); also read from ${API_KEY_ENV}")
    p.add_argument("--max-queue", type=at_least(0), help="requests that may wait for a place in the batch; more get 429 with Retry-After (no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGTERM, seconds running requests may finish before they are ended (30)")
    p.add_argument("--keep-alive", type=float, default=5.0, help="seconds between keep-alive comments of a streamed answer that is waiting or prefilling (5)")

    p = command(bench, MODEL, DRAFTER, SAMPLING, SPLIT)
    p.add_argument("--prompts", metavar="FILE", help="JSONL prompts file (default: 8 built-in prompts)")
    p.add_argument("--num-prompts", type=at_least(1), default=8, help="use the first N prompts, after --every (8)")
    p.add_argument("--every", type=at_least(1), default=1, help="use every K-th prompt of the file (1)")
    p.add_argument("--max-tokens", "-n", type=at_least(1), default=128, help="tokens generated per prompt (128)")
    p.add_argument("--configs", default="auto,lookup,rnn:4x5,both:4x5", help="comma-separated: auto (the defaults), lookup (context lookup only), nodes:K (the defaults' drafts, K nodes verified every step), rnn:WxL (the RNN's beams, all verified), both:WxL (those and one lookup continuation) (auto,lookup,rnn:4x5,both:4x5)")
    p.add_argument("--batch-size", "-b", type=at_least(1), default=1, help="prompts decoded together; 1 compares against mlx-lm's own loop (1)")
    p.add_argument("--repeats", type=at_least(1), default=1, help="times each batch is measured; its speed-up is their median (1)")
    p.add_argument("--calibrate", action="store_true", help="measure this machine's cost curve again before the benchmark")
    p.add_argument("--json", metavar="FILE", help="write the results, machine and settings to this JSON file")
    p.add_argument("--plot", metavar="PNG", help="draw the speed-up per configuration (needs matplotlib)")

    p = command(distill, MODEL, SAMPLING)
    p.add_argument("--prompts", metavar="FILE", help='JSONL prompts file: a "prompt", "messages" or "tokens" per line (serve and chat --log-prompts write such files)')
    p.add_argument("--self-prompts", type=at_least(1), metavar="N", help="instead of --prompts: the model writes N distinct user turns itself (kept in OUTPUT/self-prompts.jsonl), then answers them")
    p.add_argument("--output", "-o", required=True, help="data folder to create, or to resume")
    p.add_argument("--max-tokens", "-n", type=at_least(1), default=256, help="most answer tokens per prompt (256)")
    p.add_argument("--batch-size", "-b", type=at_least(1), default=64, help="prompts generated together; finished ones are replaced by waiting ones (64)")
    p.add_argument("--limit", type=at_least(1), help="use only the first N prompts")
    p.add_argument("--samples", type=at_least(1), default=1, help="sampled answers per prompt; needs --temp above 0 (1)")
    p.add_argument("--workers", type=at_least(1), default=1, help="generating processes, each with its own batch and one BLAS thread: 2 on a 2-core CPU, 1 on a GPU (1)")

    p = command(train, MODEL)
    p.add_argument("--data", action="append", required=True, help="distillation data folder made by distill; repeat for several")
    p.add_argument("--output", "-o", required=True, help="drafter folder to write; training resumes from its checkpoint/")
    p.add_argument("--steps", type=int, help="optimizer steps (2000)")
    p.add_argument("--batch-size", "-b", type=int, help="training positions per step (1024)")
    p.add_argument("--learning-rate", type=float, help="peak AdamW learning rate; linear warm-up, then cosine decay (1e-3)")
    p.add_argument("--warmup", type=int, help="warm-up steps (100)")
    p.add_argument("--weight-decay", type=float, help="AdamW weight decay (0)")
    p.add_argument("--grad-clip", type=float, help="clip the gradient's global norm to this (1)")
    p.add_argument("--warm-start", action="store_true", default=None, help="start from the base model's own head (needs --exit-dim equal to its hidden size)")
    p.add_argument("--freeze-head-steps", type=int, help="with --warm-start: keep the head fixed for the first N steps (0)")
    p.add_argument("--hidden-loss", type=float, help="weight of the squared error between the drafter's features and the base model's next hidden states (0)")
    p.add_argument("--depth", type=int, help="tokens drafted per position while training (5)")
    p.add_argument("--exit-dim", type=int, help="width of the drafter's residual blocks (1024)")
    p.add_argument("--num-draft-layers", type=int, help="residual blocks before the vocabulary projection (1)")
    p.add_argument("--draft-vocab", type=int, help="project onto only the N most frequent generated tokens; 0 for the whole vocabulary (0)")
    p.add_argument("--drafter-dtype", default="float32", choices=["float32", "bfloat16"], help="drafter weights while training (float32)")
    p.add_argument("--eval-every", type=int, help="evaluate on held-out positions every N steps (250)")
    p.add_argument("--save-every", type=int, help="write a resumable checkpoint every N steps (250)")
    p.add_argument("--seed", type=int, help="initialisation and data-order seed (0)")

    p = command(datastore)
    p.add_argument("--data", action="append", required=True, help="distillation data folder made for the drafter's base model; repeat for several")
    p.add_argument("--drafter", required=True, help="drafter folder to add the datastore to (its datastore.npy is replaced)")

    p = command(convert)
    p.add_argument("--torch-path", required=True, help="PyTorch drafter: a trainer output folder, or one .pt/.bin/.safetensors state dict")
    p.add_argument("--mlx-path", default="mlx_drafter", help="output folder, which must not exist or be empty (mlx_drafter)")
    p.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"], help="weight dtype (float16)")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize the vocabulary projection")
    p.add_argument("--q-bits", type=int, default=4, choices=[4, 8], help="bits per weight with --quantize (4)")
    p.add_argument("--base-model", help="check hidden size and vocabulary against this base model")
    p.add_argument("--config", help="drafter config.json to use with a bare state dict")
    for name in ("--vocab-size", "--hidden-size", "--exit-dim", "--num-draft-layers"):
        p.add_argument(name, type=int, help="config field for a bare state dict (else inferred)")
    p.add_argument("--rnn", action=argparse.BooleanOptionalAction, help="config field for a bare state dict (else inferred)")
    return parser


def check_removed(argv: list) -> None:
    removed = dict(REMOVED, **(REMOVED_FROM_TRAIN if argv[:1] == ["train"] else {}))
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in removed:
            fail(f"{flag} was removed: {removed[flag]}")


def use_a_temp_dir_that_exists() -> None:
    """MLX's CPU backend compiles fused kernels in the temporary directory
    C++ finds from the first of TMPDIR, TMP, TEMP, TEMPDIR that is set; if
    that one does not exist, every compiled operation fails. Point it at the
    directory Python's ``tempfile`` finds instead, with one warning line."""
    for name in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        path = os.environ.get(name)
        if path:
            if not os.path.isdir(path):
                fallback = tempfile.gettempdir()
                print(f"warning: {name}={path} is not a directory; using {fallback}", file=sys.stderr)
                os.environ[name] = fallback
            return


def main(argv=None) -> None:
    """Entry point: runs a command, turning bad input into one error line."""
    argv = sys.argv[1:] if argv is None else list(argv)
    use_a_temp_dir_that_exists()
    try:
        check_removed(argv)
        args = build_parser().parse_args(argv)
        args.run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except RuntimeError as e:
        if "MLX_RANK" not in os.environ:
            raise
        # One of several ranks: MLX's transport failed because another rank stopped.
        print(f"error: {e}; another rank stopped", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
