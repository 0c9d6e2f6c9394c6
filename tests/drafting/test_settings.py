"""Drafting settings check their own values."""

import dataclasses

import pytest

from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.errors import UserError


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(max_nodes=-1), "max nodes must be at least 0"),
        (dict(lookup_max_ngram=0), "lookup max ngram"),
        (dict(lookup_length=0), "lookup length"),
        (dict(datastore_beams=-1), "datastore beams"),
        (dict(beam_width=0), "beam width"),
        (dict(beam_length=1), "beam length must be at least 2"),
        (dict(later_vocab=0), "later vocab"),
    ],
)
def test_bad_settings_are_refused_when_made(settings, message):
    with pytest.raises(UserError, match=message):
        DraftSettings(**settings)
    with pytest.raises(UserError, match=message):
        dataclasses.replace(DraftSettings(), **settings)


def test_defaults_and_the_papers_method():
    assert DraftSettings().max_nodes is None and DraftSettings(later_vocab=None).later_vocab is None
    paper = DraftSettings.rnn_only(4, 5)
    assert paper.max_nodes == 16 and not paper.lookup and paper.datastore_beams == 0 and not paper.partial_beams
