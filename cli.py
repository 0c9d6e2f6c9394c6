"""The ``redrafter-mlx`` command line (installed as ``redrafter_mlx.cli``)."""

import json
import sys
from typing import Optional

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
DRAFTER_HELP = "Drafter folder (config.json + model.safetensors). Default: the drafter shipped for the default model."
DTYPE_HELP = "Keep the base model in this dtype: float32, float16, bfloat16, or 'native' for the file's own. Default: float32 on the CPU, native on Metal."


@app.callback()
def _group() -> None:
    """ReDrafter speculative decoding for mlx-lm models."""


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _dtype(value: Optional[str]) -> Optional[str]:
    if value is None:
        return "auto"
    return None if value == "native" else value


@app.command()
def generate(
    prompt: str = typer.Option("hello", "--prompt", "-p", help="Message for the model; '-' reads it from stdin."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d", help=DRAFTER_HELP),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Maximum number of tokens to generate."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy."),
    beam_width: int = typer.Option(4, "--beam-width", help="Beams drafted per step."),
    beam_length: int = typer.Option(5, "--beam-length", help="Tokens per beam, counting the last verified token (so beam_length - 1 drafted)."),
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template", help="Encode the prompt as it is, without the chat template."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=DTYPE_HELP),
    quantize: Optional[int] = typer.Option(None, "--quantize", help="Re-quantize the base model to this many bits."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the text, tokens and speed figures instead of streaming text."),
):
    """Generate text from a prompt with ReDrafter."""
    from redrafter_mlx.api import encode_prompt, stream_generate
    from redrafter_mlx.generate import check_settings
    from redrafter_mlx.loading import load

    if temp != 0:
        fail("only greedy decoding (--temp 0) is available in this version")
    check_settings(max_tokens, beam_width, beam_length)
    if prompt == "-":
        prompt = sys.stdin.read()
    redrafter, tokenizer = load(model, drafter, dtype=_dtype(dtype), quantize=quantize)
    prompt_ids = encode_prompt(tokenizer, prompt, chat_template=not ignore_chat_template)
    text, tokens, last = "", [], None
    for last in stream_generate(redrafter, tokenizer, prompt_ids, max_tokens, beam_width=beam_width, beam_length=beam_length):
        text += last.text
        tokens += last.tokens
        if not as_json:
            print(last.text, end="", flush=True)
    if as_json:
        print(json.dumps(_summary(text, tokens, len(prompt_ids), last)))
    else:
        print()
        if last is not None and last.steps:
            print(
                f"[{last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s, "
                f"{last.step_tokens / last.steps:.2f} tokens/step, prompt {last.prompt_tokens} tokens]",
                file=sys.stderr,
            )


def _summary(text: str, tokens: list, prompt_tokens: int, last) -> dict:
    steps = last.steps if last else 0
    return {
        "text": text,
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "generation_tokens": len(tokens),
        "steps": steps,
        "tokens_per_step": last.step_tokens / steps if steps else 0.0,
        "prompt_tps": last.prompt_tps if last else 0.0,
        "generation_tps": last.generation_tps if last else 0.0,
        "peak_memory_gb": last.peak_memory if last else 0.0,
        "finish_reason": last.finish_reason if last else "length",
    }


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


def main() -> None:
    """Entry point: runs the app, turning bad input into one error line."""
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
