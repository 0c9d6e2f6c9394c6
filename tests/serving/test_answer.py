"""An answer's parts in the order the model wrote them, and its end: a
client's stop sequence is reported as such; the text that ends a plain
turn is the end of the turn."""

from types import SimpleNamespace

from redrafter_mlx.serving.answer import Answer, Part
from redrafter_mlx.serving.requests import Job
from redrafter_mlx.serving.scheduler import Request
from redrafter_mlx.serving.tools import GENERIC_TOOLS


def test_a_plain_turns_end_stops_the_answer_but_is_not_a_clients_stop_sequence():
    job = Job(Request([1, 2], 8), "messages", stops=["END"], turn_ends=["\nUser:"])
    answer = Answer(SimpleNamespace(detokenizer=None), job, None, None, GENERIC_TOOLS)
    assert sorted(answer.stops.stops) == ["\nUser:", "END"]
    answer._finish([Part()], "stop", "\nUser:")
    assert (answer.finish_reason, answer.stop_sequence) == ("stop", None)
    answer._finish([Part()], "stop", "END")
    assert answer.stop_sequence == "END"


def test_text_written_after_a_call_comes_after_it():
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}}]
    answer = Answer(
        SimpleNamespace(detokenizer=None), Job(Request([1], 8), "chat", tools=tools), None, None, GENERIC_TOOLS
    )
    parts = [Part()]
    call = '<tool_call>\n{"name": "read", "arguments": {}}\n</tool_call>'
    answer._show(parts, "Reading." + call + "Done." + call)  # one step's text: two calls, text between them
    answer._show(parts, "Then")
    answer._finish(parts, "stop", None)
    assert [(p.text, [c["name"] for c in p.calls]) for p in parts] == [
        ("Reading.", ["read"]),
        ("Done.", ["read"]),
        ("Then", []),
    ]
    assert answer.finish_reason == "tool_calls"
