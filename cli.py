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
