"""The ``redrafter-mlx`` command line (installed as ``redrafter_mlx.cli``).

A Typer app. Every option is declared once below: an option several
commands share is an ``Annotated`` alias whose help panel names its group,
and one that several commands have alike, each with its own meaning, is a
function of that meaning (``batch_size_option``). The shared options come
in groups (the model; the drafter and drafting; sampling), each a small
frozen dataclass of those aliases that a command takes as one parameter and
receives as one object (``option_groups`` says how). The README's option
tables are rendered from these same declarations by
``scripts/readme_options.py``; a test checks that the README holds them as
rendered.

Exit statuses, one rule: a bad option value exits 2 with one ``error:``
line, whether Click finds it (a number out of range) or a settings object
does (``SamplingSettings`` refusing a temperature); a failure at run time
exits 1 with one ``error:`` line; Ctrl-C exits 130.
"""

import contextlib
import dataclasses
import functools
import inspect
import json
import os
import sys
import tempfile
import typing
from typing import Annotated, Literal, Optional, Union

import typer
import typer.main

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core; the API itself loads lazily)
from redrafter_mlx.errors import UserError

API_KEY_ENV = "REDRAFTER_MLX_API_KEY"
PROG = "redrafter-mlx"

# Options taken out because they measured no gain (bench/research/README.md);
# given, they get one error line.
REMOVED = {
    "--lookup-beams": "one context-lookup continuation per step is kept",
    "--soft-targets": "training on the base model's distribution measured no gain",
    "--hidden-dropout": "dropout on the hidden state measured no gain",
    "--lookup-weight": "weighing lookup's targets measured no gain",
}
REMOVED_FROM_TRAIN = {"--no-rnn": "the drafter trains with its RNN", "--rnn": "the drafter trains with its RNN"}


class Usage(Exception):
    """A bad option value found after parsing (by a settings object or a
    check of several options together): exits 2, as Click's usage errors."""


@contextlib.contextmanager
def checking_options():
    """Settings objects built inside check the options they were given; a
    ``UserError`` they raise is a usage error (exit 2), not a failure."""
    try:
        yield
    except UserError as e:
        raise Usage(str(e)) from None


def auto_int(text: str) -> Optional[int]:
    """A whole number, or ``auto`` (None: the library chooses)."""
    if text is None or text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise typer.BadParameter(f"takes a whole number or 'auto', got {text!r}") from None


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise typer.BadParameter(f"takes a number of seconds, got {text!r}") from None
    if not value > 0:
        raise typer.BadParameter(f"must be more than 0, got {text}")
    return value


def given(**options) -> dict:
    """The options that were given. One left unset is None, and is left out,
    so that the settings object it would go to keeps its own default."""
    return {name: value for name, value in options.items() if value is not None}


# -- shared options -----------------------------------------------------------

MODEL, DRAFTER, SAMPLING, SPLIT_PANEL, ANSWERS_PANEL, LOG_PANEL = (
    "model",
    "drafter and drafting",
    "sampling",
    "several machines (started by mlx.launch)",
    "earlier answers",
    "prompt log",
)

Model = Annotated[
    Optional[str],
    typer.Option(
        "--model",
        "-m",
        help="mlx-lm / Hugging Face folder, Hub id, or .gguf file",
        show_default="the embedded SmolLM2-135M-Instruct",
        rich_help_panel=MODEL,
    ),
]
Dtype = Annotated[
    Optional[Literal["float32", "float16", "bfloat16", "native"]],
    typer.Option(
        help="compute dtype of the base model; native keeps the file's",
        show_default="float32 on the CPU, native on Metal",
        rich_help_panel=MODEL,
    ),
]

Drafter = Annotated[
    Optional[str],
    typer.Option(
        "--drafter",
        "-d",
        help="drafter folder or Hub id, or none for context lookup only",
        show_default="the drafter shipped for this model, else none",
        rich_help_panel=DRAFTER,
    ),
]
BeamWidth = Annotated[
    Optional[int],
    typer.Option(
        parser=auto_int,
        metavar="N|auto",
        help="beams the RNN drafts per step",
        show_default="auto: 4",
        rich_help_panel=DRAFTER,
    ),
]
BeamLength = Annotated[
    Optional[int],
    typer.Option(
        parser=auto_int,
        metavar="N|auto",
        help="tokens per beam, counting the last verified one",
        show_default="auto: 5",
        rich_help_panel=DRAFTER,
    ),
]
MaxNodes = Annotated[
    Optional[int],
    typer.Option(
        parser=auto_int,
        metavar="N|auto",
        help="drafted nodes verified per step; auto sizes each step's tree by this machine's cost; 0 is plain decoding",
        show_default="auto",
        rich_help_panel=DRAFTER,
    ),
]
NoLookup = Annotated[
    bool,
    typer.Option(
        "--no-lookup", help="do not draft by context lookup", show_default="lookup on", rich_help_panel=DRAFTER
    ),
]
LookupLength = Annotated[
    Optional[int],
    typer.Option(
        metavar="N", help="tokens a context-lookup continuation drafts", show_default="16", rich_help_panel=DRAFTER
    ),
]
LookupMaxNgram = Annotated[
    Optional[int],
    typer.Option(
        metavar="N", help="longest context suffix context lookup matches", show_default="3", rich_help_panel=DRAFTER
    ),
]
DatastoreBeams = Annotated[
    Optional[int],
    typer.Option(
        metavar="N",
        help="continuations per step from the drafter's datastore; 0 turns it off",
        show_default="2",
        rich_help_panel=DRAFTER,
    ),
]

Temp = Annotated[
    Optional[float],
    typer.Option(
        help="sampling temperature; 0 is greedy",
        show_default="0, greedy; chat: the model's recommendation, else 0.7",
        rich_help_panel=SAMPLING,
    ),
]
TopP = Annotated[
    Optional[float],
    typer.Option(
        help="keep the most likely tokens up to this probability mass",
        show_default="1, all; chat: 0.9",
        rich_help_panel=SAMPLING,
    ),
]
TopK = Annotated[
    Optional[int], typer.Option(help="keep the k most likely tokens", show_default="0, all", rich_help_panel=SAMPLING)
]
MinP = Annotated[
    Optional[float],
    typer.Option(
        help="drop tokens less likely than this times the most likely one",
        show_default="0, none",
        rich_help_panel=SAMPLING,
    ),
]
RepetitionPenalty = Annotated[
    Optional[float],
    typer.Option(help="penalty above 1 for tokens among the last 20", show_default="off", rich_help_panel=SAMPLING),
]
Seed = Annotated[
    Optional[int],
    typer.Option(
        help="random seed; prompt i of a list samples with its own seed derived from (seed, i)",
        show_default="0",
        rich_help_panel=SAMPLING,
    ),
]

Split = Annotated[
    Literal["pipeline", "tensor"],
    typer.Option(
        help="under mlx.launch: pipeline stages of layers, or tensor parallel where the heads divide (see the README)",
        rich_help_panel=SPLIT_PANEL,
    ),
]
AnswerStoreMb = Annotated[
    float,
    typer.Option(
        metavar="MB",
        min=0,
        help="memory for the answers given so far, which later answers also draft from; 0 turns it off",
        rich_help_panel=ANSWERS_PANEL,
    ),
]
LogPrompts = Annotated[
    Optional[str],
    typer.Option(
        metavar="FILE",
        help="append each conversation answered to this prompts file, which distill --prompts reads",
        show_default="off",
        rich_help_panel=LOG_PANEL,
    ),
]


# Options of one command each, alike in several: each declared once, by a
# function of what it means in the command that takes it.


def max_tokens_option(meaning: str, low: int = 1):
    return Annotated[int, typer.Option("--max-tokens", "-n", min=low, help=meaning)]


def batch_size_option(meaning: str, low: Optional[int] = 1, show_default: Union[bool, str] = True):
    """Prompts decoded together (generate, bench, distill); training positions
    per step in train, which leaves it unset (None) for its own default and
    checks it itself (``low`` None)."""
    return Annotated[
        Optional[int], typer.Option("--batch-size", "-b", min=low, help=meaning, show_default=show_default)
    ]


def prompts_option(meaning: str, show_default: Union[bool, str] = True):
    return Annotated[Optional[str], typer.Option("--prompts", metavar="FILE", help=meaning, show_default=show_default)]


def output_option(meaning: str):
    return Annotated[str, typer.Option("--output", "-o", help=meaning)]


def data_option(meaning: str):
    return Annotated[list[str], typer.Option("--data", help=f"{meaning}; repeat for several")]


def workers_option(what: str):
    return Annotated[
        int,
        typer.Option(
            "--workers", min=1, help=f"{what} processes, each with one BLAS thread: 2 on a 2-core CPU, 1 on a GPU"
        ),
    ]


# -- option groups ------------------------------------------------------------


class OptionGroup:
    """Base of the option groups: frozen dataclasses whose fields are option
    aliases, each field's default its option's. A command takes a group as
    one parameter; ``option_groups`` turns it into options and back."""


@dataclasses.dataclass(frozen=True)
class ModelOptions(OptionGroup):
    """The base model (``--model``) and the dtype it computes in (``--dtype``)."""

    model: Model = None
    dtype: Dtype = None

    @property
    def compute_dtype(self) -> Optional[str]:
        """The loader's ``dtype``: "auto" (the platform's choice) when none
        is given, None for native (the file's own), else the dtype named."""
        return "auto" if self.dtype is None else (None if self.dtype == "native" else self.dtype)

    def load(self, drafter: Optional[str], ranks):
        """(Redrafter, tokenizer): this model and ``drafter``, split over ``ranks``."""
        from redrafter_mlx.loading.loader import load

        return load(self.model, drafter=drafter, dtype=self.compute_dtype, ranks=ranks)


@dataclasses.dataclass(frozen=True)
class DraftOptions(OptionGroup):
    """The drafter (``--drafter``) and how each step drafts."""

    drafter: Drafter = None
    beam_width: BeamWidth = None
    beam_length: BeamLength = None
    max_nodes: MaxNodes = None
    no_lookup: NoLookup = False
    lookup_length: LookupLength = None
    lookup_max_ngram: LookupMaxNgram = None
    datastore_beams: DatastoreBeams = None

    def settings(self):
        """The ``DraftSettings`` these options give (options left unset or
        ``auto`` keep its defaults); a bad value raises ``UserError``."""
        from redrafter_mlx.drafting.settings import DraftSettings

        if self.drafter == "none" and self.beam_width is not None:
            raise UserError("--beam-width sets the RNN drafter's search; it does not go with --drafter none")
        return DraftSettings(
            **given(
                beam_width=self.beam_width,
                beam_length=self.beam_length,
                max_nodes=self.max_nodes,
                lookup=False if self.no_lookup else None,
                lookup_length=self.lookup_length,
                lookup_max_ngram=self.lookup_max_ngram,
                datastore_beams=self.datastore_beams,
            )
        )


@dataclasses.dataclass(frozen=True)
class SamplingOptions(OptionGroup):
    """How the next token is chosen; each field is ``SamplingSettings``' own."""

    temp: Temp = None
    top_p: TopP = None
    top_k: TopK = None
    min_p: MinP = None
    repetition_penalty: RepetitionPenalty = None
    seed: Seed = None

    def settings(self):
        """The ``SamplingSettings`` these options give (options left unset
        keep its defaults); a bad value raises ``UserError``."""
        from redrafter_mlx.engine.sampling import SamplingSettings

        return SamplingSettings(**given(**dataclasses.asdict(self)))


def leaving_out(group: type, *names: str):
    """The annotation of a parameter that takes ``group`` but its options
    ``names``: the command does not offer those, and they keep their defaults."""
    return Annotated[group, frozenset(names)]


def group_taken(annotation) -> tuple:
    """(group, the names of the options taken from it) for a parameter
    annotated with an option group, plain or ``leaving_out`` some; else
    (None, ())."""
    left_out = frozenset()
    if typing.get_origin(annotation) is Annotated:
        annotation, *extras = typing.get_args(annotation)
        left_out = frozenset().union(*(extra for extra in extras if isinstance(extra, frozenset)))
    if not (isinstance(annotation, type) and issubclass(annotation, OptionGroup)):
        return None, ()
    names = [field.name for field in dataclasses.fields(annotation)]
    if left_out - set(names):
        raise TypeError(f"{annotation.__name__} has no options {sorted(left_out - set(names))}")
    return annotation, [name for name in names if name not in left_out]


def option_groups(command):
    """``command`` with each parameter annotated with an option group
    (``base: ModelOptions = ModelOptions()``) turned into that group's options.

    Typer makes a command's options from its signature, one parameter each.
    The signature this returns holds, in place of each group parameter, the
    group's fields as parameters (their aliases and defaults, in their
    order), so the options appear where the parameter stands; each call then
    gathers their values back into one object of the group for ``command``.
    Typer, and so ``--help``, completion and the README's tables, sees only
    plain options. An option named twice in one command is a ``ValueError``
    here, on import."""
    signature = inspect.signature(command)
    groups = {}  # group parameter -> (group, the names of its fields taken)
    parameters = []
    for parameter in signature.parameters.values():
        group, names = group_taken(parameter.annotation)
        if group is None:
            parameters.append(parameter)
            continue
        groups[parameter.name] = (group, names)
        fields = {field.name: field for field in dataclasses.fields(group)}
        parameters += [
            inspect.Parameter(name, parameter.kind, default=fields[name].default, annotation=fields[name].type)
            for name in names
        ]

    @functools.wraps(command)
    def run(**options):
        for parameter, (group, names) in groups.items():
            options[parameter] = group(**{name: options.pop(name) for name in names})
        return command(**options)

    run.__signature__ = signature.replace(parameters=parameters)
    run.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
    return run


# -- the app ------------------------------------------------------------------


def version_callback(value: bool) -> None:
    if value:
        print(f"{PROG} {redrafter_mlx.__version__}")
        raise typer.Exit()


app = typer.Typer(
    name=PROG,
    help="ReDrafter speculative decoding for mlx-lm models: the same answers as plain decoding, in fewer passes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["--help", "-h"]},
)


@app.callback()
def top(
    version: Annotated[
        bool, typer.Option("--version", callback=version_callback, is_eager=True, help="print the version and exit")
    ] = False,
):
    """ReDrafter speculative decoding for mlx-lm models: the same answers as
    plain decoding, in fewer passes of the model."""


# -- helpers the commands share -----------------------------------------------


def join_ranks(split: str):
    """The ranks this process was launched with by mlx.launch (this process
    alone when it was not). Only rank 0 writes to standard output."""
    from redrafter_mlx.engine import distributed

    if not distributed.launched():
        return distributed.ONE_PROCESS
    ranks = distributed.join(split)
    if ranks.rank > 0:
        sys.stdout = open(os.devnull, "w")
    return ranks


def answer_store(megabytes: float):
    from redrafter_mlx.drafting.answers import answer_store as make

    return make(megabytes)


def prompt_log(path: Optional[str]):
    from redrafter_mlx.serving.prompts import PromptLog

    return PromptLog(path, warn=lambda line: print(line, file=sys.stderr)) if path else None


def read_prompt(prompt: str) -> str:
    """The ``--prompt`` text: standard input for ``-``; empty is refused."""
    if prompt == "-":
        try:
            prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"the prompt on standard input is not UTF-8 text ({e})") from None
        if not prompt.strip():
            raise Usage("the prompt on standard input is empty")
    elif not prompt.strip():
        raise Usage("--prompt is empty; give the model something to answer")
    return prompt


def dim(text: str, stream=sys.stderr) -> str:
    """``text`` dimmed where ``stream`` is a terminal."""
    return f"\033[2m{text}\033[0m" if stream.isatty() else text


# -- commands -----------------------------------------------------------------


@app.command()
@option_groups
def generate(
    prompt: Annotated[
        str, typer.Option("--prompt", "-p", help="message for the model; - reads it from standard input")
    ] = "hello",
    prompts: prompts_option(
        'JSONL prompts file: a "prompt", "messages" or "tokens" per line (see "Prompts files")'
    ) = None,
    batch_size: batch_size_option("prompts decoded together") = 1,
    max_tokens: max_tokens_option("most new tokens") = 256,
    ignore_chat_template: Annotated[
        bool, typer.Option("--ignore-chat-template", help="encode the prompt as it is, without the chat template")
    ] = False,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="print one JSON object: text, tokens, prompt_tokens, generation_tokens, steps, tokens_per_step, nodes_per_step, generation_tps, finish_reason, ranks",
        ),
    ] = False,
    base: ModelOptions = ModelOptions(),
    drafting: DraftOptions = DraftOptions(),
    sampling: SamplingOptions = SamplingOptions(),
    split: Split = "pipeline",
):
    """One prompt, streamed; or every prompt of a file, batched, one JSON line per prompt."""
    from redrafter_mlx.engine.sampling import make_chooser
    from redrafter_mlx.serving.prompts import read_prompts

    with checking_options():
        draft, choose = drafting.settings(), make_chooser(sampling.settings())
    texts = read_prompts(prompts) if prompts else None
    text = read_prompt(prompt) if texts is None else None
    ranks = join_ranks(split)
    redrafter, tokenizer = base.load(drafting.drafter, ranks)
    options = dict(vars(draft), choose=choose, chat_template=not ignore_chat_template)
    if texts is not None:
        print_batch(redrafter, tokenizer, texts, max_tokens, batch_size, options)
    else:
        stream_one(redrafter, tokenizer, text, max_tokens, json_out, ranks.size, options)
    ranks.end()  # only a normal end: a rank that fails leaves without a word, which ends the others


def print_batch(redrafter, tokenizer, texts, max_tokens, batch_size, options) -> None:
    from redrafter_mlx.serving.api import batch_steps

    for result in batch_steps(redrafter, tokenizer, texts, max_tokens, batch_size=batch_size, **options):
        tps = len(result.tokens) / result.seconds if result.seconds else 0.0
        print(
            json.dumps(
                summary(
                    result.text,
                    result.tokens,
                    result.prompt_tokens,
                    result.steps,
                    result.step_tokens,
                    result.step_nodes,
                    tps,
                    result.finish_reason,
                )
            ),
            flush=True,
        )


def stream_one(redrafter, tokenizer, prompt, max_tokens, json_out, num_ranks, options) -> None:
    from redrafter_mlx.serving.api import encode_prompt, stream_steps

    prompt_ids = encode_prompt(tokenizer, prompt, chat_template=options.pop("chat_template"))
    text, tokens, last = "", [], None
    for last in stream_steps(redrafter, tokenizer, prompt_ids, max_tokens, **options):
        text += last.text
        tokens += last.tokens
        if not json_out:
            print(last.text, end="", flush=True)
    steps, step_tokens, step_nodes, tps = (
        (last.steps, last.step_tokens, last.step_nodes, last.generation_tps) if last else (0, 0, 0, 0.0)
    )
    finish = last.finish_reason if last else "length"
    if json_out:
        out = summary(text, tokens, len(prompt_ids), steps, step_tokens, step_nodes, tps, finish)
        out.update(
            prompt_tps=last.prompt_tps if last else 0.0,
            peak_memory_gb=last.peak_memory if last else 0.0,
            ranks=num_ranks,
        )
        print(json.dumps(out))
        return
    print()
    if finish == "length":
        print(dim(f"[stopped at --max-tokens {max_tokens}]"), file=sys.stderr)
    if steps:
        print(
            f"[{len(tokens)} tokens, {tps:.1f} tokens/s, {step_tokens / steps:.2f} tokens/step, prompt {len(prompt_ids)} tokens]",
            file=sys.stderr,
        )


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


@app.command()
@option_groups
def chat(
    max_tokens: max_tokens_option("most new tokens per answer") = 512,
    system_prompt: Annotated[
        Optional[str], typer.Option(help="system message at the start of the conversation")
    ] = None,
    base: ModelOptions = ModelOptions(),
    drafting: DraftOptions = DraftOptions(),
    sampling: SamplingOptions = SamplingOptions(),
    log_prompts: LogPrompts = None,
    answer_store_mb: AnswerStoreMb = 64,
):
    """A multi-turn chat in the terminal; answers stream as they are accepted.

    \b
    In the chat:
      /help          list these commands
      /reset         clear the conversation
      /stats         speed and first-token latency
      /quit, exit, quit, Ctrl-D
                     leave
      Ctrl-C         stop an answer
    """
    from redrafter_mlx.engine.distributed import ONE_PROCESS
    from redrafter_mlx.engine.sampling import make_chooser
    from redrafter_mlx.serving.chat import chat_loop, chat_sampling

    with checking_options():
        draft = drafting.settings()
        sampling.settings()  # checked now; what the chat samples with also takes the model's recommendation
    log = prompt_log(log_prompts)
    redrafter, tokenizer = base.load(drafting.drafter, ONE_PROCESS)  # a chat runs in one process
    redrafter.answers = answer_store(answer_store_mb)
    if not tokenizer.has_chat_template:
        raise UserError("this model's tokenizer has no chat template; use `redrafter-mlx generate`")
    chosen = chat_sampling(redrafter.generation_config, **dataclasses.asdict(sampling))
    chat_loop(
        redrafter,
        tokenizer,
        max_tokens,
        system_prompt,
        prompt_log=log,
        choose=make_chooser(chosen),
        dim=lambda text: dim(text, sys.stdout),
        **vars(draft),
    )


@app.command()
@option_groups
def serve(
    host: Annotated[str, typer.Option(help="address to listen on; 0.0.0.0 serves other machines too")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="port")] = 8080,
    max_batch: Annotated[int, typer.Option(min=1, help="requests decoded together; more wait their turn")] = 8,
    max_tokens: max_tokens_option("new tokens for a chat or completions request that names no max_tokens") = 512,
    max_output_tokens: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help="the most new tokens any answer gets; a request asking for more is cut to it (agents ask for tens of thousands)",
            show_default="the model's context",
        ),
    ] = None,
    prompt_cache_mb: Annotated[
        float,
        typer.Option(
            min=0, help="memory for finished requests' keys and values, reused by the next turn; 0 turns it off"
        ),
    ] = 1024,
    max_body_bytes: Annotated[
        int, typer.Option(min=1, help="largest request body accepted (413 above)", show_default="4 MiB")
    ] = 4 << 20,
    read_timeout: Annotated[
        float,
        typer.Option(
            parser=positive_seconds,
            metavar="SECONDS",
            help="seconds a client has to send a request's headers (from the connection's opening or the previous answer), then as long for its body; a late body gets 408, late headers a closed connection",
        ),
    ] = 30.0,
    max_header_bytes: Annotated[
        int, typer.Option(min=1024, help="largest request line and headers accepted (431 above)", show_default="64 KiB")
    ] = 64 << 10,
    max_connections: Annotated[
        int, typer.Option(min=1, help="open connections, idle ones included; a request on one beyond gets 503")
    ] = 2048,
    api_key: Annotated[
        Optional[str],
        typer.Option(
            help="the key every route but /health and / then needs (Authorization: Bearer KEY or x-api-key: KEY)",
            show_default=f"none, or ${API_KEY_ENV}",
        ),
    ] = None,
    max_queue: Annotated[
        Optional[int],
        typer.Option(
            min=0, help="requests that may wait for a place in the batch; more get 429", show_default="no limit"
        ),
    ] = None,
    prefill_share: Annotated[
        float,
        typer.Option(
            min=0.01,
            max=1.0,
            help="the most of the engine's time a long prompt's prefill takes while other requests decode: lower favours those, higher the long prompt's first token",
        ),
    ] = 0.2,
    keep_alive: Annotated[
        float,
        typer.Option(
            parser=positive_seconds,
            metavar="SECONDS",
            help="seconds between keep-alive comments of a streamed answer that waits or prefills",
        ),
    ] = 5.0,
    shutdown_timeout: Annotated[
        float, typer.Option(min=0, help="on SIGTERM, seconds running requests may finish")
    ] = 30.0,
    access_log: Annotated[
        bool,
        typer.Option(
            "--access-log/--no-access-log",
            help="write a line per request on stderr (client, method, path, status, seconds)",
        ),
    ] = True,
    base: ModelOptions = ModelOptions(),
    drafting: DraftOptions = DraftOptions(),
    log_prompts: LogPrompts = None,
    answer_store_mb: AnswerStoreMb = 64,
    split: Split = "pipeline",
):
    """An HTTP server with the OpenAI and Anthropic APIs that batches concurrent requests (see "Serving")."""
    from redrafter_mlx.serving.process import hold_freed_memory, is_loopback, listen, stopped_by_sigterm

    hold_freed_memory()  # before MLX is imported and starts its threads

    from redrafter_mlx.serving.chat_format import ChatRenderer
    from redrafter_mlx.serving.server import Limits, run_server

    with checking_options():
        draft = drafting.settings()
    with stopped_by_sigterm():  # a SIGTERM while loading or measuring ends cleanly too
        log = prompt_log(log_prompts)
        key = api_key or os.environ.get(API_KEY_ENV) or None
        ranks = join_ranks(split)
        if ranks.rank > 0:  # the HTTP server is rank 0's; this rank follows its steps
            from redrafter_mlx.serving.scheduler import follow

            redrafter, tokenizer = base.load(drafting.drafter, ranks)
            redrafter.answers = answer_store(answer_store_mb)
            follow(redrafter, ChatRenderer(tokenizer).eos_token_ids, draft, max_batch)  # the answers end as rank 0's do
            ranks.end()
            return
        sock = listen(host, port)
        if key is None and not is_loopback(host):
            print(
                f"warning: serving beyond this machine ({host}) with no API key: anyone who can reach it may use it (--api-key)",
                file=sys.stderr,
            )
        redrafter, tokenizer = base.load(drafting.drafter, ranks)
        redrafter.answers = answer_store(answer_store_mb)
        name = os.path.basename(base.model.rstrip("/")) if base.model else "SmolLM2-135M-Instruct"
        run_server(
            redrafter,
            tokenizer,
            draft,
            sock,
            name,
            max_batch=max_batch,
            max_tokens=max_tokens,
            max_output_tokens=max_output_tokens,
            cache_bytes=int(prompt_cache_mb * 2**20),
            prompt_log=log,
            api_key=key,
            limits=Limits(max_body_bytes, read_timeout, max_header_bytes, max_connections),
            max_queue=max_queue,
            shutdown_timeout=shutdown_timeout,
            keep_alive=keep_alive,
            access_log=access_log,
            prefill_share=prefill_share,
            announce=lambda line: print(line, file=sys.stderr, flush=True),
        )
        ranks.end()


@app.command()
@option_groups
def bench(
    prompts: prompts_option("JSONL prompts file", show_default="8 built-in prompts") = None,
    num_prompts: Annotated[int, typer.Option(min=1, help="use the first N prompts, after --every")] = 8,
    every: Annotated[int, typer.Option(min=1, help="use every K-th prompt of the file")] = 1,
    max_tokens: max_tokens_option("tokens generated per prompt") = 128,
    configs: Annotated[
        str,
        typer.Option(
            help="comma-separated: auto (the defaults), lookup (no drafter), nodes:K (the defaults' drafts, K nodes verified every step), rnn:WxL (the RNN's beams, all verified: the paper's method), both:WxL (those and one lookup continuation)"
        ),
    ] = "auto,lookup,rnn:4x5,both:4x5",
    batch_size: batch_size_option("prompts decoded together; 1 compares against mlx-lm's own loop") = 1,
    repeats: Annotated[int, typer.Option(min=1, help="times each batch is measured; its speed-up is their median")] = 1,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="measure the cost curve again first")] = False,
    json_path: Annotated[
        Optional[str],
        typer.Option(
            "--json",
            metavar="FILE",
            help="write results, machine and settings to this file",
            show_default="bench-DATE-TIME.json in the working folder",
        ),
    ] = None,
    plot: Annotated[
        Optional[str], typer.Option(metavar="PNG", help="draw the speed-ups to this PNG (needs matplotlib)")
    ] = None,
    profile: Annotated[
        bool,
        typer.Option(
            "--profile",
            help="print the milliseconds a step spends drafting, packing, in the pass, choosing and accepting, committing and on the host",
        ),
    ] = False,
    base: ModelOptions = ModelOptions(),
    drafter: Drafter = None,
    sampling: leaving_out(SamplingOptions, "repetition_penalty") = SamplingOptions(),
    split: Split = "pipeline",
):
    """Plain decoding against ReDrafter on the same prompts, alternating, in one process."""
    from redrafter_mlx.engine.sampling import make_chooser
    from redrafter_mlx.serving import bench as benchmark
    from redrafter_mlx.serving.prompts import read_prompts

    with checking_options():
        chosen = benchmark.parse_configs(configs)
        settings = sampling.settings()
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise Usage("--plot needs matplotlib: pip install matplotlib") from None
    texts = (read_prompts(prompts) if prompts else benchmark.DEFAULT_PROMPTS)[::every][:num_prompts]
    ranks = join_ranks(split)
    redrafter, tokenizer = base.load(drafter, ranks)
    if redrafter.drafter is None and any(c.name.startswith(("rnn", "both")) for c in chosen):
        raise Usage("the rnn and both configurations need a drafter")
    used = dict(
        model=base.model or "default",
        drafter=drafter or "default",
        prompts=prompts or "built-in",
        every=every,
        max_tokens=max_tokens,
        temp=sampling.temp or 0.0,
        top_p=sampling.top_p or 1.0,
        seed=sampling.seed or 0,
        batch_size=batch_size,
        repeats=repeats,
    )
    benchmark.bench_command(
        redrafter,
        tokenizer,
        texts,
        chosen,
        make_chooser(settings),
        used,
        ranks=ranks,
        refresh=calibrate,
        json_path=json_path,
        plot=plot,
        profile=profile,
    )
    ranks.end()


@app.command()
@option_groups
def distill(
    output: output_option("data folder to create, or to resume"),
    prompts: prompts_option("JSONL prompts file (serve and chat --log-prompts write such files)") = None,
    self_prompts: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            metavar="N",
            help="instead of --prompts: the model writes N distinct user turns itself (kept in OUTPUT/self-prompts.jsonl), then answers them",
        ),
    ] = None,
    max_tokens: max_tokens_option("most answer tokens per prompt") = 256,
    batch_size: batch_size_option("prompts generated together; finished ones are replaced by waiting ones") = 64,
    limit: Annotated[Optional[int], typer.Option(min=1, help="use only the first N prompts")] = None,
    samples: Annotated[int, typer.Option(min=1, help="sampled answers per prompt (needs --temp above 0)")] = 1,
    workers: workers_option("generating") = 1,
    shard_size: Annotated[
        int, typer.Option(min=1, help="answers per shard file: the most a run stopped part-way loses")
    ] = 256,
    base: ModelOptions = ModelOptions(),
    sampling: SamplingOptions = SamplingOptions(),
):
    """Distillation data: the base model's own answers to prompts, and the hidden states behind them."""
    from redrafter_mlx.training.distill import distill_command

    with checking_options():
        if (prompts is None) == (self_prompts is None):
            raise UserError("give either --prompts FILE or --self-prompts N")
        settings = sampling.settings()
    totals = distill_command(
        output,
        base.model,
        base.compute_dtype,
        settings,
        prompts=prompts,
        self_prompts=self_prompts,
        limit=limit,
        max_tokens=max_tokens,
        batch_size=batch_size,
        samples=samples,
        workers=workers,
        shard_size=shard_size,
    )
    print(
        f"{totals['new_responses']} responses, {totals['new_tokens']} new tokens in {totals['seconds']:.0f} s; "
        f"{output} holds {totals['responses']} responses to {totals['prompts']} prompts"
    )


@app.command()
@option_groups
def train(
    data: data_option("distillation data folder"),
    output: output_option(
        "drafter folder to write, holding only the drafter (uploadable as it is); training resumes from OUTPUT.train/"
    ),
    steps: Annotated[Optional[int], typer.Option(help="optimizer steps", show_default="2000")] = None,
    batch_size: batch_size_option("training positions per step", low=None, show_default="1024") = None,
    learning_rate: Annotated[
        Optional[float],
        typer.Option(help="peak AdamW learning rate (linear warm-up, then cosine decay)", show_default="1e-3"),
    ] = None,
    warmup: Annotated[Optional[int], typer.Option(help="warm-up steps", show_default="100")] = None,
    weight_decay: Annotated[Optional[float], typer.Option(help="AdamW weight decay", show_default="0")] = None,
    grad_clip: Annotated[
        Optional[float], typer.Option(help="clip the gradient's global norm", show_default="1")
    ] = None,
    warm_start: Annotated[
        bool,
        typer.Option(
            "--warm-start",
            help="start from the base model's own output head (needs --exit-dim equal to its hidden size)",
        ),
    ] = False,
    freeze_head_steps: Annotated[
        Optional[int],
        typer.Option(help="with --warm-start: keep that head fixed for the first N steps", show_default="0"),
    ] = None,
    hidden_loss: Annotated[
        Optional[float],
        typer.Option(
            help="weight of the squared error between the drafter's features and the model's next hidden states",
            show_default="0",
        ),
    ] = None,
    depth: Annotated[
        Optional[int], typer.Option(help="tokens drafted per position while training", show_default="5")
    ] = None,
    exit_dim: Annotated[
        Optional[int], typer.Option(help="width of the drafter's residual blocks", show_default="1024")
    ] = None,
    num_draft_layers: Annotated[
        Optional[int], typer.Option(help="residual blocks before the vocabulary projection", show_default="1")
    ] = None,
    draft_vocab: Annotated[
        Optional[int],
        typer.Option(help="project onto only the N most frequent generated tokens", show_default="0, all"),
    ] = None,
    drafter_dtype: Annotated[
        Literal["float32", "bfloat16"], typer.Option(help="drafter weights while training: float32 or bfloat16")
    ] = "float32",
    eval_every: Annotated[
        Optional[int], typer.Option(help="evaluate on held-out positions every N steps", show_default="250")
    ] = None,
    save_every: Annotated[
        Optional[int], typer.Option(help="write a resumable checkpoint every N steps", show_default="250")
    ] = None,
    seed: Annotated[Optional[int], typer.Option(help="initialisation and data-order seed", show_default="0")] = None,
    base: ModelOptions = ModelOptions(),
):
    """Train a drafter on distilled data (resumes from its checkpoint)."""
    from redrafter_mlx.training.train import TrainConfig, train_drafter

    with checking_options():
        config = TrainConfig(
            dtype=drafter_dtype,
            **given(
                steps=steps,
                batch_size=batch_size,
                learning_rate=learning_rate,
                warmup=warmup,
                weight_decay=weight_decay,
                grad_clip=grad_clip,
                warm_start=warm_start,
                freeze_head_steps=freeze_head_steps,
                hidden_loss=hidden_loss,
                depth=depth,
                exit_dim=exit_dim,
                num_draft_layers=num_draft_layers,
                draft_vocab=draft_vocab,
                eval_every=eval_every,
                save_every=save_every,
                seed=seed,
            ),
        )
    result = train_drafter(
        data, output, config, base.model, base.compute_dtype, resumed=lambda step: print(f"resuming from step {step}")
    )
    print(f"drafter written to {output}: {json.dumps(result)}")


@app.command("make-drafter")
@option_groups
def make_drafter(
    output: output_option(
        "drafter folder to make, written once it is finished; its work goes beside it, "
        "in OUTPUT.make/, and a run resumes from it"
    ),
    prompts: prompts_option(
        "JSONL prompts file (a prompt log too); a chat model writes its own when none is given"
    ) = None,
    hours: Annotated[
        float, typer.Option(min=0.01, help="time to spend on this machine, all stages together; sizes come from it")
    ] = 6.0,
    held_out: Annotated[
        Optional[int],
        typer.Option(
            min=1, help="prompts held out of training, to measure the drafter on", show_default="5 %, at most 48"
        ),
    ] = None,
    max_prompts: Annotated[
        Optional[int], typer.Option(min=2, help="prompts to distil, instead of what --hours allows")
    ] = None,
    steps: Annotated[Optional[int], typer.Option(min=1, help="training steps, instead of what --hours allows")] = None,
    max_tokens: max_tokens_option("most answer tokens per distilled prompt") = 256,
    measure_prompts: Annotated[
        Optional[int], typer.Option(min=1, help="held-out prompts the final measurement runs on", show_default="12")
    ] = None,
    workers: workers_option("distilling") = 1,
    seed: Annotated[int, typer.Option(help="the split's, the sampling's and training's seed")] = 0,
    plan: Annotated[
        Optional[str],
        typer.Option(
            metavar="FILE",
            help="a plan written by hand (its own prompts files, runs and settings) instead of one made for --hours",
        ),
    ] = None,
    base: ModelOptions = ModelOptions(),
):
    """Make a drafter for a model: prompts, distillation, training, datastore and the measured speed, in resumable stages.

    Run it again to resume: the plan written by the first run (sizes, seeds,
    the held-out split) is read back, and finished stages are skipped."""
    import shlex

    from redrafter_mlx.training.make_drafter import make_drafter as make

    if plan is not None and any(v is not None for v in (prompts, held_out, max_prompts, steps, measure_prompts)):
        raise Usage(
            "--plan gives the prompts and sizes itself: it does not go with --prompts, --held-out, --max-prompts, --steps or --measure-prompts"
        )
    figures = make(
        output,
        base.model,
        prompts=prompts,
        hours=hours,
        held_out=held_out,
        max_prompts=max_prompts,
        steps=steps,
        max_tokens=max_tokens,
        measure_prompts=measure_prompts,
        seed=seed,
        dtype=base.compute_dtype,
        workers=workers,
        plan_file=plan,
        command=shlex.join([PROG, *sys.argv[1:]]) if sys.argv[1:2] == ["make-drafter"] else None,
        say=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(f"drafter written to {output}: {json.dumps(figures)}")


@app.command()
def datastore(
    data: data_option("distillation data folder of the drafter's model"),
    drafter: Annotated[str, typer.Option(help="drafter folder whose datastore.npy is written")],
):
    """Add a datastore to a drafter: its base model's distilled answers.

    Each step then also drafts what the model most often wrote after the
    context's last tokens. Answers to the prompts training holds out are
    left out."""
    from redrafter_mlx.training.datastore import add_datastore

    path, tokens, answers = add_datastore(drafter, data)
    print(f"datastore written to {path}: {tokens:,} tokens of {answers:,} answers, {path.stat().st_size / 1e6:.1f} MB")


@app.command()
def convert(
    torch_path: Annotated[
        str, typer.Option(help="a PyTorch trainer's output folder, or one .pt/.bin/.safetensors state dict")
    ],
    mlx_path: Annotated[str, typer.Option(help="output folder (must not exist, or be empty)")] = "mlx_drafter",
    dtype: Annotated[Literal["float32", "float16", "bfloat16"], typer.Option(help="weight dtype")] = "float16",
    quantize: Annotated[bool, typer.Option("--quantize", "-q", help="quantize the vocabulary projection")] = False,
    q_bits: Annotated[Literal[4, 8], typer.Option(help="bits per weight with --quantize: 4 or 8")] = 4,
    base_model: Annotated[
        Optional[str], typer.Option(help="check hidden size and vocabulary against this model")
    ] = None,
    config: Annotated[Optional[str], typer.Option(help="drafter config.json for a bare state dict")] = None,
    vocab_size: Annotated[
        Optional[int], typer.Option(help="config field for a bare state dict", show_default="inferred")
    ] = None,
    hidden_size: Annotated[
        Optional[int], typer.Option(help="config field for a bare state dict", show_default="inferred")
    ] = None,
    exit_dim: Annotated[
        Optional[int], typer.Option(help="config field for a bare state dict", show_default="inferred")
    ] = None,
    num_draft_layers: Annotated[
        Optional[int], typer.Option(help="config field for a bare state dict", show_default="inferred")
    ] = None,
    rnn: Annotated[
        Optional[bool],
        typer.Option("--rnn/--no-rnn", help="config field for a bare state dict", show_default="inferred"),
    ] = None,
):
    """Convert a drafter trained with PyTorch into the MLX drafter format."""
    from redrafter_mlx.convert import convert_checkpoint

    fields = {}
    if config:
        try:
            with open(config) as f:
                fields = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read --config {config}: {e}") from None
    given = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, exit_dim=exit_dim, num_draft_layers=num_draft_layers, rnn=rnn
    )
    fields.update({k: v for k, v in given.items() if v is not None})
    done = convert_checkpoint(
        torch_path,
        mlx_path,
        dtype=dtype,
        quantize_bits=int(q_bits) if quantize else None,
        base_model=base_model,
        config=fields or None,
    )
    for note in done["notes"]:
        print(note)
    print(f"wrote {done['tensors']} tensors ({done['bytes'] / 1e6:.1f} MB) to {done['path']}")


# -- entry point ----------------------------------------------------------------


def check_removed(argv: list) -> None:
    removed = dict(REMOVED, **(REMOVED_FROM_TRAIN if argv[:1] == ["train"] else {}))
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in removed:
            raise Usage(f"{flag} was removed: {removed[flag]}")


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


def error_line(error: typer.TyperException) -> str:
    """Click's error as one line; a usage error points at the right ``--help``."""
    ctx = getattr(error, "ctx", None)
    line = f"error: {error.format_message()}"
    if getattr(error, "exit_code", 1) == 2:
        line += f" (see {ctx.command_path if ctx is not None else PROG} --help)"
    return line


def main(argv=None) -> None:
    """Entry point: runs a command; bad input is one ``error:`` line."""
    argv = sys.argv[1:] if argv is None else list(argv)
    use_a_temp_dir_that_exists()
    try:
        check_removed(argv)
        status = typer.main.get_command(app).main(args=argv, prog_name=PROG, standalone_mode=False)
    except typer.TyperException as e:  # Click's: usage errors exit 2
        if type(e).__name__ == "NoArgsIsHelpError":  # the bare command shows its help
            print(e.format_message())
            sys.exit(0)
        print(error_line(e), file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 1))
    except Usage as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except (KeyboardInterrupt, typer.Abort):
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except RuntimeError as e:
        if "MLX_RANK" not in os.environ:
            raise
        # One of several ranks: MLX's transport failed because another rank stopped.
        print(f"error: {e}; another rank stopped", file=sys.stderr)
        sys.exit(1)
    if isinstance(status, int) and status:
        if status == 130:
            print("interrupted", file=sys.stderr)
        sys.exit(status)


if __name__ == "__main__":
    main()
