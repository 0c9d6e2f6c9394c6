"""Distillation data: the base model's own responses to a prompts file.

A data folder holds ``meta.json`` (which model, which prompts, which
settings) and shards ``shard-NNNNN.npz``, each with

- ``prompt_index`` (n,): line of the prompt in the prompts file
- ``sample`` (n,): which of the prompt's sampled responses (``--samples``)
- ``prompt_lengths`` (n,): prompt tokens (chat template applied)
- ``lengths`` (n,): prompt + response tokens
- ``tokens`` (sum(lengths),): the sequences, concatenated

Beside each shard, ``hidden-NNNNN.npy`` (float16, (sum of response
lengths, hidden_size)) keeps the hidden state each response token was chosen
from, in the same order: drafter training needs exactly these, and they come
free with generation. They are a cache: training recomputes any that are
missing (they are too large to keep in git).

The responses are made in a fixed order (shortest prompt first) and in
fixed chunks of ``shard_size``, one shard each, written whole (beside, then
renamed; ``files.replacing``). A chunk is generated alone, as one set of
batches, so its responses do not depend on what ran before it: a run killed
at any moment loses at most the chunk in flight, and running the same
command again writes the same shards as an uninterrupted run would.
"""

import hashlib
import json
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from .. import files
from ..errors import UserError
from .self_prompts import PROMPTS_FILE

META_FILE = "meta.json"
FORMAT_VERSION = 1


@dataclass
class Sequences:
    """Distilled sequences loaded from a data folder."""

    prompt_index: np.ndarray  # (n,)
    prompt_lengths: np.ndarray  # (n,)
    lengths: np.ndarray  # (n,)
    tokens: np.ndarray  # (sum(lengths),)

    def __len__(self) -> int:
        return len(self.lengths)

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.lengths[:i].sum())
        return self.tokens[start : start + int(self.lengths[i])]

    @classmethod
    def concatenate(cls, parts: list["Sequences"]) -> "Sequences":
        """The sequences of several data folders, in order."""
        return cls(
            *(
                np.concatenate([getattr(p, f) for p in parts])
                for f in ("prompt_index", "prompt_lengths", "lengths", "tokens")
            )
        )


class DataFolder:
    """A distillation data folder: its metadata and shards."""

    def __init__(self, path: str):
        self.path = Path(path)

    @property
    def meta(self) -> Optional[dict]:
        meta_path = self.path / META_FILE
        if not meta_path.exists():
            return None
        try:
            return json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read {meta_path}: {e}") from None

    def shards(self) -> list[Path]:
        return sorted(self.path.glob("shard-*.npz"))

    def check_model(self, vocab_size: int, hidden_size: int) -> dict:
        """The folder's metadata, refusing a folder made for another model."""
        meta = self.meta
        if meta is None:
            raise UserError(f"{self.path} is not a distillation data folder (no {META_FILE})")
        for key, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size)):
            if meta.get(key) != value:
                raise UserError(
                    f"data folder {self.path} was made for a model with {key} {meta.get(key)}, "
                    f"but this model has {value}"
                )
        return meta

    def load(self) -> Sequences:
        parts = []
        for shard in self.shards():
            try:
                with np.load(shard) as data:
                    parts.append({k: data[k] for k in ("prompt_index", "prompt_lengths", "lengths", "tokens")})
            except (OSError, ValueError, KeyError) as e:
                raise UserError(f"corrupt shard {shard}: {e}") from None
        if not parts:
            raise UserError(f"data folder {self.path} holds no sequences yet; run `redrafter-mlx distill`")
        return Sequences.concatenate([Sequences(**p) for p in parts])

    def done(self) -> set:
        """(prompt index, sample) of every response already written."""
        done = set()
        for shard in self.shards():
            with np.load(shard) as data:
                samples = data["sample"] if "sample" in data.files else np.zeros_like(data["prompt_index"])
                done.update(zip(data["prompt_index"].tolist(), samples.tolist()))
        return done

    def write_shard(
        self,
        prompt_index: list,
        prompt_lengths: list,
        sequences: list,
        hidden: Optional[list] = None,
        sample: Optional[list] = None,
    ) -> Path:
        """Write one shard (and its hidden states, if given) atomically; on
        failure nothing partial remains."""
        number = len(self.shards())
        final = self.path / f"shard-{number:05d}.npz"
        keeps = f"the {number} shards already written are intact: free space and run the same command again to resume"
        arrays = dict(
            prompt_index=np.asarray(prompt_index, np.int32),
            sample=np.asarray(sample if sample is not None else [0] * len(prompt_index), np.int32),
            prompt_lengths=np.asarray(prompt_lengths, np.int32),
            lengths=np.asarray([len(s) for s in sequences], np.int32),
            tokens=np.concatenate([np.asarray(s, np.int32) for s in sequences]),
        )
        # The hidden states first: a shard is only counted once it exists,
        # and a hidden file without its shard is written again with it.
        if hidden is not None:
            states = np.concatenate(hidden).astype(np.float16)
            with files.replacing(hidden_path(final), states.nbytes, keeps) as temporary:
                with open(temporary, "wb") as f:
                    np.save(f, states)
        with files.replacing(final, sum(a.nbytes for a in arrays.values()), keeps) as temporary:
            with open(temporary, "wb") as f:
                np.savez(f, **arrays)
        return final


def data_folders(paths: list) -> list[DataFolder]:
    """The distillation data folders at ``paths``, each named once."""
    if len({os.path.realpath(path) for path in paths}) < len(paths):
        raise UserError("the same data folder is given twice")
    return [DataFolder(path) for path in paths]


def hidden_path(shard: Path) -> Path:
    return shard.with_name(shard.name.replace("shard-", "hidden-").replace(".npz", ".npy"))


def _prompts_digest(prompts: list[str]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def check_resumable(folder: DataFolder, settings: dict) -> None:
    """Refuse to add to a folder made with other settings (another model,
    other sampling), or to a folder that is not a data folder; before
    anything is written to it."""
    existing = folder.meta
    if existing is None:
        if folder.path.exists() and any(
            p.name != PROMPTS_FILE and not files.is_temporary(p) for p in folder.path.iterdir()
        ):
            raise UserError(f"output folder {folder.path} exists and is not a distillation data folder")
        return
    differences = [k for k in settings if existing.get(k) != settings[k]]
    if differences:
        raise UserError(
            f"{folder.path} was made with different settings ({', '.join(differences)}); use a new output folder"
        )


def prepare_folder(folder: DataFolder, prompts: list[str], settings: dict) -> None:
    """Create the folder's metadata, or check that a resumed run matches it."""
    settings = dict(settings, format=FORMAT_VERSION, num_prompts=len(prompts), prompts_digest=_prompts_digest(prompts))
    check_resumable(folder, settings)
    if folder.meta is None:
        files.write_text(folder.path / META_FILE, json.dumps(settings, indent=2) + "\n")
    files.remove_temporaries(folder.path)


def sample_seed(seed: int, sample: int) -> int:
    """The sampling seed of a prompt's ``sample``-th response: distinct per
    sample, and ``seed`` itself for the first, so a response does not depend
    on how many are asked for or on the batch it ran in."""
    return seed + (sample << 32)


def response_stream(base, max_tokens: int, sampling, eos_token_ids) -> Callable[[list, int, list], Iterator[tuple]]:
    """``generate`` for ``distill``: batched decoding with ``sampling``
    (``SamplingSettings``) that refills the batch as rows finish and yields
    ``(index, response tokens, hidden states)`` for each prompt as soon as it
    is done. ``samples`` gives each prompt's sample number."""
    from dataclasses import replace

    from ..engine.autoregressive import autoregressive_steps
    from ..engine.sampling import make_chooser

    def generate(prompts: list, batch_size: int, samples: list) -> Iterator[tuple]:
        tokens, hidden = {}, {}
        choose = make_chooser(replace(sampling, row_seeds=[sample_seed(sampling.seed, k) for k in samples]))
        steps = autoregressive_steps(
            base,
            prompts,
            max_tokens=max_tokens,
            choose=choose,
            eos_token_ids=eos_token_ids,
            with_hidden=True,
            max_batch=batch_size,
        )
        for step in steps:
            for out in step:
                tokens.setdefault(out.row, []).extend(out.tokens)
                hidden.setdefault(out.row, []).append(out.hidden)
                if out.finish_reason:
                    yield out.row, tokens.pop(out.row), np.concatenate(hidden.pop(out.row))

    return generate


def leave_with_parent() -> None:
    """Make this worker process exit once its parent is gone. A parent killed
    outright (SIGTERM, SIGKILL) runs no clean-up, and its workers would
    otherwise go on decoding unseen, holding the CPU and memory. Waits on
    multiprocessing's parent sentinel (closed when the parent dies): no
    polling, and no race with a parent that died before the thread began."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker(
    load_args: tuple,
    max_tokens: int,
    sampling,
    eos_token_ids,
    prompts: list,
    indices: list,
    samples: list,
    batch_size: int,
    results,
) -> None:
    """One distillation worker process: load the model, generate, and put
    ``(index, response, hidden)`` per finished prompt, then None, on ``results``."""
    leave_with_parent()
    try:
        from ..engine.base_model import BaseModel
        from ..loading.loader import load_base_model

        model, _ = load_base_model(*load_args)
        generate = response_stream(BaseModel(model), max_tokens, sampling, eos_token_ids)
        for local, response, hidden in generate(prompts, batch_size, samples):
            results.put((indices[local], response, hidden))
        results.put(None)
    except KeyboardInterrupt:
        pass
    except Exception as e:  # reported by the parent as one error line
        results.put(("error", str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"))


def parallel_stream(
    load_args: tuple, max_tokens: int, sampling, eos_token_ids, workers: int
) -> Callable[[list, int, list], Iterator[tuple]]:
    """``response_stream`` spread over ``workers`` processes, each loading
    the model with ``load_base_model(*load_args)`` and running its own batch
    of ``batch_size`` rows with one BLAS thread. On a CPU, attention over the
    context and the activation run on one thread, so one process leaves the
    other cores idle for part of each step; two workers fill them. On a GPU
    use one.
    Every response has the same seed as in one process, so the data does not
    depend on ``workers``."""
    import queue

    def generate(prompts: list, batch_size: int, samples: list) -> Iterator[tuple]:
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        parts = [list(range(w, len(prompts), workers)) for w in range(workers)]
        parts = [part for part in parts if part]
        saved = os.environ.get("OPENBLAS_NUM_THREADS")
        os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read by each child when it loads OpenBLAS
        try:
            processes = [
                context.Process(
                    target=_worker,
                    daemon=True,
                    args=(
                        load_args,
                        max_tokens,
                        sampling,
                        eos_token_ids,
                        [prompts[i] for i in part],
                        part,
                        [samples[i] for i in part],
                        batch_size,
                        results,
                    ),
                )
                for part in parts
            ]
            for process in processes:
                process.start()
        finally:
            if saved is None:
                os.environ.pop("OPENBLAS_NUM_THREADS")
            else:
                os.environ["OPENBLAS_NUM_THREADS"] = saved
        try:
            running = len(processes)
            while running:
                try:
                    item = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                    if dead:
                        raise UserError(
                            f"a distillation worker stopped (exit code {dead[0]}); run the same command again to resume"
                        ) from None
                    continue
                if item is None:
                    running -= 1
                elif item[0] == "error":
                    raise UserError(f"distillation worker: {item[1]}")
                else:
                    yield item
        finally:
            for process in processes:
                if process.is_alive():
                    process.terminate()
                process.join()

    return generate


def distill(
    base,
    tokenize: Callable[[str], list],
    prompts: list[str],
    folder: DataFolder,
    settings: dict,
    generate: Callable[[list, int, list], Iterator[tuple]],
    batch_size: int,
    samples: int = 1,
    shard_size: int = 256,
    progress: bool = True,
) -> dict:
    """Generate ``samples`` responses for every prompt (more than one only
    when sampling), skipping those already in ``folder``.

    The responses run in one fixed order, shortest prompt first (little left
    padding), in chunks of ``shard_size``: ``generate(token lists,
    batch_size, sample numbers)`` answers one chunk, ``batch_size`` rows at a
    time, yielding ``(index in the chunk, response, hidden or None)`` as each
    finishes, and the chunk is written as one shard, in that fixed order. A
    chunk is generated alone, so a resumed run's shards are the ones an
    uninterrupted run writes. Returns totals.
    """
    from tqdm import tqdm

    if samples > 1:  # folders of one response per prompt keep their original settings
        settings = dict(settings, samples=samples)
    prepare_folder(folder, prompts, dict(settings, vocab_size=base.vocab_size, hidden_size=base.hidden_size))
    done = folder.done()
    tokenized = [tokenize(prompt) for prompt in prompts]
    too_long = [i for i, tokens in enumerate(tokenized) if base.max_context and len(tokens) >= base.max_context]
    if too_long:
        raise UserError(f"prompt on line {too_long[0] + 1} does not fit the model's context")
    foreign = [i for i, tokens in enumerate(tokenized) if any(t >= base.vocab_size for t in tokens)]
    if foreign:
        raise UserError(
            f"prompt on line {foreign[0] + 1} holds token ids outside the model's vocabulary ({base.vocab_size})"
        )
    order = sorted(
        ((i, k) for i in range(len(prompts)) for k in range(samples)), key=lambda unit: (len(tokenized[unit[0]]), unit)
    )
    chunks = [order[start : start + shard_size] for start in range(0, len(order), shard_size)]
    # Whole chunks are skipped; a folder written before chunks were fixed
    # may hold part of one, and only its missing responses are made.
    chunks = [[unit for unit in chunk if unit not in done] for chunk in chunks]
    left = sum(len(chunk) for chunk in chunks)
    new_tokens, start = 0, time.perf_counter()
    # The bar is closed on any error too, so that the error has a line of its own.
    with tqdm(
        total=len(order), initial=len(order) - left, unit="response", disable=not progress, dynamic_ncols=True
    ) as bar:
        for chunk in filter(None, chunks):
            answers = {}
            for local, response, hidden in generate(
                [tokenized[i] for i, _ in chunk], batch_size, [k for _, k in chunk]
            ):
                answers[local] = (response, hidden)
                new_tokens += len(response)
                bar.update(1)
                bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - start):.0f} tokens/s")
            responses, hidden = zip(*(answers[local] for local in range(len(chunk))))
            indices = [i for i, _ in chunk]
            folder.write_shard(
                indices,
                [len(tokenized[i]) for i in indices],
                [tokenized[i] + r for i, r in zip(indices, responses)],
                list(hidden),
                [k for _, k in chunk],
            )
    return {
        "prompts": len(prompts),
        "responses": len(order),
        "new_responses": left,
        "new_tokens": new_tokens,
        "seconds": time.perf_counter() - start,
    }


def distill_command(
    output: str,
    model: Optional[str],
    dtype: Optional[str],
    sampling,
    *,
    prompts: Optional[str] = None,
    self_prompts: Optional[int] = None,
    limit: Optional[int] = None,
    max_tokens: int = 256,
    batch_size: int = 64,
    samples: int = 1,
    workers: int = 1,
    shard_size: int = 256,
) -> dict:
    """``redrafter-mlx distill``: answer a prompts file (its first ``limit``
    prompts), or ``self_prompts`` prompts the model writes itself, into the
    data folder ``output`` (created, or resumed), with ``sampling``
    (``SamplingSettings``); returns ``distill``'s totals."""
    from ..engine.base_model import BaseModel
    from ..loading.loader import load_base_model
    from ..serving.api import encode_prompt
    from ..serving.prompts import read_prompts
    from .self_prompts import user_turn, write_self_prompts

    if (prompts is None) == (self_prompts is None):
        raise UserError("give either a prompts file or a number of self-written prompts")
    if samples > 1 and sampling.temp == 0:
        raise UserError(
            "more than one sample per prompt needs a temperature above 0: greedy answers to a prompt are all the same"
        )
    texts = read_prompts(prompts)[:limit] if prompts else None
    folder = DataFolder(output)
    settings = dict(
        model=model or "default", max_tokens=max_tokens, temp=sampling.temp, top_p=sampling.top_p, seed=sampling.seed
    )
    for name, off in (("top_k", 0), ("min_p", 0.0), ("repetition_penalty", None)):
        if getattr(sampling, name) != off:
            settings[name] = getattr(sampling, name)
    if self_prompts is not None:
        settings["self_prompts"] = self_prompts
        check_resumable(folder, settings)  # before writing the prompts into it
    base_model, tokenizer = load_base_model(model, dtype)
    base = BaseModel(base_model)
    if self_prompts is not None:
        texts = write_self_prompts(
            base,
            tokenizer.decode,
            user_turn(tokenizer),
            self_prompts,
            Path(output) / PROMPTS_FILE,
            seed=sampling.seed,
            batch_size=batch_size,
        )
    if workers > 1:
        generate = parallel_stream((model, dtype), max_tokens, sampling, tokenizer.eos_token_ids, workers)
    else:
        generate = response_stream(base, max_tokens, sampling, tokenizer.eos_token_ids)
    return distill(
        base,
        lambda text: encode_prompt(tokenizer, text),
        texts,
        folder,
        settings,
        generate,
        batch_size,
        samples,
        shard_size,
    )
