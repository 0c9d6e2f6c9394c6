"""Would a drafter that reads the context beat one that reads only h? (issue 15)

The RNN drafter sees the base model's last hidden state h[t] and the tokens
it drafts, never the earlier context, so it cannot copy. EAGLE's drafter
reads the context: one decoder layer whose input at each position is
fc([h[t] ; embed(x[t+1])]) and which attends over those inputs at every
earlier position, its output regressed to h[t+1] and read by the base
model's own head. This probe trains such a layer on cached hidden states
and, at equal data, steps and initialisation, the same layer with its
attention removed (the control: what reads only h[t] and x[t+1], as the
RNN's first depth does). Both predict x[t+2], so their teacher-forced
accuracy is the replay's depth 1 (`bench/replay_acceptance.py`).

With ``--layers``, the states of some intermediate layers (RMS-normalised)
join h[t] in the input, as EAGLE-3 fuses low, middle and high features;
variant ``layers`` is the control with them (no attention), ``none`` the
control without. The last layer's state is made to predict x[t+1] only;
earlier layers may keep what x[t+2] needs.

It is a measurement only: the engine has no drafter with a key-value cache
of its own, nor taps on the base model's blocks. Reported on held-out training sequences and on the dev folder, overall
and where context lookup's first drafted token is wrong (there the tree
holds nothing right but the drafter's proposal).

    python3 bench/context_drafter_probe.py --data data/distill-smollm2-135m-seed-t0.7 \\
        --data data/self-smollm2-135m --data data/distill-smollm2-135m-chat:12 \\
        --dev data/eval-dev-smollm2-135m --steps 600 --rnn redrafter_mlx/drafters/smollm2-135m-instruct

Without ``--layers``, hidden states of response positions come from each shard's
``hidden-NNNNN.npy`` (saved by ``distill`` or made by ``train``); those of
the prompt positions are computed once here and kept in ``--work``; with
``--layers`` every state is computed here (Llama-style backbones only). Runs in
float32 on the CPU. The measured result is in
``bench/results/recipe-ablation-dev.md``: no gain from attention (session
16), none from the earlier layers (session 22).
"""

import argparse
import json
import time
from pathlib import Path

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx_lm.models.llama import TransformerBlock

from redrafter_mlx.base_model import BaseModel
from redrafter_mlx.distill import DataFolder, Sequences, hidden_path
from redrafter_mlx.drafter import load_drafter
from redrafter_mlx.loading import load_base_model
from redrafter_mlx.train import build_draft_vocab, draft_index_map, length_batches, lookup_depths


def folder_sequences(base, path: str, shards: int, work: Path, max_positions: int = 0, layers: tuple = ()) -> list[dict]:
    """Each sequence of the folder's first ``shards`` shards (0: all) as
    tokens (L,), h (L-1, hidden) float16 for t = 0 .. L-2, prompt length P
    and prompt index; with ``max_positions``, only the first sequences
    whose responses hold that many positions in all. Prompt states come
    from the backbone, once per prompt (the samples of a prompt share them),
    cached in ``work``. With ``layers``, h is (L-1, hidden * (1 + len(layers))):
    the last layer's state, then those layers' (see ``sequence_states``), all
    computed here."""
    folder = DataFolder(path)
    folder.check_model(base.vocab_size, base.hidden_size)
    tag = "-layers-" + "-".join(map(str, layers)) if layers else ""
    cache_file = work / f"prompt-hidden-{Path(path).name}{tag}.npz"
    used = 0
    states = dict(np.load(cache_file)) if cache_file.exists() else {}
    out = []
    for shard in folder.shards()[: shards or None]:
        with np.load(shard) as data:
            index, prompt_lengths, lengths, tokens = (data[k] for k in ("prompt_index", "prompt_lengths", "lengths", "tokens"))
        response_hidden = None if layers else np.load(hidden_path(shard))
        full = keep = len(lengths)
        if max_positions:
            keep = int(np.searchsorted(np.cumsum(lengths - prompt_lengths), max_positions - used, side="right"))
            index, prompt_lengths, lengths = index[:keep], prompt_lengths[:keep], lengths[:keep]
            used += int((lengths - prompt_lengths).sum())
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        rows = np.concatenate([[0], np.cumsum(lengths - prompt_lengths)[:-1]])
        if layers:  # whole sequences (samples of one prompt differ), keyed by shard and start
            key = [f"{shard.name}:{s}" for s in starts]
            ends = lengths - 1
        else:
            key, ends = [str(i) for i in index], prompt_lengths - 1
        missing = {k: tokens[s : s + e] for k, s, e in zip(key, starts, ends) if k not in states}
        states.update(sequence_states(base, missing, layers))
        for k, i, s, r, p, n in zip(key, index, starts, rows, prompt_lengths, lengths):
            h = states[k] if layers else np.concatenate([states[k], response_hidden[r : r + n - p]])
            out.append({"tokens": tokens[s : s + n].astype(np.int32), "h": h, "P": int(p), "index": int(i)})
        if keep < full:
            break
    np.savez(cache_file, **states)
    return out


def sequence_states(base, sequences: dict, layers: tuple = (), batch_tokens: int = 8192) -> dict:
    """{key: tokens (n,)} -> {key: h (n, hidden * (1 + len(layers))) float16},
    from right-padded batches of sequences of similar length (causal
    attention makes the padding harmless)."""
    keys = list(sequences)
    out = {}
    for members in length_batches(np.array([len(sequences[k]) for k in keys]), batch_tokens):
        batch = np.zeros((len(members), max(len(sequences[keys[members[-1]]]), 1)), np.int32)
        for row, k in enumerate(members):
            batch[row, : len(sequences[keys[k]])] = sequences[keys[k]]
        hidden = np.array(layer_states(base, mx.array(batch), layers).astype(mx.float16))
        out.update({keys[k]: hidden[row, : len(sequences[keys[k]])] for row, k in enumerate(members)})
    return out


def layer_states(base, tokens: mx.array, layers: tuple) -> mx.array:
    """tokens (B, L) -> the backbone's output (B, L, hidden), followed by the
    outputs of ``layers`` (indices into the backbone's blocks) divided by
    their root mean square: (B, L, hidden * (1 + len(layers))). Runs a
    Llama-style backbone block by block (embed, blocks, norm) and checks
    that this reproduces it."""
    backbone = base.backbone
    if not layers:
        return backbone(tokens)
    x, taps = backbone.embed_tokens(tokens), []
    for i, block in enumerate(backbone.layers):
        x = block(x, mask="causal")
        if i in layers:
            taps.append(x * mx.rsqrt(x.square().mean(axis=-1, keepdims=True) + 1e-6))
    final = backbone.norm(x)
    assert mx.allclose(final[:1, :8], backbone(tokens[:1, :8]), atol=1e-3), "backbone is not embed, blocks, norm"
    return mx.concatenate([final] + taps, axis=-1)


class ContextDrafter(nn.Module):
    """fc([h[t] ; embed(x[t+1])]) -> one decoder layer (causal attention
    over earlier positions, or none) -> features read by the base head.
    Starts as the identity on h, as the RNN's warm start does. ``width``:
    how many columns of the hidden input it reads (h, then any layer
    states)."""

    def __init__(self, model_args, attention: bool, width: int):
        super().__init__()
        size = model_args.hidden_size
        self.width = width
        self.fc = nn.Linear(width + size, size)
        self.fc.weight = mx.concatenate([mx.eye(size), mx.zeros((size, width))], axis=1)
        self.fc.bias = mx.zeros((size,))
        self.block = TransformerBlock(model_args)
        self.block.self_attn.o_proj.weight = mx.zeros_like(self.block.self_attn.o_proj.weight)
        self.block.mlp.down_proj.weight = mx.zeros_like(self.block.mlp.down_proj.weight)
        self.attention = attention

    def __call__(self, hidden: mx.array, embedded: mx.array) -> mx.array:
        """hidden, embedded: (B, L, size) -> features (B, L, size)."""
        x = self.fc(mx.concatenate([hidden[..., : self.width], embedded], axis=-1))
        if self.attention:
            return self.block(x, mask="causal")
        return x + self.block.mlp(self.block.post_attention_layernorm(x))


def make_batch(sequences: list[dict], to_draft: np.ndarray, size: int) -> tuple:
    """Right-padded inputs h[t] (B, L, width) and x[t+1] (B, L); the scored
    positions (x[t+1] generated, x[t+2] in the draft vocabulary) as flat
    indices into B * L (n,), their targets' draft indices (n,) and the last
    layer's h[t+1] (n, size)."""
    length = max(len(s["h"]) for s in sequences)
    hidden = np.zeros((len(sequences), length, sequences[0]["h"].shape[1]), np.float32)
    inputs = np.zeros((len(sequences), length), np.int32)
    scored, targets, next_hidden = [], [], []
    for b, s in enumerate(sequences):
        n = len(s["h"])  # L - 1 positions t = 0 .. L-2
        hidden[b, :n] = s["h"]
        inputs[b, :n] = s["tokens"][1:]
        t = np.arange(s["P"] - 1, n - 1)  # x[t+1] generated, x[t+2] exists
        target = to_draft[s["tokens"][t + 2]]
        keep = target >= 0
        scored.append(b * length + t[keep])
        targets.append(target[keep])
        next_hidden.append(s["h"][t[keep] + 1, :size])
    return (mx.array(hidden), mx.array(inputs), mx.array(np.concatenate(scored)), mx.array(np.concatenate(targets)),
            mx.array(np.concatenate(next_hidden).astype(np.float32)))


def batches(sequences: list[dict], batch_tokens: int, seed: int) -> list[list[int]]:
    """Sequences grouped by length into batches of at most ``batch_tokens``
    padded positions, in a seeded random order."""
    groups = length_batches(np.array([len(s["h"]) for s in sequences]), batch_tokens)
    return [groups[i].tolist() for i in np.random.default_rng(seed).permutation(len(groups))]


def accuracy(predict, sequences: list[dict], to_draft: np.ndarray, size: int) -> dict:
    """Depth-1 accuracy of ``predict`` (h[t] (B, L, size), x[t+1] (B, L) ->
    token ids (B, L) for x[t+2]) over every generated position with an
    x[t+2], and over those where context lookup's first drafted token is
    wrong."""
    hits = total = miss_hits = miss_total = 0
    for group in batches(sequences, 8192, 0):
        members = [sequences[i] for i in group]
        hidden, inputs, *_ = make_batch(members, to_draft, size)
        predicted = np.array(predict(hidden, inputs))
        for b, s in enumerate(members):
            first, count = s["P"] - 1, len(s["h"]) - s["P"]  # t = P-1 .. L-3
            if count <= 0:
                continue
            right = predicted[b, first : first + count] == s["tokens"][first + 2 : first + 2 + count]
            lookup_wrong = lookup_depths(s["tokens"].tolist(), first, count, 1) == 0
            hits, total = hits + right.sum(), total + count
            miss_hits, miss_total = miss_hits + right[lookup_wrong].sum(), miss_total + lookup_wrong.sum()
    return {"depth1": round(hits / total, 4), "depth1_where_lookup_wrong": round(miss_hits / miss_total, 4), "positions": int(total)}


def train(base, model_args, variant: str, train_set, evals: dict, draft_ids, args) -> dict:
    mx.random.seed(0)
    size = base.hidden_size
    to_draft = draft_index_map(base.vocab_size, draft_ids)
    head = base.head_rows(mx.array(draft_ids))
    embed = lambda t: mx.stop_gradient(base.embed(t))  # noqa: E731
    attention = variant == "attention"
    width = train_set[0]["h"].shape[1] if variant == "layers" else size
    drafter = ContextDrafter(model_args, attention, width)
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-7, args.learning_rate, args.warmup), optim.cosine_decay(args.learning_rate, args.steps - args.warmup, 0.0)],
        [args.warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.0)

    def loss_fn(hidden, inputs, scored, targets, next_hidden):
        features = drafter(hidden, embed(inputs)).reshape(-1, size)[scored]  # head and losses on scored positions only
        logits = features @ head.T
        ce = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        mse = (features - next_hidden).square().mean(axis=-1)
        return (ce + args.hidden_loss * mse).mean()

    loss_and_grad = nn.value_and_grad(drafter, loss_fn)

    # Not compiled: every batch has its own padded shape, and retracing cost more than compiling saved.
    order, epoch, start = [], 0, time.time()
    for i in range(args.steps):
        if not order:
            order, epoch = batches(train_set, args.batch_tokens, epoch), epoch + 1
        loss = _update(loss_and_grad, optimizer, drafter, make_batch([train_set[j] for j in order.pop()], to_draft, size))
        mx.eval(loss, drafter.state, optimizer.state)
        if (i + 1) % 50 == 0:
            print(f"  {variant} step {i + 1}/{args.steps} loss {loss.item():.3f} {time.time() - start:.0f} s", flush=True)
    result = {"variant": variant, "layers": args.layers if variant == "layers" else "", "steps": args.steps, "train_s": round(time.time() - start), "epochs": epoch}
    ids = mx.array(draft_ids)
    predict = lambda h, x: ids[mx.argmax(drafter(h, embed(x)) @ head.T, axis=-1)]  # noqa: E731
    result.update({name: accuracy(predict, sequences, to_draft, size) for name, sequences in evals.items()})
    return result


def rnn_accuracy(base, path: str, evals: dict, draft_ids) -> dict:
    """The same measures for a trained RNN drafter's first depth."""
    rnn = load_drafter(path)
    to_draft = draft_index_map(base.vocab_size, draft_ids)

    def predict(h, x):
        return rnn.token_ids(mx.argmax(rnn.log_probs(h[..., : base.hidden_size], rnn.update_state(base.embed(x), None)), axis=-1))

    return {"rnn": path, **{name: accuracy(predict, sequences, to_draft, base.hidden_size) for name, sequences in evals.items()}}


def _update(loss_and_grad, optimizer, drafter, batch):
    """One optimizer step on ``batch`` (make_batch's arrays); the loss."""
    loss, grads = loss_and_grad(*batch)
    grads, _ = optim.clip_grad_norm(grads, 1.0)
    optimizer.update(drafter, grads)
    return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", action="append", required=True, help="Training folder, optionally FOLDER:SHARDS for its first SHARDS shards.")
    parser.add_argument("--dev", required=True, help="Greedy folder to measure on (never trained on).")
    parser.add_argument("--work", default="runs/context-probe", help="Where prompt states are cached and results written.")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--hidden-loss", type=float, default=1.0)
    parser.add_argument("--draft-vocab", type=int, default=12288)
    parser.add_argument("--variants", default="attention,none", help="What to train: attention, none, layers (comma-separated; empty for none).")
    parser.add_argument("--layers", default="", help="Intermediate layers (0-based, comma-separated) whose states the 'layers' variant also reads.")
    parser.add_argument("--rnn", action="append", default=[], help="Also measure this trained RNN drafter's first depth (repeatable).")
    parser.add_argument("--max-positions", type=int, default=0, help="Use at most this many response positions in all: the first sequences of the --data folders, in order; 0: all.")
    parser.add_argument("--dev-prompts", help="The dev folder's prompts file: also report dev accuracy per its lines' \"source\".")
    args = parser.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    layers = tuple(int(i) for i in args.layers.split(",") if i)
    model, _ = load_base_model(None, dtype="float32")
    base = BaseModel(model)
    train_set, held_out = [], []
    for spec in args.data:
        path, _, shards = spec.partition(":")
        room = args.max_positions - sum(len(s["tokens"]) - s["P"] for s in train_set + held_out)
        if args.max_positions and room <= 0:
            break
        for s in folder_sequences(base, path, int(shards or 0), work, room if args.max_positions else 0, layers):
            (held_out if s["index"] % 50 == 0 else train_set).append(s)  # the trainer's 2 % rule
    dev = folder_sequences(base, args.dev, 0, work, 0, layers)
    evals = {"held_out": held_out, "dev": dev}
    if args.dev_prompts:
        sources = [json.loads(line).get("source", "") for line in open(args.dev_prompts) if line.strip()]
        for source in sorted(set(sources)):
            evals[f"dev:{source}"] = [s for s in dev if sources[s["index"]] == source]
    draft_ids = build_draft_vocab(_as_sequences(train_set), args.draft_vocab)
    summary = {"data": args.data, "train_sequences": len(train_set), "train_tokens": int(sum(len(s["tokens"]) for s in train_set)),
               "train_positions": int(sum(len(s["tokens"]) - s["P"] for s in train_set)), "batch_tokens": args.batch_tokens,
               "max_positions": args.max_positions}
    print(json.dumps(summary), flush=True)
    jobs = [lambda path=path: rnn_accuracy(base, path, evals, draft_ids) for path in args.rnn]
    jobs += [lambda v=v: train(base, model.args, v, train_set, evals, draft_ids, args)
             for v in filter(None, args.variants.split(","))]
    for job in jobs:
        line = json.dumps({**summary, **job()})
        print(line, flush=True)
        with open(work / "results.jsonl", "a") as f:
            f.write(line + "\n")


def _as_sequences(sequences: list[dict]):
    return Sequences(
        np.array([s["index"] for s in sequences]), np.array([s["P"] for s in sequences]),
        np.array([len(s["tokens"]) for s in sequences]), np.concatenate([s["tokens"] for s in sequences]).astype(np.int64),
    )


if __name__ == "__main__":
    main()
