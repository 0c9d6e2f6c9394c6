"""``redrafter-mlx make-drafter``: the whole recipe that makes a drafter for a
model, in resumable stages, sized to the hours the user gives it.

The recipe, the same for every model (what differs comes from the model):

1. **plan**: the prompts (a user's file, a prompt log, or, for a chat
   model, user turns the model writes itself), split into training prompts
   and a held-out set the drafter never sees; the temperatures to distil at
   (a chat model: greedy, as the server's default, and its chat
   temperature; a pretrained model, which continues text: completion
   temperatures); the draft vocabulary (a quarter of the model's
   vocabulary, at most 16,384 rows); and the sizes, from a short
   measurement of this machine's distillation and training rates and
   ``hours``. The plan is written once (``plan.json`` in the work folder)
   and every later run reads it, so that a resumed run makes the same
   drafter as an uninterrupted one.
2. **distil** each run of the plan (``distill``'s data folders, which
   resume where they stopped);
3. **train** (warm-started from the model's own head, kept frozen; resumes
   from its checkpoint);
4. **datastore** from the same answers;
5. **compact**: the drafter's weights in float16;
6. **measure** the speed against plain decoding on the held-out prompts,
   alternating, at each planned temperature, into the model card.

Everything but the drafter lives beside it, in the work folder
``OUTPUT.make/``: the plan, the prompts, the distilled data, and the
drafter as it is made (``drafter/``, with training's checkpoint in
``drafter.train/``). The finished drafter is moved into ``OUTPUT`` last, so
``OUTPUT`` holds the drafter alone, uploadable as it is, and a run killed
at any moment leaves no ``OUTPUT`` that loads. A finished stage is recorded
in ``done.json`` (with its wall and CPU time) and skipped when the command
runs again; every file is written beside and renamed (``files``), so a
stage killed part-way resumes from its last whole file and ends as an
uninterrupted run does.
"""

import json
import os
import random
import resource
import shutil
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

from .. import files
from ..errors import UserError

WORK_SUFFIX = ".make"
PLAN_FILE, DONE_FILE = "plan.json", "done.json"
DRAFTER_DIR = "drafter"  # in the work folder: the drafter as it is made
TRAIN_PROMPTS, HELD_OUT_PROMPTS = "train-prompts.jsonl", "held-out-prompts.jsonl"
SHARES = {"distill": 0.55, "train": 0.3, "measure": 0.15}  # of the hours, per kind of stage
MAX_DRAFT_VOCAB = 16384
BATCH = 512  # training positions per step
MAX_EPOCHS = 2.0  # training steps stop at this many passes over the data
BYTES_PER_POSITION_AND_DIM = (
    2 + 1
)  # float16 hidden states, and what the token data and indexes add per position and dimension
CHAT_TEMP = 0.7  # a chat model's sampling temperature, where its folder recommends none
TEXT_TEMPS = (0.7, 1.0)  # completion temperatures a pretrained model is distilled at
MEASURE_TOKENS = 256


def work_folder(output: str) -> Path:
    """Where the recipe keeps everything but the drafter: ``OUTPUT.make/``."""
    out = Path(os.path.abspath(output))
    if not out.name:
        raise UserError(f"the output folder cannot be {output}")
    return out.with_name(out.name + WORK_SUFFIX)


def draft_vocab_size(vocab_size: int) -> int:
    """Rows of the drafter's vocabulary projection: a quarter of the model's
    vocabulary, in multiples of 1,024, at most ``MAX_DRAFT_VOCAB``: 12,288
    for SmolLM2's 49,152, 16,384 for Gemma's 262,144."""
    return max(1024, min(MAX_DRAFT_VOCAB, vocab_size // 4 // 1024 * 1024)) if vocab_size >= 4096 else vocab_size


def split_prompts(count: int, held_out: int, seed: int) -> tuple[list, list]:
    """(training indices, held-out indices) of ``count`` prompts, a seeded shuffle."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return sorted(order[held_out:]), sorted(order[:held_out])


def check_disk(folder: Path, needed: int) -> None:
    """Refuse to start without room for the data: ``needed`` bytes and a margin."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < 1.5 * needed:
        raise UserError(
            f"too little disk: the data for this drafter needs about {needed / 1e9:.1f} GB and {probe} has "
            f"{free / 1e9:.1f} GB free; free some space, or give fewer --hours"
        )


def cpu_seconds() -> float:
    """CPU seconds this process and its finished children have used."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class Stages:
    """The recipe's stages as they run: each is announced with the time the
    plan gives it and the time left for the whole recipe, and skipped once
    ``done.json`` lists it."""

    def __init__(self, work: Path, plan: dict, say: Callable[[str], None]):
        self.work, self.plan, self.say = work, plan, say
        self.done_path = work / DONE_FILE
        self.done = json.loads(self.done_path.read_text()) if self.done_path.exists() else {}

    def run(self, name: str, estimate: float, body: Callable[[], Optional[dict]]) -> dict:
        if name in self.done:
            self.say(f"[{name}] done already ({self.done[name].get('seconds', 0) / 60:.1f} min)")
            return self.done[name]
        left = sum(s["seconds"] for s in self.plan["stages"] if s["name"] not in self.done)
        if estimate:
            self.say(f"[{name}] about {estimate / 60:.0f} min; about {left / 3600:.1f} h left for the whole recipe")
        else:  # a plan written by hand: no estimates
            self.say(f"[{name}] started")
        tic, cpu = time.time(), cpu_seconds()
        result = body() or {}
        result["seconds"] = round(time.time() - tic)
        result["cpu_seconds"] = round(cpu_seconds() - cpu)
        self.done[name] = result
        files.write_json(
            self.done_path, self.done, "the stages done before are kept: free space and run the same command again"
        )
        return result


def measure_rates(
    base, tokenizer, texts: list, chat: bool, exit_dim: int, draft_vocab: int, seconds: float = 20.0
) -> dict:
    """This machine's distillation rate (generated tokens a second, at
    distillation's batch of 64, in one process, after the prefill) and
    training rate (seconds a step of ``BATCH`` positions), each from a
    short run."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    from ..drafting.drafter import Drafter, DrafterArgs
    from ..engine.autoregressive import autoregressive_steps
    from ..serving.api import encode_prompt
    from .trainer import drafter_loss

    prompts = [encode_prompt(tokenizer, t, chat_template=chat) for t in (texts * 64)[:64]]
    for _ in autoregressive_steps(base, prompts[:2], max_tokens=4):  # warm-up: kernels, allocations
        pass
    steps = autoregressive_steps(base, prompts, max_tokens=1024)
    next(steps)  # the prefill, which distillation pays once per prompt, not per token
    tic, tokens = time.perf_counter(), 0
    for step in steps:
        tokens += sum(len(out.tokens) for out in step)
        if time.perf_counter() - tic > seconds / 2 or not step:
            break
    distill_rate = tokens / (time.perf_counter() - tic)

    drafter = Drafter(DrafterArgs(base.vocab_size, base.hidden_size, exit_dim, draft_vocab_size=draft_vocab))
    drafter.lm_head[-1].freeze()
    optimizer = optim.AdamW(learning_rate=1e-4)
    rng = np.random.default_rng(0)
    hidden = mx.array(rng.standard_normal((BATCH, base.hidden_size)).astype(np.float32))
    tokens_in = mx.array(rng.integers(0, base.vocab_size, (BATCH, 5)).astype(np.int32))
    targets = mx.array(rng.integers(0, draft_vocab, (BATCH, 5)).astype(np.int32))
    teacher = mx.array(rng.standard_normal((BATCH, 5, base.hidden_size)).astype(np.float32))
    loss_and_grad = nn.value_and_grad(drafter, lambda *a: drafter_loss(drafter, base.embed, *a, hidden_weight=1.0)[0])
    times = []
    for _ in range(4):
        t = time.perf_counter()
        loss, grads = loss_and_grad(hidden, tokens_in, targets, teacher)
        optimizer.update(drafter, grads)
        mx.eval(loss, drafter.parameters(), optimizer.state)
        times.append(time.perf_counter() - t)
    return {
        "distill_tokens_per_second": round(distill_rate, 1),
        "train_seconds_per_step": round(statistics.median(times[1:]), 3),
    }


def make_plan(
    model: Optional[str],
    dtype: Optional[str],
    output: str,
    prompts: Optional[str],
    hours: float,
    *,
    seed: int = 0,
    held_out: Optional[int] = None,
    max_prompts: Optional[int] = None,
    steps: Optional[int] = None,
    max_tokens: int = 256,
    measure_prompts: Optional[int] = None,
    say=print,
) -> dict:
    """The plan of a new run (see the module docstring): what the model is,
    the prompts and their split, the distillation runs, the training
    settings, the measurement, and each stage's estimated seconds.
    ``max_prompts``, ``steps`` and ``measure_prompts`` fix sizes that
    ``hours`` would otherwise choose (then no rates are measured for them)."""
    from ..engine.base_model import BaseModel
    from ..loading.loader import generation_config, load_base_model, model_identity
    from ..serving.prompts import read_prompts

    work = work_folder(output)
    base_model, tokenizer = load_base_model(model, dtype)
    base = BaseModel(base_model)
    identity = model_identity(base, tokenizer)
    chat = bool(tokenizer.has_chat_template)
    if prompts is None and not chat:
        raise UserError(
            "this model has no chat template, so it cannot write its own prompts: give --prompts FILE "
            '(text openings it will continue, one {"prompt": ...} per line)'
        )
    texts = read_prompts(prompts) if prompts else None
    if texts is not None and len(texts) < 2:
        raise UserError(f"{prompts} holds {len(texts)} prompt; the recipe needs at least 2 (one is held out)")
    if texts is not None and held_out is not None and held_out >= len(texts):
        raise UserError(f"--held-out {held_out} leaves no prompt of {prompts}'s {len(texts)} to train on")
    exit_dim, vocab = base.hidden_size, draft_vocab_size(base.vocab_size)
    recommended = generation_config(model)
    temps = [0.0, float(recommended.get("temperature") or CHAT_TEMP)] if chat else list(TEXT_TEMPS)
    rates = {}
    if (max_prompts is None or steps is None) and texts is not None:
        say("measuring this machine's distillation and training rates (about half a minute)...")
        rates = measure_rates(base, tokenizer, texts, chat, exit_dim, vocab)
    elif max_prompts is None or steps is None:
        rates = measure_rates(base, tokenizer, ["Hello"] * 4, chat, exit_dim, vocab)
    budget = hours * 3600
    # A chat model's answers end, on average about halfway to the limit; a
    # pretrained model's continuations of text mostly run to it.
    per_prompt = max_tokens * (0.5 if chat else 0.9)
    if max_prompts is None:
        max_prompts = max(8, int(SHARES["distill"] * budget * rates["distill_tokens_per_second"] / per_prompt))
    pool = len(texts) if texts is not None else max_prompts
    count = min(pool, max_prompts + (held_out or 0))
    held = held_out if held_out is not None else max(1, min(48, count // 20))
    if texts is not None:
        train_index, held_index = split_prompts(len(texts), held, seed)
        train_index = train_index[: max(count - held, 1)]
    else:
        train_index, held_index = list(range(count - held)), list(range(count - held, count))
    positions = len(train_index) * per_prompt
    if steps is None:
        steps = int(min(SHARES["train"] * budget / rates["train_seconds_per_step"], MAX_EPOCHS * positions / BATCH))
    steps = max(steps, 20)
    runs = []
    shares = [0.5, 0.5] if chat else [2 / 3, 1 / 3]
    start = 0
    for i, (temp, share) in enumerate(zip(temps, shares)):
        n = len(train_index) - start if i == len(temps) - 1 else int(round(len(train_index) * share))
        # A chat model samples with top-p 0.9 (``chat``'s default), a completion with none.
        runs.append(
            {
                "name": f"distill-t{temp:g}",
                "temp": temp,
                "top_p": 0.9 if chat and temp > 0 else 1.0,
                "seed": seed + i,
                "first": start,
                "count": n,
                "max_tokens": max_tokens,
            }
        )
        start += n
    if measure_prompts is None:
        measure_prompts = min(len(held_index), 12)
    needed = int(positions * base.hidden_size * BYTES_PER_POSITION_AND_DIM)
    check_disk(work, needed)
    distill_rate = rates.get("distill_tokens_per_second") or 1.0
    train_step = rates.get("train_seconds_per_step") or 1.0
    plan = {
        "version": 1,
        "model": model or "default",
        "identity": identity,
        "kind": "chat" if chat else "text",
        "vocab_size": base.vocab_size,
        "hidden_size": base.hidden_size,
        "dtype": dtype,
        "prompts": os.path.abspath(prompts) if prompts else None,
        "self_prompts": None if texts is not None else count,
        "seed": seed,
        "train_prompts": train_index,
        "held_out_prompts": held_index,
        "runs": runs,
        "train": {
            "steps": steps,
            "batch_size": min(BATCH, max(8, int(positions) // 2)),
            "learning_rate": 2e-3,
            "warmup": min(100, steps // 10),
            "exit_dim": exit_dim,
            "warm_start": True,
            "freeze_head_steps": steps,
            "hidden_loss": 1.0,
            "num_draft_layers": 1,
            "draft_vocab": vocab,
            "eval_every": max(steps // 4, 1),
            "save_every": max(min(200, steps // 8), 1),
            "seed": seed,
        },
        "measure": {
            "prompts": measure_prompts,
            "max_tokens": MEASURE_TOKENS,
            "temps": [0.0, temps[-1] if chat else temps[0]],
            "top_p": 0.9 if chat else 1.0,
        },
        "rates": rates,
        "hours": hours,
    }
    plan["stages"] = (
        ([{"name": "self-prompts", "seconds": count * 40 / distill_rate}] if texts is None else [])
        + [{"name": r["name"], "seconds": r["count"] * per_prompt / distill_rate} for r in runs]
        + [
            {"name": "train", "seconds": steps * train_step},
            {"name": "datastore", "seconds": 30.0},
            {"name": "compact", "seconds": 5.0},
            {"name": "measure", "seconds": SHARES["measure"] * budget},
        ]
    )
    return plan


def explicit_plan(path: str, model: Optional[str], dtype: Optional[str]) -> dict:
    """A plan written by hand (``--plan FILE``), for a recipe the automatic
    plan does not make: its ``runs`` name their own prompts files (``prompts``,
    with ``limit`` or ``shortest``: the first or the shortest N), or
    ``self_prompts``, with ``temp``, ``seed``, ``samples`` and
    ``max_tokens``; a run marked ``datastore_only`` feeds the datastore
    alone, one marked ``train_only`` training alone; ``train`` holds ``TrainConfig``'s fields; ``measure`` the
    held-out ``prompts_file``, how many of its ``prompts``, ``max_tokens``
    and ``temps``; an optional ``note`` (say, why a plan was changed by hand)
    is shown in the model card. ``bench/train_default_drafter.sh`` writes one."""
    from ..loading.loader import load_base_model
    from .config import TrainConfig

    try:
        plan = json.loads(Path(path).read_text())
        runs, train, measure = plan["runs"], plan["train"], plan["measure"]
        for run in runs:
            if not {"name", "temp", "seed", "max_tokens"} <= set(run) or not (
                run.get("prompts") or run.get("self_prompts")
            ):
                raise ValueError(
                    f"run {run.get('name')!r} needs name, temp, seed, max_tokens, and prompts or self_prompts"
                )
        if len({run["name"] for run in runs}) != len(runs):
            raise ValueError("two runs share a name")
        TrainConfig(**{k: v for k, v in train.items() if k in TrainConfig.__dataclass_fields__})
        missing = {"prompts_file", "prompts", "max_tokens", "temps"} - set(measure)
        if missing:
            raise ValueError(f"measure needs {', '.join(sorted(missing))}")
        if not Path(measure["prompts_file"]).is_file():
            raise ValueError(f"measure's prompts_file {measure['prompts_file']} does not exist")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"cannot read the plan {path}: {e}") from None
    _, tokenizer = load_base_model(model, dtype)
    for run in runs:
        if run.get("prompts"):
            run["prompts"] = os.path.abspath(run["prompts"])
    measure["prompts_file"] = os.path.abspath(measure["prompts_file"])
    plan.update(
        version=1,
        model=model or "default",
        kind="chat" if tokenizer.has_chat_template else "text",
        dtype=dtype,
        prompts=None,
        self_prompts=None,
        hours=None,
        seed=plan.get("seed", 0),
        runs=runs,
        train=train,
        measure=measure,
        stages=[{"name": r["name"], "seconds": 0.0} for r in runs]
        + [{"name": n, "seconds": 0.0} for n in ("train", "datastore", "compact", "measure")],
    )
    return plan


def load_or_make_plan(output: str, model: Optional[str], say=print, plan_file: Optional[str] = None, **options) -> dict:
    """The work folder's plan, or a new one written there (``plan_file``'s,
    else made for the hours); a plan made for another model is refused."""
    work = work_folder(output)
    path = work / PLAN_FILE
    if path.exists():
        try:
            plan = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read the plan {path} ({e}); remove {work} to start again") from None
        if plan.get("model") != (model or "default"):
            raise UserError(
                f"{work} holds a run for model {plan.get('model')}, not {model or 'default'}; use another --output"
            )
        say(f"resuming the run planned in {path}")
        return plan
    out = Path(output)
    if out.exists() and any(not p.name.startswith(".") for p in out.iterdir()):
        raise UserError(
            f"output folder {output} exists and is not empty, and {work} holds no plan to resume; use a new --output"
        )
    if plan_file is not None:
        plan = explicit_plan(plan_file, model, options.get("dtype"))
    else:
        plan = make_plan(
            model,
            options.pop("dtype", None),
            output,
            options.pop("prompts", None),
            options.pop("hours"),
            say=say,
            **options,
        )
    files.write_json(path, plan)
    return plan


def write_prompt_split(plan: dict, work: Path) -> None:
    """The held-out prompts, the training prompts, and each distillation
    run's share of them, as prompts files in the work folder."""
    from ..serving.prompts import read_prompts
    from .self_prompts import read_self_prompts

    texts = (
        read_prompts(plan["prompts"])
        if plan["prompts"]
        else [r["prompt"] for r in read_self_prompts(work / "self-prompts.jsonl")]
    )

    def write(name: str, indices: list) -> None:
        lines = []
        for i in indices:
            text = texts[i]
            lines.append(
                json.dumps(
                    {"prompt": text}
                    if isinstance(text, str)
                    else {"messages": text}
                    if isinstance(text[0], dict)
                    else {"tokens": text}
                )
            )
        files.write_text(work / name, "\n".join(lines) + "\n")

    write(HELD_OUT_PROMPTS, plan["held_out_prompts"])
    write(TRAIN_PROMPTS, plan["train_prompts"])
    for run in plan["runs"]:
        if "first" in run:
            write(f"{run['name']}.jsonl", plan["train_prompts"][run["first"] : run["first"] + run["count"]])


def run_prompts(run: dict, work: Path, tokenizer=None) -> str:
    """The prompts file a distillation run answers: its own (the ``shortest``
    N of it, by tokens, written into the work folder), or its share of the
    plan's split."""
    if not run.get("prompts"):
        return str(work / f"{run['name']}.jsonl")
    if not run.get("shortest"):
        return run["prompts"]
    from ..serving.api import encode_prompt
    from ..serving.prompts import read_prompts

    path = work / f"{run['name']}.jsonl"
    if not path.exists():
        texts = read_prompts(run["prompts"])
        order = sorted(range(len(texts)), key=lambda i: (len(encode_prompt(tokenizer, texts[i])), i))[: run["shortest"]]
        lines = [
            json.dumps({"prompt": texts[i]} if isinstance(texts[i], str) else {"messages": texts[i]})
            for i in sorted(order)
        ]
        files.write_text(path, "\n".join(lines) + "\n")
    return str(path)


def make_drafter(output: str, model: Optional[str] = None, *, say=print, workers: int = 1, **options) -> dict:
    """``redrafter-mlx make-drafter``: plan (or read the plan), then run
    every stage not yet done; returns the measured figures."""
    import mlx.core as mx

    from ..drafting.drafter import CONFIG_FILE, WEIGHTS_FILE, load_drafter, read_config, save_drafter
    from ..engine.sampling import SamplingSettings
    from ..loading.loader import MODEL_CARD_FILE
    from .card import model_card
    from .checkpoints import publish
    from .config import TrainConfig
    from .datastore import add_datastore
    from .distill import distill_command
    from .train import train_drafter

    command = options.pop("command", None)
    plan = load_or_make_plan(output, model, say=say, **options)
    work = work_folder(output)
    files.remove_temporaries(work)  # what a killed run was writing
    stages = Stages(work, plan, say)
    estimates = {s["name"]: s["seconds"] for s in plan["stages"]}
    dtype = plan.get("dtype")
    model = None if plan["model"] == "default" else plan["model"]
    if plan.get("self_prompts") and plan.get("train_prompts") is not None:

        def write_self():
            from ..engine.base_model import BaseModel
            from ..loading.loader import load_base_model
            from .self_prompts import user_turn, write_self_prompts

            base_model, tokenizer = load_base_model(model, dtype)
            write_self_prompts(
                BaseModel(base_model),
                tokenizer.decode,
                user_turn(tokenizer),
                plan["self_prompts"],
                work / "self-prompts.jsonl",
                seed=plan["seed"],
            )

        stages.run("self-prompts", estimates["self-prompts"], write_self)
    if plan.get("train_prompts") is not None:
        write_prompt_split(plan, work)
    folders, stored = [], []  # data folders training reads; those the datastore reads
    for run in plan["runs"]:
        folder = work / run["name"]
        if not run.get("train_only"):
            stored.append(str(folder))
        if not run.get("datastore_only"):
            folders.append(str(folder))

        def distil(run=run, folder=folder):
            from ..loading.loader import load_base_model

            sampling = SamplingSettings(temp=run["temp"], seed=run["seed"], top_p=run.get("top_p", 1.0))
            if run.get("self_prompts"):
                source = dict(self_prompts=run["self_prompts"])
            else:
                tokenizer = load_base_model(model, dtype)[1] if run.get("shortest") else None
                source = dict(prompts=run_prompts(run, work, tokenizer), limit=run.get("limit"))
            totals = distill_command(
                str(folder),
                model,
                dtype,
                sampling,
                **source,
                max_tokens=run["max_tokens"],
                batch_size=run.get("batch_size", 64),
                samples=run.get("samples", 1),
                workers=workers,
            )
            return {"responses": totals["responses"], "tokens": totals["new_tokens"]}

        stages.run(run["name"], estimates.get(run["name"], 0.0), distil)
    config = TrainConfig(**{k: v for k, v in plan["train"].items() if k in TrainConfig.__dataclass_fields__})
    staged = str(adopt_old_layout(output, work, stages.done))

    def train():
        from .data import cached_positions
        from .distill import DataFolder

        # A batch never larger than half the positions there are (a tiny run's).
        positions = sum(int(cached_positions(DataFolder(f).load()).sum()) for f in folders)
        config.batch_size = max(1, min(config.batch_size, positions // 2))
        result = train_drafter(
            folders, staged, config, model, dtype, resumed=lambda step: say(f"resuming training from step {step}")
        )
        return {"held_out": {k: v for k, v in result.items() if k != "step"}}

    stages.run("train", estimates["train"], train)
    stages.run(
        "datastore",
        estimates["datastore"],
        lambda: dict(zip(("path", "tokens", "answers"), map(str, add_datastore(staged, stored)))),
    )

    def compact():
        # Written beside, then moved in: a run killed here keeps a whole drafter.
        drafter = load_drafter(staged)
        drafter.set_dtype(mx.float16)  # floating arrays only: token ids stay int32
        config_json = read_config(Path(staged) / CONFIG_FILE)
        extra = {k: v for k, v in config_json.items() if k not in drafter.args.to_config()}
        compacted = work / "compact"
        save_drafter(drafter, str(compacted), extra)
        files.sync_tree(compacted)
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            os.replace(compacted / name, Path(staged) / name)
        return {"bytes": (Path(staged) / WEIGHTS_FILE).stat().st_size}

    stages.run("compact", estimates["compact"], compact)

    def measure():
        return measure_speed(
            staged, model, dtype, Path(plan["measure"].get("prompts_file") or work / HELD_OUT_PROMPTS), plan, work, say
        )

    figures = stages.run("measure", estimates["measure"], measure)

    def card():
        record_in_card(staged, plan, stages.done, command)
        name = Path(os.path.abspath(output)).name
        files.write_text(Path(staged) / MODEL_CARD_FILE, model_card(staged, name, f"{name}{WORK_SUFFIX}/"))

    stages.run("card", 0.0, card)
    if Path(staged).is_dir():
        publish(Path(staged), Path(output))
    return figures


def adopt_old_layout(output: str, work: Path, done: dict) -> Path:
    """The folder the drafter is made in: ``OUTPUT.make/drafter``, moved
    into ``OUTPUT`` only once it is finished (``checkpoints.publish``), so that a
    run killed at any moment leaves no ``OUTPUT`` that loads as a drafter.
    A run begun when training wrote into ``OUTPUT`` itself has its drafter
    and its training state moved there first."""
    from ..drafting.drafter import CONFIG_FILE
    from .checkpoints import training_state_folder

    staged = work / DRAFTER_DIR
    out = Path(output)
    if not staged.exists() and "card" not in done and (out / CONFIG_FILE).exists():
        staged.mkdir(parents=True)
        for path in out.iterdir():
            path.rename(staged / path.name)
    old_state, state = training_state_folder(output), training_state_folder(staged)
    if old_state.is_dir() and not state.exists():
        old_state.rename(state)
    return staged


def measure_speed(
    output: str, model: Optional[str], dtype: Optional[str], held_out: Path, plan: dict, work: Path, say
) -> dict:
    """Plain decoding against the new drafter (the default settings) and
    against context lookup alone, on the held-out prompts, alternating, at
    each planned temperature: medians and per-prompt figures. Each
    temperature's figures are kept in the work folder as they are made, so
    that a run stopped here resumes at the next."""
    from ..engine.sampling import SamplingSettings, make_chooser
    from ..loading.loader import load
    from ..serving import bench as benchmark
    from ..serving.api import encode_prompt
    from ..serving.prompts import read_prompts

    redrafter, tokenizer = load(model, drafter=output, dtype=dtype)
    chat = plan["kind"] == "chat"
    prompts = [encode_prompt(tokenizer, t, chat_template=chat) for t in read_prompts(str(held_out))][
        : plan["measure"]["prompts"]
    ]
    curve = benchmark.calibration(redrafter, 1)
    figures = {}
    for temp in plan["measure"]["temps"]:
        kept = work / f"measure-t{temp:g}.json"
        if kept.exists():
            figures[f"temp {temp:g}"] = json.loads(kept.read_text())
            continue
        choose = make_chooser(
            SamplingSettings(temp=temp, top_p=plan["measure"].get("top_p", 1.0) if temp > 0 else 1.0, seed=plan["seed"])
        )
        results = benchmark.run_benchmark(
            redrafter,
            prompts,
            benchmark.parse_configs("auto,lookup"),
            max_tokens=plan["measure"]["max_tokens"],
            batch_size=1,
            repeats=1,
            choose=choose,
            eos=list(tokenizer.eos_token_ids),
            curve=curve,
        )
        summary = {r.name: r.summary() for r in results}
        figures[f"temp {temp:g}"] = {
            name: {
                k: s[k]
                for k in (
                    "speedup_median",
                    "speedup_min",
                    "speedup_max",
                    "tokens_per_step",
                    "nodes_per_step",
                    "baseline_tps",
                    "redrafter_tps",
                    "mismatches",
                )
            }
            for name, s in summary.items()
        }
        files.write_text(kept, json.dumps(figures[f"temp {temp:g}"]) + "\n")
        say(
            f"temperature {temp:g}: "
            + ", ".join(
                f"{name} {s['speedup_median']:.2f}x ({s['tokens_per_step']:.2f} tokens/step)"
                for name, s in summary.items()
            )
        )
    figures["prompts"] = len(prompts)
    figures["max_tokens"] = plan["measure"]["max_tokens"]
    return figures


def record_in_card(output: str, plan: dict, done: dict, command: Optional[str]) -> None:
    """config.json's ``made`` entry, which the model card shows: the command,
    the plan's sizes, each stage's time and the held-out figures."""
    from ..drafting.drafter import CONFIG_FILE

    path = Path(output) / CONFIG_FILE
    config = json.loads(path.read_text())
    config["made"] = {
        "command": command or "redrafter-mlx make-drafter",
        "kind": plan["kind"],
        "prompts": plan["prompts"]
        or (
            f"{plan['self_prompts']} prompts the model wrote itself"
            if plan.get("self_prompts")
            else "the plan's own prompts files"
        ),
        "train_prompts": len(plan.get("train_prompts") or []),
        "held_out_prompts": len(plan.get("held_out_prompts") or []) or plan["measure"]["prompts"],
        "runs": [
            {
                "name": r["name"],
                "temp": r["temp"],
                "count": r.get("count") or r.get("shortest") or r.get("limit") or r.get("self_prompts") or "all",
                "max_tokens": r["max_tokens"],
                **({"prompts": r["prompts"]} if r.get("prompts") else {}),
                **({"responses": done[r["name"]]["responses"]} if "responses" in done.get(r["name"], {}) else {}),
            }
            for r in plan["runs"]
        ],
        **({"note": plan["note"]} if plan.get("note") else {}),
        "held_out_file": plan["measure"].get("prompts_file") and Path(plan["measure"]["prompts_file"]).name,
        "hours_asked": plan["hours"],
        "stage_minutes": {name: round(result.get("seconds", 0) / 60, 1) for name, result in done.items()},
        "cpu_hours": round(sum(result.get("cpu_seconds", 0) for result in done.values()) / 3600, 2),
        "hours": round(sum(result.get("seconds", 0) for result in done.values()) / 3600, 2),
        "held_out_speed": done.get("measure", {}),
    }
    files.write_text(path, json.dumps(config, indent=2) + "\n")
