"""Stop strings cut streamed text exactly, wherever the pieces split them."""

import itertools

from redrafter_mlx.serving.stop_strings import StopStrings

TEXT = "The answer is 42.\nUser: next question"


def shown(pieces, stops):
    cut = StopStrings(stops)
    out = "".join(cut.add(p) for p in pieces)
    return out + cut.flush(), cut.stopped


def test_every_split_of_the_text_gives_the_same_cut():
    for a, b in itertools.combinations(range(1, len(TEXT)), 2):
        pieces = [TEXT[:a], TEXT[a:b], TEXT[b:]]
        assert shown(pieces, ["\nUser:", "zzz"]) == ("The answer is 42.", True)
        assert shown(pieces, ["nothing"]) == (TEXT, False)


def test_the_earliest_stop_wins_and_nothing_after_it_is_shown():
    assert shown([TEXT], ["question", "answer"]) == ("The ", True)
    cut = StopStrings(["42"])
    assert cut.add("The answer is 4") == "The answer is "  # "4" may begin the stop
    assert cut.add("2 and more") == "" and cut.stopped
    assert cut.add("later text") == "" and cut.flush() == ""


def test_held_back_text_comes_out_when_it_is_not_a_stop():
    cut = StopStrings(["<end>"])
    assert cut.add("a <e") == "a "
    assert cut.add("nd") == ""
    assert cut.add("x") == "<endx"
    assert StopStrings([""]).add("text") == "text"  # an empty stop string is ignored
