"""The ``redrafter-mlx`` command line (installed as ``redrafter_mlx.cli``)."""

import json
import os
import sys
import tempfile
import time
from typing import List, Optional

import typer

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)
from redrafter_mlx.errors import UserError

app = typer.Typer(
    help="ReDrafter speculative decoding for mlx-lm models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

MODEL_HELP = "Model: mlx-lm / Hugging Face folder, Hub id, or .gguf file. Default: the embedded SmolLM2-135M-Instruct."
DRAFTER_HELP = "Drafter folder (config.json + model.safetensors), or 'none' for context lookup only. Default: the drafter shipped for this model (found by the model's identity), else context lookup only."
DTYPE_HELP = "Keep the base model in this dtype: float32, float16, bfloat16, or 'native' for the file's own. Default: float32 on the CPU, native on Metal."


@app.callback()
def _group() -> None:
    """ReDrafter speculative decoding for mlx-lm models."""


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _sampling(temp, top_p, top_k, min_p, repetition_penalty, seed):
    from redrafter_mlx.sampling import SamplingSettings, make_chooser

    settings = SamplingSettings(
        temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed
    )
    return make_chooser(settings)


MODEL = typer.Option(None, "--model", "-m", help=MODEL_HELP)
DRAFTER = typer.Option(None, "--drafter", "-d", help=DRAFTER_HELP)
DTYPE = typer.Option(None, "--dtype", help=DTYPE_HELP)
BEAM_WIDTH = typer.Option("auto", "--beam-width", help="Beams the RNN drafts per step; auto is 4.")
BEAM_LENGTH = typer.Option("auto", "--beam-length", help="Tokens per beam, counting the last verified token (so beam_length - 1 drafted, by the RNN and by the datastore); auto is 5.")
MAX_NODES = typer.Option("auto", "--max-nodes", help="Drafted tree nodes verified per step; auto chooses them each step from this machine's measured cost of verification (0 is plain decoding).")
NO_LOOKUP = typer.Option(False, "--no-lookup", help="Do not draft by context lookup (RNN only).")
LOOKUP_LENGTH = typer.Option(16, "--lookup-length", help="Tokens each context-lookup continuation drafts (the cost curve still decides how many are verified).")
LOOKUP_MAX_NGRAM = typer.Option(3, "--lookup-max-ngram", help="Longest context suffix that context lookup matches.")
LOOKUP_BEAMS = typer.Option(1, "--lookup-beams", help="Distinct context-lookup continuations proposed per step.")
DATASTORE_BEAMS = typer.Option(2, "--datastore-beams", help="Continuations proposed per step from the drafter's datastore (what the model most often wrote after the context's last tokens), when its folder holds one; 0 turns it off.")
TEMP = typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy.")
TOP_P = typer.Option(1.0, "--top-p", help="Nucleus sampling: keep the most likely tokens up to this probability mass; 1 keeps all.")
TOP_K = typer.Option(0, "--top-k", help="Keep only the k most likely tokens; 0 keeps all.")
MIN_P = typer.Option(0.0, "--min-p", help="Drop tokens less likely than min-p times the most likely one; 0 keeps all.")
REPETITION_PENALTY = typer.Option(None, "--repetition-penalty", help="Penalty > 1 for tokens among the last 20; off by default.")
LOG_PROMPTS = typer.Option(None, "--log-prompts", help="Append each prompt answered to this JSONL file (conversations as \"messages\", raw completions as \"tokens\"); `distill --prompts FILE` makes a drafter's training data from it. Off by default.")
SEED = typer.Option(0, "--seed", help="Random seed. Line i of --prompts samples with its own seed, derived from (seed, i), so copies of a prompt draw independently and a line's output does not depend on --batch-size.")


def _auto_int(value: str, name: str) -> Optional[int]:
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        fail(f"{name} takes a whole number or 'auto', got {value!r}")


def _draft(drafter, beam_width, beam_length, max_nodes, no_lookup, lookup_length, lookup_max_ngram, lookup_beams, datastore_beams):
    """DraftSettings from the command line; 'auto' is the default search."""
    from redrafter_mlx.drafting import DraftSettings

    width, length = _auto_int(beam_width, "--beam-width"), _auto_int(beam_length, "--beam-length")
    if drafter == "none" and width is not None:
        fail("--beam-width sets the RNN drafter's search; it does not go with --drafter none")
    settings = DraftSettings(
        beam_width=DraftSettings.beam_width if width is None else width,
        beam_length=DraftSettings.beam_length if length is None else length,
        max_nodes=_auto_int(max_nodes, "--max-nodes"), lookup=not no_lookup, lookup_length=lookup_length,
        lookup_max_ngram=lookup_max_ngram, lookup_beams=lookup_beams, datastore_beams=datastore_beams,
    )
    settings.check()
    return settings


def _dtype(value: Optional[str]) -> Optional[str]:
    if value is None:
        return "auto"
    return None if value == "native" else value


@app.command()
def generate(
    prompt: str = typer.Option("hello", "--prompt", "-p", help="Message for the model; '-' reads it from stdin."),
    prompts_file: Optional[str] = typer.Option(None, "--prompts", help="JSONL file with a \"prompt\", \"messages\" or \"tokens\" per line (as `distill --prompts`): generate for each (batched), printing one JSON object per line in input order."),
    batch_size: int = typer.Option(1, "--batch-size", "-b", help="With --prompts: prompts generated together."),
    model: Optional[str] = MODEL,
    drafter: Optional[str] = DRAFTER,
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Maximum number of tokens to generate."),
    temp: float = TEMP,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    min_p: float = MIN_P,
    repetition_penalty: Optional[float] = REPETITION_PENALTY,
    seed: int = SEED,
    beam_width: str = BEAM_WIDTH,
    beam_length: str = BEAM_LENGTH,
    max_nodes: str = MAX_NODES,
    no_lookup: bool = NO_LOOKUP,
    lookup_length: int = LOOKUP_LENGTH,
    lookup_max_ngram: int = LOOKUP_MAX_NGRAM,
    lookup_beams: int = LOOKUP_BEAMS,
    datastore_beams: int = DATASTORE_BEAMS,
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template", help="Encode the prompt as it is, without the chat template."),
    dtype: Optional[str] = DTYPE,
    quantize: Optional[int] = typer.Option(None, "--quantize", help="Re-quantize the base model to this many bits."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the text, tokens and speed figures instead of streaming text."),
):
    """Generate text from a prompt (or a prompts file) with ReDrafter."""
    from redrafter_mlx.api import batch_generate, encode_prompt, stream_generate
    from redrafter_mlx.generate import check_settings
    from redrafter_mlx.loading import load
    from redrafter_mlx.prompts import read_prompts

    choose = _sampling(temp, top_p, top_k, min_p, repetition_penalty, seed)
    draft = _draft(drafter, beam_width, beam_length, max_nodes, no_lookup, lookup_length, lookup_max_ngram, lookup_beams, datastore_beams)
    check_settings(max_tokens, draft)
    if batch_size < 1:
        fail(f"batch size must be at least 1, got {batch_size}")
    texts = read_prompts(prompts_file) if prompts_file else None
    if prompt == "-" and texts is None:
        try:
            prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as e:
            fail(f"the prompt on standard input is not UTF-8 text ({e})")
    redrafter, tokenizer = load(model, drafter, dtype=_dtype(dtype), quantize=quantize)
    shape = dict(vars(draft), choose=choose, chat_template=not ignore_chat_template)
    if texts is not None:
        for result in batch_generate(redrafter, tokenizer, texts, max_tokens, batch_size=batch_size, **shape):
            tps = len(result.tokens) / result.seconds if result.seconds else 0.0
            print(json.dumps(_summary(result.text, result.tokens, result.prompt_tokens, result.steps, result.step_tokens, result.step_nodes, tps, result.finish_reason)), flush=True)
        return
    prompt_ids = encode_prompt(tokenizer, prompt, chat_template=not ignore_chat_template)
    text, tokens, last = "", [], None
    for last in stream_generate(redrafter, tokenizer, prompt_ids, max_tokens, **shape):
        text += last.text
        tokens += last.tokens
        if not as_json:
            print(last.text, end="", flush=True)
    steps, step_tokens, step_nodes = (last.steps, last.step_tokens, last.step_nodes) if last else (0, 0, 0)
    tps = last.generation_tps if last else 0.0
    if as_json:
        summary = _summary(text, tokens, len(prompt_ids), steps, step_tokens, step_nodes, tps, last.finish_reason if last else "length")
        summary.update(prompt_tps=last.prompt_tps if last else 0.0, peak_memory_gb=last.peak_memory if last else 0.0)
        print(json.dumps(summary))
    else:
        print()
        if steps:
            print(f"[{len(tokens)} tokens, {tps:.1f} tokens/s, {step_tokens / steps:.2f} tokens/step, prompt {len(prompt_ids)} tokens]", file=sys.stderr)


def _summary(text, tokens, prompt_tokens, steps, step_tokens, step_nodes, generation_tps, finish_reason) -> dict:
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


@app.command()
def chat(
    model: Optional[str] = MODEL,
    drafter: Optional[str] = DRAFTER,
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Maximum tokens per answer."),
    temp: float = TEMP,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    min_p: float = MIN_P,
    repetition_penalty: Optional[float] = REPETITION_PENALTY,
    seed: int = SEED,
    beam_width: str = BEAM_WIDTH,
    beam_length: str = BEAM_LENGTH,
    max_nodes: str = MAX_NODES,
    no_lookup: bool = NO_LOOKUP,
    lookup_length: int = LOOKUP_LENGTH,
    lookup_max_ngram: int = LOOKUP_MAX_NGRAM,
    lookup_beams: int = LOOKUP_BEAMS,
    datastore_beams: int = DATASTORE_BEAMS,
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt", help="System message at the start of the conversation."),
    log_prompts: Optional[str] = LOG_PROMPTS,
    dtype: Optional[str] = DTYPE,
):
    """Chat with the model; answers stream as ReDrafter accepts them."""
    from redrafter_mlx.chat import chat_loop
    from redrafter_mlx.generate import check_settings
    from redrafter_mlx.loading import load
    from redrafter_mlx.prompts import PromptLog

    choose = _sampling(temp, top_p, top_k, min_p, repetition_penalty, seed)
    draft = _draft(drafter, beam_width, beam_length, max_nodes, no_lookup, lookup_length, lookup_max_ngram, lookup_beams, datastore_beams)
    check_settings(max_tokens, draft)
    prompt_log = PromptLog(log_prompts, warn=lambda line: typer.echo(line, err=True)) if log_prompts else None
    redrafter, tokenizer = load(model, drafter, dtype=_dtype(dtype))
    if not tokenizer.has_chat_template:
        fail("this model's tokenizer has no chat template; use `redrafter-mlx generate`")
    chat_loop(redrafter, tokenizer, max_tokens, system_prompt, prompt_log=prompt_log, choose=choose, **vars(draft))


@app.command()
def bench(
    model: Optional[str] = MODEL,
    drafter: Optional[str] = DRAFTER,
    prompts_file: Optional[str] = typer.Option(None, "--prompts", help="JSONL file with a \"prompt\", \"messages\" or \"tokens\" per line (as `distill --prompts`); default: 8 built-in prompts."),
    num_prompts: int = typer.Option(8, "--num-prompts", help="Use the first N prompts (after --every)."),
    every: int = typer.Option(1, "--every", help="Use every K-th prompt of the file (a spread-out subset)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="Tokens generated per prompt."),
    temp: float = TEMP,
    top_p: float = TOP_P,
    seed: int = SEED,
    configs: str = typer.Option("auto,lookup,rnn:4x5,both:4x5", "--configs", help="Configurations to measure, comma-separated: auto (the default settings), final (those with the RNN's final beams only, no partial beams), nostore (those without datastore drafts), lookuplen:N (those with lookup continuations of N tokens), lookup (context lookup only), rnn:WxL (the RNN's beams, all verified), both:WxL (those and one lookup continuation of L - 1 tokens)."),
    batch_size: int = typer.Option(1, "--batch-size", "-b", help="Prompts decoded together (1 compares against mlx-lm's own loop)."),
    repeats: int = typer.Option(1, "--repeats", help="Times each prompt batch is measured; its speed-up is the median of them."),
    calibrate: bool = typer.Option(False, "--calibrate", help="Measure this machine's verification cost curve again (it is cached) before the benchmark."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write all results, machine, mlx version and settings to this JSON file."),
    plot_out: Optional[str] = typer.Option(None, "--plot", help="Draw the speed-up per configuration to this PNG (needs matplotlib)."),
    dtype: Optional[str] = DTYPE,
):
    """Measure autoregressive decoding against ReDrafter on the same prompts."""
    from tqdm import tqdm

    from redrafter_mlx.api import encode_prompt
    from redrafter_mlx.bench import DEFAULT_PROMPTS, environment, format_curve, format_table, parse_configs, plot_speedups, report, run_benchmark
    from redrafter_mlx.cost import cost_curve
    from redrafter_mlx.drafting import DraftSettings
    from redrafter_mlx.loading import load
    from redrafter_mlx.prompts import read_prompts

    chosen = parse_configs(configs)
    if min(num_prompts, every, batch_size, repeats, max_tokens) < 1:
        fail("--num-prompts, --every, --batch-size, --repeats and --max-tokens must be at least 1")
    if plot_out:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("--plot needs matplotlib: pip install matplotlib")
    choose = _sampling(temp, top_p, 0, 0.0, None, seed)
    texts = (read_prompts(prompts_file) if prompts_file else DEFAULT_PROMPTS)[::every][:num_prompts]
    redrafter, tokenizer = load(model, drafter, dtype=_dtype(dtype))
    if redrafter.drafter is None and any(c.name.startswith(("rnn", "both")) for c in chosen):
        fail("the rnn and both configurations need a drafter")
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    env = environment(str(redrafter.base.dtype).replace("mlx.core.", ""))
    typer.echo(f"device {env['device']}, BLAS {env['blas']}, dtype {env['dtype']}, mlx {env['mlx']}, mlx-lm {env['mlx_lm']}")
    default = DraftSettings()
    shape = default.search_shape(redrafter.drafter) if redrafter.drafter else None
    curve = cost_curve(redrafter, min(batch_size, len(prompts)), shape, refresh=calibrate)
    typer.echo(format_curve(curve))
    batches = -(-len(prompts) // batch_size)
    with tqdm(total=repeats * batches * len(chosen), unit="run", desc="bench", file=sys.stderr) as bar:
        results = run_benchmark(
            redrafter, prompts, chosen, max_tokens=max_tokens, batch_size=batch_size, repeats=repeats,
            choose=choose, eos=list(tokenizer.eos_token_ids), progress=bar.update,
        )
    typer.echo(format_table(results))
    mismatched = [r.name for r in results if r.mismatches]
    if mismatched:
        typer.echo(f"WARNING: ReDrafter output differs from autoregressive output for {', '.join(mismatched)}", err=True)
    settings = dict(model=model or "default", drafter=drafter or "default", drafter_sha256=redrafter.drafter_identity or None,
                    model_identity=redrafter.identity, prompts=prompts_file or "built-in", every=every, num_prompts=len(prompts),
                    max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed, batch_size=batch_size, repeats=repeats)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report(results, settings, env, curve), f, indent=2)
    if plot_out:
        plot_speedups(results, plot_out, f"speed-up, {env['device']} {env['dtype']}, batch {batch_size}")


@app.command()
def distill(
    prompts: Optional[str] = typer.Option(None, "--prompts", help="JSONL file with a prompt per line: a \"prompt\" user message or a \"messages\" conversation (the chat template is applied), or \"tokens\" (token ids); `serve --log-prompts` and `chat --log-prompts` write such files."),
    self_prompts: Optional[int] = typer.Option(None, "--self-prompts", help="Instead of --prompts: the model writes N distinct user turns itself (sampled at temperature 1 from its chat template's user-turn header; empty, truncated and repeated ones dropped), kept in OUTPUT/self-prompts.jsonl, then answers them."),
    output: str = typer.Option(..., "--output", "-o", help="Data folder to create, or to resume."),
    model: Optional[str] = MODEL,
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Maximum response tokens per prompt."),
    temp: float = TEMP,
    top_p: float = TOP_P,
    seed: int = SEED,
    batch_size: int = typer.Option(64, "--batch-size", "-b", help="Prompts generated together; finished ones are replaced by waiting ones."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use only the first N prompts."),
    samples: int = typer.Option(1, "--samples", help="Sampled responses per prompt (needs --temp above 0): more data from few prompts."),
    workers: int = typer.Option(1, "--workers", help="Processes generating at once, each with its own batch of --batch-size rows and one BLAS thread. On a CPU with 2 cores, 2 workers measured 1.3x the rate of one (one process leaves a core idle during attention and the activation, which run on one thread); on a GPU keep 1. The data does not depend on it."),
    dtype: Optional[str] = DTYPE,
):
    """Generate distillation data: the base model's own responses to prompts."""
    from pathlib import Path

    from redrafter_mlx.api import encode_prompt
    from redrafter_mlx.base_model import BaseModel
    from redrafter_mlx.distill import DataFolder, check_resumable, distill as run_distill, parallel_stream, response_stream
    from redrafter_mlx.prompts import read_prompts
    from redrafter_mlx.loading import load_base_model
    from redrafter_mlx.sampling import SamplingSettings
    from redrafter_mlx.self_prompts import PROMPTS_FILE, user_turn, write_self_prompts

    if (prompts is None) == (self_prompts is None):
        fail("give either --prompts FILE or --self-prompts N")
    if self_prompts is not None and self_prompts < 1:
        fail(f"--self-prompts must be at least 1, got {self_prompts}")
    if max_tokens < 1 or batch_size < 1 or samples < 1 or workers < 1:
        fail("--max-tokens, --batch-size, --samples and --workers must be at least 1")
    if samples > 1 and temp == 0:
        fail("--samples above 1 needs --temp above 0: greedy responses to a prompt are all the same")
    sampling = SamplingSettings(temp=temp, top_p=top_p, seed=seed)
    texts = read_prompts(prompts)[:limit] if prompts else None
    folder = DataFolder(output)
    settings = dict(model=model or "default", max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed)
    if self_prompts is not None:
        settings["self_prompts"] = self_prompts
        check_resumable(folder, settings)  # before writing the prompts into it
    base_model, tokenizer = load_base_model(model, _dtype(dtype))
    base = BaseModel(base_model)
    if self_prompts is not None:
        turn = user_turn(tokenizer)
        texts = write_self_prompts(base, tokenizer.decode, turn, self_prompts, Path(output) / PROMPTS_FILE, seed=seed, batch_size=batch_size)

    if workers > 1:
        generate = parallel_stream((model, _dtype(dtype)), max_tokens, sampling, tokenizer.eos_token_ids, workers)
    else:
        generate = response_stream(base, max_tokens, sampling, tokenizer.eos_token_ids)
    totals = run_distill(base, lambda text: encode_prompt(tokenizer, text), texts, folder, settings, generate, batch_size, samples)
    typer.echo(
        f"{totals['new_responses']} responses, {totals['new_tokens']} new tokens in {totals['seconds']:.0f} s; "
        f"{output} holds {totals['responses']} responses to {totals['prompts']} prompts"
    )


@app.command()
def train(
    data: List[str] = typer.Option(..., "--data", help="Distillation data folder made by `redrafter-mlx distill`; repeat to train on several (e.g. greedy and sampled responses)."),
    output: str = typer.Option(..., "--output", "-o", help="Drafter folder to write; training resumes from its checkpoint/ if present."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP + " Must be the model the data was distilled from."),
    steps: int = typer.Option(2000, "--steps", help="Optimizer steps."),
    batch_size: int = typer.Option(1024, "--batch-size", "-b", help="Training positions per step."),
    learning_rate: float = typer.Option(1e-3, "--learning-rate", help="Peak AdamW learning rate (linear warm-up, then cosine decay to 0)."),
    warmup: int = typer.Option(100, "--warmup", help="Warm-up steps."),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay."),
    grad_clip: float = typer.Option(1.0, "--grad-clip", help="Clip the gradient's global norm to this."),
    hidden_dropout: float = typer.Option(0.0, "--hidden-dropout", help="Dropout on the base model's hidden state while training (against memorising it)."),
    soft_targets: float = typer.Option(0.0, "--soft-targets", help="Weight of the base model's whole next-token distribution as the target (0: only the generated tokens, the reference objective; 1: only the distribution)."),
    warm_start: bool = typer.Option(False, "--warm-start", help="Start from the base model's own head (needs --exit-dim equal to its hidden size): the first prediction is the base model's ranking of h."),
    freeze_head_steps: int = typer.Option(0, "--freeze-head-steps", help="With --warm-start: keep the vocab projection equal to the base model's head for the first N steps (at least --steps: the whole run, only the features are trained)."),
    hidden_loss: float = typer.Option(0.0, "--hidden-loss", help="Weight of an extra loss: the squared error between the drafter's features and the base model's next hidden states (needs --exit-dim equal to its hidden size)."),
    lookup_weight: float = typer.Option(1.0, "--lookup-weight", help="Weight in the loss of targets that context lookup already drafts right (the tree holds its draft there anyway); 1 weighs every target alike."),
    depth: int = typer.Option(5, "--depth", help="T: tokens drafted per position during training (teacher forcing)."),
    exit_dim: int = typer.Option(1024, "--exit-dim", help="Width of the drafter's residual blocks."),
    num_draft_layers: int = typer.Option(1, "--num-draft-layers", help="Residual blocks before the vocab projection."),
    rnn: bool = typer.Option(True, "--rnn/--no-rnn", help="Recurrent state update (else a running sum of embeddings)."),
    draft_vocab: int = typer.Option(0, "--draft-vocab", help="Project onto only the N most frequent generated tokens; 0 for the full vocabulary."),
    drafter_dtype: str = typer.Option("float32", "--drafter-dtype", help="Drafter weights while training: float32 or bfloat16."),
    eval_every: int = typer.Option(250, "--eval-every", help="Evaluate on held-out sequences every N steps."),
    save_every: int = typer.Option(250, "--save-every", help="Write a resumable checkpoint every N steps."),
    seed: int = typer.Option(0, "--seed", help="Initialisation and data-order seed."),
    dtype: Optional[str] = DTYPE,
):
    """Train a drafter on distilled data."""
    from pathlib import Path

    from redrafter_mlx.base_model import BaseModel
    from redrafter_mlx.distill import DataFolder, Sequences
    from redrafter_mlx.loading import load_base_model
    from redrafter_mlx.train import (
        StackedRows, TrainConfig, Trainer, build_draft_vocab, build_positions, compute_hidden_cache, train as run_train,
    )

    if drafter_dtype not in ("float32", "bfloat16"):
        fail("--drafter-dtype must be float32 or bfloat16")
    if not 0 <= hidden_dropout < 1:
        fail("--hidden-dropout must be in [0, 1)")
    if not 0 <= soft_targets <= 1:
        fail("--soft-targets must be in [0, 1]")
    if not 0 <= lookup_weight <= 1:
        fail(f"--lookup-weight takes a number in [0, 1], got {lookup_weight}")
    if hidden_loss < 0:
        fail("--hidden-loss must be at least 0")
    if freeze_head_steps < 0:
        fail(f"--freeze-head-steps must be at least 0, got {freeze_head_steps}")
    if freeze_head_steps and not warm_start:
        fail("--freeze-head-steps needs --warm-start (it keeps the base model's head)")
    if min(steps, batch_size, depth, exit_dim, eval_every, save_every) < 1 or warmup < 0 or num_draft_layers < 0 or draft_vocab < 0:
        fail("--steps, --batch-size, --depth, --exit-dim, --eval-every and --save-every must be positive")
    out = Path(output)
    if out.exists() and any(out.iterdir()) and not (out / "checkpoint").exists():
        fail(f"output folder {output} exists and holds no training checkpoint to resume")
    config = TrainConfig(
        depth=depth, exit_dim=exit_dim, num_draft_layers=num_draft_layers, rnn=rnn, draft_vocab=draft_vocab,
        dtype=drafter_dtype, steps=steps, batch_size=batch_size, learning_rate=learning_rate, warmup=warmup,
        weight_decay=weight_decay, grad_clip=grad_clip, hidden_dropout=hidden_dropout, soft_targets=soft_targets,
        warm_start=warm_start, freeze_head_steps=freeze_head_steps, hidden_loss=hidden_loss, lookup_weight=lookup_weight, eval_every=eval_every, save_every=save_every, seed=seed,
    )
    if len({os.path.realpath(path) for path in data}) < len(data):
        fail("the same --data folder is given twice")
    folders = [DataFolder(path) for path in data]
    for folder in folders:
        if folder.meta is None:
            fail(f"{folder.path} is not a distillation data folder (run `redrafter-mlx distill` first)")
    base_model, _ = load_base_model(model, _dtype(dtype))
    base = BaseModel(base_model)
    metas = [folder.check_model(base.vocab_size, base.hidden_size) for folder in folders]
    parts = [folder.load() for folder in folders]
    # Rows of the stacked hidden states follow the concatenated sequences' positions.
    hidden = StackedRows([compute_hidden_cache(base, folder, part) for folder, part in zip(folders, parts)])
    sequences = Sequences.concatenate(parts)
    positions = build_positions(sequences, config.depth, config.eval_fraction, lookup_length=config.depth if config.lookup_weight != 1 else 0)
    vocab = build_draft_vocab(sequences, draft_vocab) if draft_vocab else None
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(base, positions, hidden, config, output, vocab)
    if trainer.load_checkpoint():
        typer.echo(f"resuming from step {trainer.step}")
    log_path = out / "train_log.jsonl"
    started = time.time()
    with open(log_path, "a") as log:
        result = run_train(trainer, log=lambda record: log.write(json.dumps(record) + "\n"))
    trainer.export(
        {"training": dict(config.__dict__, data=list(data), sequences=len(sequences), positions=int((~positions.held_out).sum()),
                          distill_settings=[{k: meta.get(k) for k in ("max_tokens", "temp", "num_prompts")} for meta in metas],
                          seconds_this_run=round(time.time() - started), **result)}
    )
    typer.echo(f"drafter written to {output}: {json.dumps(result)}")


@app.command()
def datastore(
    data: List[str] = typer.Option(..., "--data", help="Distillation data folder made by `redrafter-mlx distill` for the drafter's base model; repeat for several."),
    drafter: str = typer.Option(..., "--drafter", help="Drafter folder to add the datastore to (its datastore.npy is replaced)."),
):
    """Add a datastore to a drafter: the base model's distilled answers, from
    which each step also drafts what the model most often wrote after the
    context's last tokens. Answers to the prompts `train` holds out are left out."""
    from pathlib import Path

    from redrafter_mlx.datastore import Datastore
    from redrafter_mlx.distill import DataFolder, Sequences
    from redrafter_mlx.drafter import CONFIG_FILE, DrafterArgs, read_config
    from redrafter_mlx.train import TrainConfig, held_out_sequences

    config_path = Path(drafter) / CONFIG_FILE
    if not config_path.is_file():
        fail(f"drafter folder {drafter} has no {CONFIG_FILE}")
    args = DrafterArgs.from_dict(read_config(config_path))
    if len({os.path.realpath(path) for path in data}) < len(data):
        fail("the same --data folder is given twice")
    folders = [DataFolder(path) for path in data]
    for folder in folders:
        folder.check_model(args.vocab_size, args.hidden_size)
    sequences = Sequences.concatenate([folder.load() for folder in folders])
    keep = ~held_out_sequences(sequences.prompt_index, TrainConfig().eval_fraction)
    store = Datastore.from_answers(sequences, keep, args.vocab_size)
    path = store.save(drafter)
    typer.echo(f"datastore written to {path}: {int((store.tokens >= 0).sum()):,} tokens of {int(keep.sum()):,} answers, {path.stat().st_size / 1e6:.1f} MB")


@app.command()
def convert(
    torch_path: str = typer.Option(..., "--torch-path", help="PyTorch drafter: a trainer output folder (config.json + model.safetensors or pytorch_model.bin), or one .pt/.bin/.safetensors state dict."),
    mlx_path: str = typer.Option("mlx_drafter", "--mlx-path", help="Output folder (must not exist or be empty)."),
    dtype: str = typer.Option("float16", "--dtype", help="Weight dtype: float32, float16 or bfloat16."),
    quantize: bool = typer.Option(False, "-q", "--quantize", help="Quantize the vocab projection."),
    q_bits: int = typer.Option(4, "--q-bits", help="Bits per weight for --quantize: 4 or 8."),
    base_model: Optional[str] = typer.Option(None, "--base-model", help="Check hidden size and vocabulary against this base model (path, Hub id or .gguf)."),
    config_file: Optional[str] = typer.Option(None, "--config", help="Drafter config.json to use with a bare state dict."),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", help="Config field for a bare state dict (else inferred)."),
    hidden_size: Optional[int] = typer.Option(None, "--hidden-size", help="Config field for a bare state dict (else inferred)."),
    exit_dim: Optional[int] = typer.Option(None, "--exit-dim", help="Config field for a bare state dict (else inferred)."),
    num_draft_layers: Optional[int] = typer.Option(None, "--num-draft-layers", help="Config field for a bare state dict (else inferred)."),
    rnn: Optional[bool] = typer.Option(None, "--rnn/--no-rnn", help="Config field for a bare state dict (else inferred)."),
):
    """Convert a drafter trained with PyTorch into the MLX drafter format."""
    from redrafter_mlx.convert import convert_checkpoint

    config = {}
    if config_file:
        try:
            with open(config_file) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            fail(f"cannot read --config {config_file}: {e}")
    fields = dict(vocab_size=vocab_size, hidden_size=hidden_size, exit_dim=exit_dim, num_draft_layers=num_draft_layers, rnn=rnn)
    config.update({k: v for k, v in fields.items() if v is not None})
    summary = convert_checkpoint(
        torch_path, mlx_path, dtype=dtype, quantize_bits=q_bits if quantize else None,
        base_model=base_model, config=config or None,
    )
    for note in summary["notes"]:
        typer.echo(note)
    typer.echo(f"wrote {summary['tensors']} tensors ({summary['bytes'] / 1e6:.1f} MB) to {summary['path']}")


def _listen(host: str, port: int):
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


@app.command()
def serve(
    model: Optional[str] = MODEL,
    drafter: Optional[str] = DRAFTER,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; loopback by default (0.0.0.0 serves other machines too)."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    max_batch: int = typer.Option(8, "--max-batch", help="Requests decoded together; more wait their turn."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="New tokens for a request that names no max_tokens."),
    prompt_cache_mb: float = typer.Option(1024, "--prompt-cache-mb", help="Memory for finished requests' keys and values, reused by a request whose prompt begins with one of theirs (the next turn); 0 turns it off."),
    max_body_bytes: int = typer.Option(4 << 20, "--max-body-bytes", help="Largest request body accepted (413 above)."),
    beam_width: str = BEAM_WIDTH,
    beam_length: str = BEAM_LENGTH,
    max_nodes: str = MAX_NODES,
    no_lookup: bool = NO_LOOKUP,
    lookup_length: int = LOOKUP_LENGTH,
    lookup_max_ngram: int = LOOKUP_MAX_NGRAM,
    lookup_beams: int = LOOKUP_BEAMS,
    datastore_beams: int = DATASTORE_BEAMS,
    log_prompts: Optional[str] = LOG_PROMPTS,
    dtype: Optional[str] = DTYPE,
):
    """Serve the model over an OpenAI-compatible HTTP API, batching concurrent requests."""
    if max_batch < 1:
        fail(f"max batch must be at least 1, got {max_batch}")
    if prompt_cache_mb < 0 or max_tokens < 0:
        fail("--prompt-cache-mb and --max-tokens take numbers >= 0")
    if max_body_bytes < 1:
        fail(f"--max-body-bytes must be at least 1, got {max_body_bytes}")
    draft = _draft(drafter, beam_width, beam_length, max_nodes, no_lookup, lookup_length, lookup_max_ngram, lookup_beams, datastore_beams)
    from redrafter_mlx.prompts import PromptLog

    prompt_log = PromptLog(log_prompts, warn=lambda line: typer.echo(line, err=True)) if log_prompts else None
    sock = _listen(host, port)
    import uvicorn

    from redrafter_mlx.loading import load
    from redrafter_mlx.scheduler import Scheduler
    from redrafter_mlx.server import Server

    redrafter, tokenizer = load(model, drafter, dtype=_dtype(dtype))
    scheduler = Scheduler(redrafter, tokenizer.eos_token_ids, draft, max_batch, int(prompt_cache_mb * 2**20))
    typer.echo("measuring this machine's verification cost (cached after the first time)...", err=True)
    scheduler.start()
    name = os.path.basename(model.rstrip("/")) if model else "SmolLM2-135M-Instruct"
    server = Server(scheduler, tokenizer, name, max_tokens, redrafter.base.max_context, max_body_bytes, prompt_log)
    where = f"[{host}]" if ":" in host else host
    typer.echo(f"serving {name} at http://{where}:{port}/v1 (chat/completions, completions, models; /health); Ctrl-C stops", err=True)
    config = uvicorn.Config(server.app(), log_level="warning", timeout_graceful_shutdown=3)
    uvicorn.Server(config).run(sockets=[sock])
    scheduler.stop()


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
                typer.echo(f"warning: {name}={path} is not a directory; using {fallback}", err=True)
                os.environ[name] = fallback
            return


def main() -> None:
    """Entry point: runs the app, turning bad input into one error line."""
    use_a_temp_dir_that_exists()
    try:
        app()
    except UserError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
