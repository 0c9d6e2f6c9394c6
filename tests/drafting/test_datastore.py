"""Datastore drafting: what the model most often wrote after the context's
last tokens, against a brute-force count; files; greedy parity in generation."""

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from conftest import tiny_drafter, tiny_model
from redrafter_mlx.drafting import datastore as datastore_module
from redrafter_mlx.drafting.datastore import Datastore, load_datastore
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.drafting.speculator import Speculator
from redrafter_mlx.engine.autoregressive import autoregressive_steps
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.decoder import generate_steps
from redrafter_mlx.engine.sampling import SamplingSettings, make_chooser
from redrafter_mlx.engine.types import ReDrafter
from redrafter_mlx.errors import UserError
from redrafter_mlx.training.distill import Sequences


def brute_force(sequences, context, length, beams, max_ngram):
    """The datastore's proposals, counted directly over every occurrence."""
    for n in range(min(max_ngram, len(context)), 0, -1):
        suffix = list(context[-n:])
        spans = []
        for seq in sequences:
            for end in range(n - 1, len(seq) - 1):  # an occurrence with a token after it
                if list(seq[end - n + 1 : end + 1]) == suffix:
                    spans.append(list(seq[end + 1 : end + 1 + length]))
        if not spans:
            continue
        firsts = Counter(span[0] for span in spans)
        proposals = []
        for first, count in sorted(firsts.items(), key=lambda kv: (-kv[1], kv[0]))[:beams]:
            rows = [s for s in spans if s[0] == first]
            tokens, freqs = [first], [count / (len(spans) + 1)]
            for depth in range(1, length):
                column = Counter(r[depth] for r in rows if len(r) > depth)
                if not column:
                    break
                best, best_count = sorted(column.items(), key=lambda kv: (-kv[1], kv[0]))[0]
                tokens.append(best)
                freqs.append(best_count / (len(rows) + 1))
                rows = [r for r in rows if len(r) > depth and r[depth] == best]
            proposals.append((tokens, freqs, n))
        return proposals
    return []


def test_proposals_are_the_most_frequent_continuations_of_the_longest_suffix_found():
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 5, size=rng.integers(1, 40)).tolist() for _ in range(30)]
    store = Datastore.from_sequences(sequences, vocab_size=5)
    for _ in range(200):
        context = rng.integers(0, 6, size=rng.integers(1, 7)).tolist()  # 5 is never seen
        length, beams = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        got = store.propose(context, length, beams)
        want = brute_force(sequences, context, length, beams, store.max_ngram)
        assert [(t, n) for t, _, n in got] == [(t, n) for t, _, n in want], context
        for (_, f, _), (_, g, _) in zip(got, want):
            assert np.allclose(f, g)


def test_nothing_is_matched_or_continued_across_answers():
    store = Datastore.from_sequences([[1, 2, 3], [4, 5]], vocab_size=8)
    assert store.propose([3, 4], 4) == [([5], [0.5], 1)]  # "3 4" never occurs in one answer
    assert store.propose([1, 2], 4) == [([3], [0.5], 2)]  # stops at the answer's end
    assert store.propose([5], 4) == []  # nothing ever followed 5
    assert store.propose([7], 4) == []


def test_a_wide_vocabulary_matches_shorter_suffixes():
    assert Datastore.from_sequences([[1, 2]], vocab_size=49152).max_ngram == 4
    assert Datastore.from_sequences([[1, 2]], vocab_size=262144).max_ngram == 3
    assert Datastore.from_sequences([[1, 2]], vocab_size=1000).max_ngram == 4


@pytest.mark.parametrize("vocab_size", [300, 70000])
def test_saved_and_loaded_alike(tmp_path, vocab_size):
    store = Datastore.from_sequences([[1, 2, 3, 299], [299, 2]], vocab_size)
    path = store.save(tmp_path)
    assert np.load(path).dtype == (np.uint16 if vocab_size < 65535 else np.int32)
    loaded = load_datastore(tmp_path, vocab_size)
    assert loaded.tokens.tolist() == store.tokens.tolist() == [1, 2, 3, 299, -1, 299, 2, -1]
    assert loaded.propose([299], 3) == store.propose([299], 3) == [([2], [0.5], 1)]


def test_bad_files_and_failed_writes(tmp_path, monkeypatch):
    assert load_datastore(tmp_path, 100) is None
    Datastore.from_sequences([[1, 2, 299]], 300).save(tmp_path)
    with pytest.raises(UserError, match="another model"):
        load_datastore(tmp_path, 100)  # token 299 is outside a 100-token vocabulary
    before = (tmp_path / "datastore.npy").read_bytes()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(datastore_module.np, "save", full_disk)
    with pytest.raises(UserError, match="nothing was changed"):
        Datastore.from_sequences([[4, 5]], 300).save(tmp_path)
    assert (tmp_path / "datastore.npy").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["datastore.npy"]
    (tmp_path / "datastore.npy").write_bytes(b"not a numpy file")
    with pytest.raises(UserError, match="cannot read the datastore"):
        load_datastore(tmp_path, 300)


def test_answers_only_and_only_those_kept():
    sequences = Sequences(np.array([0, 1]), np.array([2, 1]), np.array([4, 3]), np.array([9, 9, 1, 2, 8, 3, 4]))
    store = Datastore.from_answers(sequences, np.array([True, True]), 10)
    assert store.tokens.tolist() == [1, 2, -1, 3, 4, -1]
    assert Datastore.from_answers(sequences, np.array([False, True]), 10).tokens.tolist() == [3, 4, -1]


def test_datastore_drafts_join_the_tree_and_are_judged_as_their_own_source():
    store = Datastore.from_sequences([[7, 8, 9], [7, 8, 9], [7, 8, 1]], vocab_size=16)
    speculator = Speculator(DraftSettings(max_nodes=8, lookup=False, datastore_beams=1), False, datastore=store)
    speculator.track(0, [3, 7])
    (tree,) = speculator.trees([0], [7], None, None)
    assert tree.tokens == [7, 8, 9]
    # 7 was followed by 8 three times (3 / 4, counting one unseen), then by 9 twice (2 / 4)
    assert tree.judged[1] == [(("datastore1", 1, "greedy"), 0.75)] and tree.judged[2] == [
        (("datastore1", 2, "greedy"), 0.5)
    ]
    off = Speculator(DraftSettings(max_nodes=8, lookup=False, datastore_beams=0), False, datastore=store)
    off.track(0, [3, 7])
    assert off.trees([0], [7], None, None)[0].tokens == [7]


def test_greedy_generation_with_a_datastore_is_plain_greedy_decoding():
    """A datastore that holds the model's greedy answer (so many of its
    drafts are right) and one that holds another prompt's: either way the
    output is the model's own."""
    base = BaseModel(tiny_model("llama", seed=3))
    prompt, other = [5, 17, 42, 99, 3, 250, 7, 18], [5, 17, 42, 99, 3, 250, 7, 19]

    def reference(p, n):
        return [int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(p), base.model, max_tokens=n)), range(n))]

    want = reference(prompt, 64)
    runs = [
        ReDrafter(base, tiny_drafter(seed=0), datastore=Datastore.from_sequences(answers, base.vocab_size))
        for answers in ([want], [reference(other, 80)])
    ]
    for redrafter in runs:
        tokens = []
        for step in generate_steps(
            redrafter, [prompt], max_tokens=64, draft=DraftSettings(beam_width=2, beam_length=4, lookup=False)
        ):
            tokens += step[0].tokens
        assert tokens == want
    assert (
        sum(v for (source, *_), v in runs[0].acceptance.accepted.items() if source.startswith("datastore")) > 0
    )  # its drafts were verified and accepted


def test_seeded_sampling_with_a_datastore_equals_plain_sampling():
    """Sampled output is the base model's own with or without datastore
    drafts: a batch whose datastore holds the plain samples themselves (so
    its drafts are often right, and accepted) draws exactly the tokens plain
    decoding draws with the same seed."""
    base = BaseModel(tiny_model("llama", seed=12))
    prompts = [[5, 17, 42, 99, 3], [9, 8], [100, 101, 102, 1, 2, 3, 4]]
    choose = make_chooser(SamplingSettings(temp=0.8, top_k=5, seed=123))
    plain = [[] for _ in prompts]
    for step in autoregressive_steps(base, prompts, max_tokens=40, choose=choose):
        for out in step:
            plain[out.row] += out.tokens
    redrafter = ReDrafter(base, tiny_drafter(seed=1), datastore=Datastore.from_sequences(plain, base.vocab_size))
    got = [[] for _ in prompts]
    for step in generate_steps(
        redrafter, prompts, max_tokens=40, draft=DraftSettings(beam_width=2, beam_length=4, lookup=False), choose=choose
    ):
        for out in step:
            got[out.row] += out.tokens
    assert got == plain
    assert sum(v for (source, *_), v in redrafter.acceptance.accepted.items() if source.startswith("datastore")) > 0


def test_a_required_datastore_that_is_missing_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="has no datastore"):
        load_datastore(tmp_path, 100, required=True)
