"""`redrafter-mlx serve` for agents and apps, as a real server process on
loopback driven by the `openai` and `anthropic` client packages: tool calls
(the scripted tool model of conftest), the Messages API, the API key,
metrics, context-limit errors and bad bodies."""

import json
import re
import signal
import threading
import time

import httpx
import pytest
from conftest import start_server, stop_server

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
KEY = "test-key-123"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SERVE = ["--drafter", "none", "--max-tokens", 32]


@pytest.fixture(scope="module")
def server(tool_model):
    process, url, _ = start_server("--model", tool_model, *SERVE, "--max-nodes", 8, "--api-key", KEY)
    yield url
    stop_server(process)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=60)


def test_a_tool_call_round_trip_through_the_openai_api(client):
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    history = ASK + [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model="m", messages=history, tools=TOOLS)
    assert second.choices[0].message.content == "It is sunny." and second.choices[0].finish_reason == "stop"
    assert not second.choices[0].message.tool_calls


def test_streamed_tool_calls_join_into_the_whole_ones_and_never_leak_into_content(client):
    whole = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS).choices[0].message.tool_calls
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += (part.function.name or "") if part.function else ""
            call["arguments"] += (part.function.arguments or "") if part.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [(w.function.name, json.loads(w.function.arguments)) for w in whole]
    assert all(c["id"] for c in calls.values())


def test_tool_choice_none_required_and_named(client):
    answered = ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    auto = client.chat.completions.create(model="m", messages=answered, tools=TOOLS).choices[0]
    assert auto.message.content == "It is sunny."
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = client.chat.completions.create(model="m", messages=answered, tools=TOOLS, tool_choice=choice).choices[0]
        assert forced.finish_reason == "tool_calls" and forced.message.tool_calls[0].function.name == "get_weather", choice
    none = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none").choices[0]
    assert not none.message.tool_calls and "tool_call" in none.message.content  # no tools: the text is the answer
    with pytest.raises(openai.BadRequestError, match="not among 'tools'"):
        client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "other"}})


def test_a_tool_call_round_trip_through_the_anthropic_api(claude):
    tools = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    first = claude.messages.create(model="m", max_tokens=32, messages=ask, tools=tools)
    assert first.stop_reason == "tool_use" and first.role == "assistant"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    history = ask + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    second = claude.messages.create(model="m", max_tokens=32, messages=history, tools=tools, system="Be brief.")
    assert second.stop_reason == "end_turn" and second.content[0].type == "text" and second.content[0].text == "It is sunny."
    with claude.messages.stream(model="m", max_tokens=32, messages=ask, tools=tools) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_start" in kinds
    assert final.stop_reason == "tool_use" and [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Paris"}]
    with claude.messages.stream(model="m", max_tokens=32, messages=history, tools=tools) as stream:
        assert "".join(stream.text_stream) == "It is sunny."
    count = claude.messages.count_tokens(model="m", messages=ask, tools=tools)
    assert count.input_tokens > 5


def test_stop_sequences_and_max_tokens_in_the_anthropic_api(claude):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    stopped = claude.messages.create(model="m", max_tokens=32, messages=history, stop_sequences=["sunny"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "sunny" and stopped.content[0].text == "It is "
    short = claude.messages.create(model="m", max_tokens=1, messages=history)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 1


def test_the_api_key_is_needed_everywhere_but_health(server):
    assert httpx.get(f"{server}/health").status_code == 200
    body = {"model": "m", "messages": ASK, "max_tokens": 4}
    assert httpx.post(f"{server}/v1/chat/completions", json=body).status_code == 401
    wrong = httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": "nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server}/metrics").status_code == 401
    assert httpx.post(f"{server}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": KEY}).status_code == 200


def metrics(server) -> dict:
    """The metrics page parsed: 'name{labels}' -> value; every line a comment or a sample."""
    values = {}
    for line in httpx.get(f"{server}/metrics", headers={"x-api-key": KEY}).text.splitlines():
        if line.startswith("#"):
            assert re.match(r"# (HELP|TYPE) redrafter_\w+ ", line), line
            continue
        match = re.fullmatch(r"(redrafter_\w+(?:\{[^}]*\})?) (-?[0-9.e+-]+)", line)
        assert match, line
        values[match.group(1)] = float(match.group(2))
    return values


def test_metrics_parse_as_prometheus_text_and_move_as_requests_run(server, client):
    before = metrics(server)
    client.chat.completions.create(model="m", messages=ASK, max_tokens=8)
    after = metrics(server)
    for name in ("redrafter_completion_tokens_total", "redrafter_prompt_tokens_total", "redrafter_verification_steps_total", "redrafter_step_tokens_total"):
        assert after[name] > before[name], name
    key = 'redrafter_requests_total{endpoint="/v1/chat/completions",status="200"}'
    assert after[key] == before.get(key, 0) + 1
    assert {"redrafter_requests_running", "redrafter_requests_waiting", "redrafter_prompt_cache_bytes"} <= set(after)


def test_a_prompt_over_the_context_is_refused_as_agent_clients_expect(server, client, claude):
    long = [{"role": "user", "content": " ".join(["Weather"] * 300)}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="m", messages=long)
    assert error.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as error:
        claude.messages.create(model="m", max_tokens=8, messages=long)
    body = error.value.body["error"]
    assert body["type"] == "invalid_request_error" and re.fullmatch(r"prompt is too long: \d+ tokens > 256 maximum", body["message"])


# Named ids: a test's id goes into the environment of the processes it
# starts (PYTEST_CURRENT_TEST), and the nested body's would not fit there.
@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', b'{"a": ' * 100000 + b"1" + b"}" * 100000],
                         ids=["unpaired-surrogate", "nested-100000-deep"])
def test_held_out_bad_bodies_get_400(server, raw):
    for path in ("/v1/chat/completions", "/v1/messages"):
        response = httpx.post(f"{server}{path}", content=raw, headers={"x-api-key": KEY, "content-type": "application/json"})
        assert response.status_code == 400, (path, response.text)
        assert "error" in response.json()


@pytest.fixture(scope="module")
def queued(tool_model):
    """One request decoded at a time, one may wait, plain decoding (slow
    enough to queue behind), keep-alive comments every 0.2 s, and a second
    to finish on SIGTERM."""
    process, url, _ = start_server(
        "--model", tool_model, *SERVE, "--max-nodes", 0, "--max-batch", 1, "--max-queue", 1, "--keep-alive", 0.2, "--shutdown-timeout", 1)
    yield process, url
    stop_server(process)


def long_request(url: str, results: list, stream: bool = False, max_tokens: int = 4000) -> None:
    body = {"model": "m", "prompt": "loop", "max_tokens": max_tokens, "stream": stream}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        results.append((response.status_code, [line for line in response.iter_lines() if line]))


def test_a_full_queue_answers_429_and_a_waiting_stream_is_kept_alive(queued):
    _, url = queued
    first, second = [], []
    running = threading.Thread(target=long_request, args=(url, first))
    running.start()
    time.sleep(0.5)
    waiting = threading.Thread(target=long_request, args=(url, second, True, 4))
    waiting.start()
    time.sleep(1.0)
    full = httpx.post(f"{url}/v1/completions", json={"prompt": "loop", "max_tokens": 4})
    assert full.status_code == 429 and full.headers["retry-after"] == "1" and full.json()["error"]["type"] == "rate_limit_error"
    running.join(120)
    waiting.join(120)
    assert first[0][0] == 200
    status, lines = second[0]
    assert status == 200 and lines[0] == ": keep-alive"  # comments while it waited
    assert lines[-1] == "data: [DONE]"


def test_sigterm_finishes_running_streams_with_a_final_event_and_exits_0(queued):
    process, url = queued
    results = []
    streaming = threading.Thread(target=long_request, args=(url, results, True, 100000))
    streaming.start()
    time.sleep(1.0)
    process.send_signal(signal.SIGTERM)
    streaming.join(60)
    code = process.wait(60)
    assert code == 0, process.stderr.read()[-4000:]
    status, lines = results[0]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "length" and lines[-1] == "data: [DONE]"
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{url}/v1/completions", json={"prompt": "loop", "max_tokens": 4}, timeout=5)
