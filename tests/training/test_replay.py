"""Replayed greedy generation: the step counts of real generation, from
distilled data alone."""

import json

import numpy as np
import pytest

from conftest import OracleDrafter, tiny_model
from redrafter_mlx.drafting.datastore import Datastore
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.decoder import generate_steps
from redrafter_mlx.engine.sampling import SamplingSettings
from redrafter_mlx.engine.types import ReDrafter
from redrafter_mlx.errors import UserError
from redrafter_mlx.training.data import build_positions, cached_positions, compute_hidden_cache
from redrafter_mlx.training.distill import DataFolder, Sequences, distill, response_stream
from redrafter_mlx.training.replay import (
    accepted_lengths,
    count_steps,
    datastore_lengths,
    in_vocabulary_lengths,
    load_greedy_folder,
    lookup_depths,
    lookup_lengths,
    step_figures,
    tokens_per_step,
    with_continuation,
)

PROMPTS = [[5, 17, 42, 99, 3], [250, 7, 18], [1, 2, 3, 4, 5, 6, 7, 8, 9], [77, 66]]


def test_count_steps_by_hand():
    # 5 response tokens: the prefill makes the first; steps accepting 1 draft
    # add 2 tokens each (t = 0 -> 2 -> 4): 2 steps. Then 3 tokens, accepting 0.
    accepted = np.array([1, 9, 1, 9, 9, 0, 0, 0])
    assert count_steps(accepted, np.array([5, 3])) == 4
    assert tokens_per_step(accepted, np.array([5, 3])) == pytest.approx(6 / 4)
    assert count_steps(np.array([4, 4, 4]), np.array([3])) == 1  # the last step is cut by the end


def test_step_figures_with_and_without_lookup():
    accepted, counts = np.array([1, 9, 1, 9, 9, 0, 0, 0]), np.array([5, 3])
    assert step_figures("2x3", accepted, counts, None, 3) == {"2x3": 1.5}
    # Lookup right 3 deep at the first position and 2 deep at the second
    # sequence's first: one step for each sequence instead of two.
    lookup = np.array([3, 0, 0, 0, 0, 2, 0, 0])
    assert step_figures("2x3", accepted, counts, lookup, 3) == {"2x3": 1.5, "2x3+lookup": 3.0}
    # A continuation of 1 token keeps one of them: the first sequence still
    # takes two steps (4 + 2 tokens in 3 steps).
    assert step_figures("2x3", accepted, counts, lookup, 1) == {"2x3": 1.5, "2x3+lookup": 2.0}


def test_datastore_lengths_by_hand():
    # Prompt 9 9, answer 1 2 3 4: at t = 1 .. 4 the context ends at x[t+1]
    # (1, 2, 3, 4) and the drafts are checked against x[t+2] .. The store
    # holds 1 2 3 5 and 3 4. After "1" it drafts 2 3 (both right); after
    # "1 2", 3 5 (one); after "2 3", the longest suffix found, 5 (wrong,
    # though "3" alone was followed by 4); after the answer's end nothing is
    # there to agree with.
    sequences = Sequences(np.array([0, 1]), np.array([2, 1]), np.array([6, 2]), np.array([9, 9, 1, 2, 3, 4, 7, 7]))
    store = Datastore.from_sequences([[1, 2, 3, 5], [3, 4]], vocab_size=10)
    assert datastore_lengths(store, sequences, np.array([True, False]), 2, 1).tolist() == [2, 1, 0, 0]
    assert datastore_lengths(store, sequences, np.array([False, True]), 2, 1).tolist() == [0]


def test_in_vocabulary_lengths():
    windows = np.array([[9, 1, 2, 3], [1, 1, 5, 2], [2, 3, -1, -1], [1, 2, 3, 4]])
    lengths = in_vocabulary_lengths(windows, np.array([1, 2, 3, 9]), vocab_size=10)
    # x[t+1] (first column) is the base model's own token: never counted.
    np.testing.assert_array_equal(lengths, [3, 1, 1, 2])


@pytest.mark.parametrize("lookup", [False, True], ids=["rnn", "rnn+lookup"])
@pytest.mark.parametrize("shape", [(1, 3), (4, 5)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_replay_takes_as_many_steps_as_real_generation(tmp_path, shape, lookup):
    # Lookup drafts more tokens than the beams (as by default).
    width, length = shape
    base = BaseModel(tiny_model("llama", seed=5))
    folder = DataFolder(tmp_path / "data")
    distill(
        base,
        list,
        PROMPTS,
        folder,
        {"max_tokens": 30},
        response_stream(base, 30, SamplingSettings(), ()),
        batch_size=2,
        progress=False,
    )
    sequences = folder.load()
    # A drafter right up to a pseudo-random depth at each position.
    drafter = OracleDrafter(base, [sequences.sequence(i).tolist() for i in range(len(sequences))], corrupt=length)
    hidden = compute_hidden_cache(base, folder, sequences, progress=False)
    lookup_length = length + 2
    positions = build_positions(sequences, length - 1, eval_fraction=0)
    counts = cached_positions(sequences)
    accepted = accepted_lengths(drafter, base.embed, hidden[positions.hidden_row], positions.tokens, width)
    assert len(set(accepted.tolist())) > 2
    draft = DraftSettings.rnn_only(width, length)
    if lookup:
        lookup_depth = lookup_lengths(sequences, np.ones(len(sequences), bool), lookup_length)
        assert (lookup_depth > accepted).any()  # lookup adds something here
        assert (lookup_depth > length - 1).any() or length > 3  # at 1x3, past the beams' depth too
        accepted = with_continuation(accepted, lookup_depth, lookup_length)
        draft = DraftSettings(
            width, length, max_nodes=width * (length - 1) + lookup_length, lookup=True, lookup_length=lookup_length
        )  # every node verified

    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    redrafter = ReDrafter(base, drafter)
    for i in range(len(sequences)):
        prompt_length = int(sequences.prompt_lengths[i])
        sequence = sequences.sequence(i).tolist()
        tokens, steps = [], 0
        for step in generate_steps(redrafter, [sequence[:prompt_length]], max_tokens=int(counts[i]), draft=draft):
            tokens += step[0].tokens
            steps += step[0].num_accepted is not None
        assert tokens == sequence[prompt_length:]
        replayed = count_steps(accepted[starts[i] : starts[i] + counts[i]], counts[i : i + 1])
        assert replayed == steps, i


def test_a_sampled_folder_cannot_be_replayed(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"temp": 0.7}))
    with pytest.raises(UserError, match="holds sampled responses"):
        load_greedy_folder(str(tmp_path))


def test_lookup_depths_count_the_targets_context_lookup_drafts_right():
    sequence = [5, 1, 2, 3, 4, 1, 2, 3, 9, 1, 2]
    # Position t's step is rooted at x[t+1]; lookup continues the context
    # x[0] .. x[t+1] from the latest earlier occurrence of its longest
    # matching suffix. t = 4: "1" occurred at 1, so it drafts 2 3 4 against
    # 2 3 9; t = 5: "1 2" drafts 3 4 1 against 3 9 1; t = 8: "1" (at 5)
    # drafts 2 3 9 where only 2 is left.
    assert lookup_depths(sequence, first=1, count=9, depth=3).tolist() == [0, 0, 0, 2, 1, 0, 0, 1, 0]
