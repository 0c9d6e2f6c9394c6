"""What each step drafts: the settings shared by the Python API, the command
line and the server."""

from dataclasses import dataclass
from typing import Optional

from ..errors import UserError

LOOKUP_LENGTH = 16  # a copy that is right tends to stay right, so lookup drafts further than the beams
# Rows of a frequency-sorted draft vocabulary the beams' later tokens come
# from, and their first: the vocabulary projection is the search's costliest
# op, and these cut it at no measured cost in tokens per step
# (bench/results/drafter/draft-vocab.md).
LATER_VOCAB = 1024
FIRST_VOCAB = 2048


@dataclass
class DraftSettings:
    """beam_width, beam_length: the RNN's beam search (beam_length counts the
    root, so beam_length - 1 drafted tokens; the datastore drafts as many).
    max_nodes: drafted nodes verified per step; None chooses it each step
    from the cost curve. lookup: propose a context-lookup continuation;
    lookup_length: tokens it drafts; lookup_max_ngram: longest context
    suffix matched. datastore_beams: continuations proposed per step from
    the drafter's datastore, when it has one (0: none). later_vocab: the RNN
    drafts its tokens after the first from this many most frequent rows of
    its draft vocabulary (only a drafter whose rows are sorted so; None: all
    rows); first_vocab: and its first token from this many. partial_beams:
    the tree also takes the partial beams the search held at each shorter
    length. Checked when made (``UserError``)."""

    beam_width: int = 4
    beam_length: int = 5
    max_nodes: Optional[int] = None
    lookup: bool = True
    lookup_length: int = LOOKUP_LENGTH
    lookup_max_ngram: int = 3
    datastore_beams: int = 2
    later_vocab: Optional[int] = LATER_VOCAB
    partial_beams: bool = True
    first_vocab: Optional[int] = FIRST_VOCAB

    def __post_init__(self):
        minimums = dict(
            beam_width=1,
            beam_length=2,
            max_nodes=0,
            lookup_length=1,
            lookup_max_ngram=1,
            datastore_beams=0,
            later_vocab=1,
            first_vocab=1,
        )
        for name, low in minimums.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise UserError(f"{name.replace('_', ' ')} must be at least {low}, got {value}")

    @classmethod
    def rnn_only(cls, beam_width: int, beam_length: int) -> "DraftSettings":
        """The RNN's final beams alone, every node verified (the paper's method)."""
        return cls(
            beam_width,
            beam_length,
            max_nodes=beam_width * (beam_length - 1),
            lookup=False,
            datastore_beams=0,
            later_vocab=None,
            partial_beams=False,
            first_vocab=None,
        )

    def search_shape(self, drafter) -> tuple:
        """``beam_search``'s (beam_width, beam_length, later_rows, partial,
        first_rows) for this drafter."""
        if not getattr(drafter, "sorted_draft_vocab", False):
            return self.beam_width, self.beam_length, None, self.partial_beams, None
        return self.beam_width, self.beam_length, self.later_vocab, self.partial_beams, self.first_vocab
