"""The server's counters, in the Prometheus text format (``GET /metrics``).

Counters are added to from the HTTP handlers and from the engine thread;
gauges (requests running and waiting, the prompt cache's size) are read
when the page is made.
"""

import threading
from collections import defaultdict
from typing import Callable

PREFIX = "redrafter"

COUNTERS = {
    "requests_total": "Requests answered, by endpoint and HTTP status.",
    "prompt_tokens_total": "Prompt tokens of the requests admitted.",
    "completion_tokens_total": "Tokens generated.",
    "verification_steps_total": "Verification steps, counted per request in a step.",
    "step_tokens_total": "Tokens those steps produced (accepted drafts and the bonus token); over the steps, tokens per step.",
    "prompt_cache_hits_total": "Requests that started from a stored prompt cache.",
    "prompt_cache_tokens_total": "Prompt tokens taken from stored prompt caches.",
    "errors_total": "Requests that failed inside the engine.",
    "rejected_total": "Requests turned away, by reason (queue full, shutting down, too many connections).",
}
GAUGES = {
    "requests_running": "Requests being decoded.",
    "requests_waiting": "Requests waiting for a place in the batch.",
    "prompt_cache_bytes": "Bytes of keys and values in the prompt-cache store.",
    "connections_open": "HTTP connections open, idle ones included.",
    "prefill_share": "The part of the engine a long prefill may take beside running requests now "
    "(lower where clients leave before theirs end).",
}


class Metrics:
    """``add(name, value, **labels)``; ``text(gauges)`` is the page, with the
    gauges' current values from ``gauges()`` (a name -> value mapping)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.values: dict = defaultdict(float)

    def add(self, name: str, value: float = 1.0, **labels) -> None:
        assert name in COUNTERS, name
        key = (name, tuple(sorted(labels.items())))
        with self.lock:
            self.values[key] += value

    def text(self, gauges: Callable[[], dict]) -> str:
        with self.lock:
            values = dict(self.values)
        lines = []
        for name, help_text in COUNTERS.items():
            lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} counter"]
            rows = [(labels, v) for (n, labels), v in sorted(values.items()) if n == name] or [((), 0.0)]
            lines += [f"{PREFIX}_{name}{_labels(labels)} {_number(v)}" for labels, v in rows]
        current = gauges()
        for name, help_text in GAUGES.items():
            lines += [
                f"# HELP {PREFIX}_{name} {help_text}",
                f"# TYPE {PREFIX}_{name} gauge",
                f"{PREFIX}_{name} {_number(current.get(name, 0))}",
            ]
        return "\n".join(lines) + "\n"


def _labels(labels: tuple) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in labels)
    return "{" + ",".join(escaped) + "}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
