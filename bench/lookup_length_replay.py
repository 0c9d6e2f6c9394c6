"""How many tokens a context-lookup continuation should draft, replayed on
the greedy answers that the trainer holds out of the given data folders
(never dev): for each lookup length, lookup alone and the RNN's beams with
one lookup continuation in the same tree, every node verified
(``replay.step_figures``). With ``--datastore-lengths``, also the RNN's
beams with the drafter's datastore continuations of each length in the tree,
beside lookup's continuations of ``--lookup-length`` tokens (the datastore
leaves the held-out answers out). Only the held-out sequences' hidden states
are computed, so no folder needs its hidden-state cache.

    python3 bench/lookup_length_replay.py --drafter redrafter_mlx/drafters/smollm2-135m-instruct \\
        --data data/self-smollm2-135m,data/self-smollm2-135m-s1,data/self-smollm2-135m-s2,data/self-smollm2-135m-s3
"""

import argparse
import json

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)

import numpy as np

from redrafter_mlx.base_model import BaseModel
from redrafter_mlx.datastore import load_datastore
from redrafter_mlx.distill import DataFolder, Sequences
from redrafter_mlx.drafter import load_drafter
from redrafter_mlx.drafting import LOOKUP_LENGTH
from redrafter_mlx.errors import UserError
from redrafter_mlx.loading import load_base_model
from redrafter_mlx.replay import accepted_lengths, datastore_lengths, step_figures, tokens_per_step, with_continuation
from redrafter_mlx.train import TrainConfig, build_positions, cached_positions, held_out_sequences, response_hidden


def held_out(folder: DataFolder, eval_fraction: float) -> Sequences:
    """The folder's sequences the trainer holds out, in order."""
    sequences = folder.load()
    keep = np.flatnonzero(held_out_sequences(sequences.prompt_index, eval_fraction))
    return Sequences(
        sequences.prompt_index[keep], sequences.prompt_lengths[keep], sequences.lengths[keep],
        np.concatenate([sequences.sequence(int(i)) for i in keep]),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="The base model the data was distilled from (default: the embedded one).")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--data", required=True, help="Greedy distillation data folders, comma-separated.")
    parser.add_argument("--shapes", default="1x5,4x5")
    parser.add_argument("--lengths", default="4,6,8,10,12,16,24", help="Lookup lengths, comma-separated.")
    parser.add_argument("--datastore-lengths", default="", help="Datastore continuation lengths to replay, comma-separated (default: none).")
    parser.add_argument("--datastore-beams", type=int, default=2)
    parser.add_argument("--lookup-length", type=int, default=LOOKUP_LENGTH, help="The lookup continuation beside the datastore's.")
    parser.add_argument("--lookup-beams", type=int, default=1, help="Lookup continuations per step (the best one counts).")
    args = parser.parse_args()
    shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")]
    lengths = [int(n) for n in args.lengths.split(",") if n]
    stored_lengths = [int(n) for n in args.datastore_lengths.split(",") if n]
    if min(lengths + stored_lengths + [args.lookup_length, args.lookup_beams, args.datastore_beams]) < 1:
        parser.error("lengths and beams must be at least 1")

    base = BaseModel(load_base_model(args.model)[0])
    drafter = load_drafter(args.drafter)
    folders = [DataFolder(path) for path in args.data.split(",")]
    for folder in folders:
        folder.check_model(base.vocab_size, base.hidden_size)
        if (folder.meta or {}).get("temp", 0) != 0:
            raise UserError(f"{folder.path} holds sampled responses; the replay needs greedy ones")
    sequences = Sequences.concatenate([held_out(folder, TrainConfig().eval_fraction) for folder in folders])
    hidden = response_hidden(base, sequences.prompt_lengths, sequences.lengths, sequences.tokens)
    counts = cached_positions(sequences)
    positions = build_positions(sequences, max(length for _, length in shapes) - 1, 0.0)
    accepted = {
        (width, length): accepted_lengths(drafter, base.embed, hidden[positions.hidden_row], positions.tokens[:, :length], width)
        for width, length in shapes
    }
    result = {"drafter": args.drafter, "data": args.data, "sequences": len(sequences), "tokens": int(counts.sum())}
    result.update({f"{w}x{n}": round(tokens_per_step(a, counts), 3) for (w, n), a in accepted.items()})
    print(json.dumps(result), flush=True)
    for lookup_length in lengths:
        lookup = build_positions(sequences, 0, 0.0, lookup_length=lookup_length, lookup_beams=args.lookup_beams).lookup_depth
        result = {"lookup_length": lookup_length, "lookup_beams": args.lookup_beams, "lookup": round(tokens_per_step(lookup, counts), 3)}
        for (width, length), a in accepted.items():
            result.update(step_figures(f"{width}x{length}", a, counts, lookup, lookup_length))
        print(json.dumps(result), flush=True)
    if stored_lengths:
        replay_datastore(args, base, sequences, counts, accepted, stored_lengths)


def replay_datastore(args, base, sequences, counts, accepted, stored_lengths):
    """One line per datastore continuation length: the RNN's beams with the
    datastore's continuations, alone and beside a lookup continuation."""
    datastore = load_datastore(args.drafter, base.vocab_size, required=True)
    lookup = build_positions(sequences, 0, 0.0, lookup_length=args.lookup_length, lookup_beams=args.lookup_beams).lookup_depth
    everything = np.ones(len(sequences), bool)
    for stored_length in stored_lengths:
        stored = datastore_lengths(datastore, sequences, everything, stored_length, args.datastore_beams)
        result = {"datastore_length": stored_length, "lookup_length": args.lookup_length}
        result["datastore+lookup"] = round(tokens_per_step(with_continuation(stored, lookup, args.lookup_length), counts), 3)
        for (width, length), a in accepted.items():
            result.update(step_figures(f"{width}x{length}+datastore", with_continuation(a, stored, stored_length), counts, lookup, args.lookup_length))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
