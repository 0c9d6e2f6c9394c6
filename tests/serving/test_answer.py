"""An answer's end: a client's stop sequence is reported as such; the text
that ends a plain turn is the end of the turn."""

from types import SimpleNamespace

from redrafter_mlx.serving.answer import Answer, Part
from redrafter_mlx.serving.requests import Job
from redrafter_mlx.serving.scheduler import Request
from redrafter_mlx.serving.tools import GENERIC_TOOLS


def test_a_plain_turns_end_stops_the_answer_but_is_not_a_clients_stop_sequence():
    job = Job(Request([1, 2], 8), "messages", stops=["END"], turn_ends=["\nUser:"])
    answer = Answer(SimpleNamespace(detokenizer=None), job, None, None, GENERIC_TOOLS)
    assert sorted(answer.stops.stops) == ["\nUser:", "END"]
    answer._finish(Part(), "stop", "\nUser:")
    assert (answer.finish_reason, answer.stop_sequence) == ("stop", None)
    answer._finish(Part(), "stop", "END")
    assert answer.stop_sequence == "END"
