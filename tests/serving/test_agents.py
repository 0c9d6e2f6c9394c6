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
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
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
    assert (
        call.type == "function"
        and call.function.name == "get_weather"
        and json.loads(call.function.arguments) == {"city": "Paris"}
    )
    assert call.id.startswith("call_")
    history = ASK + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
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
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (w.function.name, json.loads(w.function.arguments)) for w in whole
    ]
    assert all(c["id"] for c in calls.values())


def test_tool_choice_none_required_and_named(client):
    answered = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    auto = client.chat.completions.create(model="m", messages=answered, tools=TOOLS).choices[0]
    assert auto.message.content == "It is sunny."
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = client.chat.completions.create(model="m", messages=answered, tools=TOOLS, tool_choice=choice).choices[
            0
        ]
        assert forced.finish_reason == "tool_calls" and forced.message.tool_calls[0].function.name == "get_weather", (
            choice
        )
    none = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none").choices[0]
    assert not none.message.tool_calls and "tool_call" in none.message.content  # no tools: the text is the answer
    with pytest.raises(openai.BadRequestError, match="not among 'tools'"):
        client.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "other"}}
        )


def test_a_tool_call_round_trip_through_the_anthropic_api(claude):
    tools = [
        {
            "name": "get_weather",
            "description": "The weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    first = claude.messages.create(model="m", max_tokens=32, messages=ask, tools=tools)
    assert first.stop_reason == "tool_use" and first.role == "assistant"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    history = ask + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    second = claude.messages.create(model="m", max_tokens=32, messages=history, tools=tools, system="Be brief.")
    assert (
        second.stop_reason == "end_turn"
        and second.content[0].type == "text"
        and second.content[0].text == "It is sunny."
    )
    with claude.messages.stream(model="m", max_tokens=32, messages=ask, tools=tools) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_start" in kinds
    assert final.stop_reason == "tool_use" and [b.input for b in final.content if b.type == "tool_use"] == [
        {"city": "Paris"}
    ]
    with claude.messages.stream(model="m", max_tokens=32, messages=history, tools=tools) as stream:
        assert "".join(stream.text_stream) == "It is sunny."
    count = claude.messages.count_tokens(model="m", messages=ask, tools=tools)
    assert count.input_tokens > 5


def test_stop_sequences_and_max_tokens_in_the_anthropic_api(claude):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    stopped = claude.messages.create(model="m", max_tokens=32, messages=history, stop_sequences=["sunny"])
    assert (
        stopped.stop_reason == "stop_sequence"
        and stopped.stop_sequence == "sunny"
        and stopped.content[0].text == "It is "
    )
    short = claude.messages.create(model="m", max_tokens=1, messages=history)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 1


def test_the_api_key_is_needed_everywhere_but_health(server):
    assert httpx.get(f"{server}/health").status_code == 200
    body = {"model": "m", "messages": ASK, "max_tokens": 4}
    assert httpx.post(f"{server}/v1/chat/completions", json=body).status_code == 401
    wrong = httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": "nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server}/metrics").status_code == 401
    assert (
        httpx.post(f"{server}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code
        == 200
    )
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
    for name in (
        "redrafter_completion_tokens_total",
        "redrafter_prompt_tokens_total",
        "redrafter_verification_steps_total",
        "redrafter_step_tokens_total",
    ):
        assert after[name] > before[name], name
    key = 'redrafter_requests_total{endpoint="/v1/chat/completions",status="200"}'
    assert after[key] == before.get(key, 0) + 1
    assert {"redrafter_requests_running", "redrafter_requests_waiting", "redrafter_prompt_cache_bytes"} <= set(after)
    assert 0 < after["redrafter_prefill_share"] <= 0.2  # the default share, lower only where clients left prefills


def test_a_prompt_over_the_context_is_refused_as_agent_clients_expect(server, client, claude):
    long = [{"role": "user", "content": " ".join(["Weather"] * 4200)}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="m", messages=long)
    assert error.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as error:
        claude.messages.create(model="m", max_tokens=8, messages=long)
    body = error.value.body["error"]
    assert body["type"] == "invalid_request_error" and re.fullmatch(
        r"prompt is too long: \d+ tokens > 4096 maximum", body["message"]
    )


# Named ids: a test's id goes into the environment of the processes it
# starts (PYTEST_CURRENT_TEST), and the nested body's would not fit there.
@pytest.mark.parametrize(
    "raw",
    [b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', b'{"a": ' * 100000 + b"1" + b"}" * 100000],
    ids=["unpaired-surrogate", "nested-100000-deep"],
)
def test_held_out_bad_bodies_get_400(server, raw):
    for path in ("/v1/chat/completions", "/v1/messages"):
        response = httpx.post(
            f"{server}{path}", content=raw, headers={"x-api-key": KEY, "content-type": "application/json"}
        )
        assert response.status_code == 400, (path, response.text)
        assert "error" in response.json()


@pytest.fixture(scope="module")
def queued(tool_model):
    """One request decoded at a time, one may wait, plain decoding (slow
    enough to queue behind), keep-alive comments every 0.2 s, and a second
    to finish on SIGTERM."""
    process, url, _ = start_server(
        "--model",
        tool_model,
        *SERVE,
        "--max-nodes",
        0,
        "--max-batch",
        1,
        "--max-queue",
        1,
        "--keep-alive",
        0.2,
        "--shutdown-timeout",
        1,
    )
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
    assert (
        full.status_code == 429
        and full.headers["retry-after"] == "1"
        and full.json()["error"]["type"] == "rate_limit_error"
    )
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


# What the agents send, in shapes written here (their own instructions and
# schemas are theirs): Claude Code's beta Messages requests, Codex's
# Responses requests, and each one's next request after a tool call.
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CODING_AGENT = {
    "model": "any",
    "max_tokens": 32000,
    "stream": True,
    "system": [
        {"type": "text", "text": "You are a coding agent."},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Use tools when they help.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "Weather in Paris?"}],
        },
        {
            "role": "system",
            "content": [{"type": "text", "text": "Environment: a folder.", "cache_control": {"type": "ephemeral"}}],
        },
    ],
    "tools": [
        {"name": "get_weather", "description": "The weather in a city.", "input_schema": SCHEMA},
        {"name": "Deferred", "description": "Loaded later.", "input_schema": {"type": "object"}, "defer_loading": True},
    ],
    "metadata": {"user_id": '{"session_id": "s1"}'},
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
}


def sse(response) -> list:
    """The (event, data) pairs of a server-sent event stream."""
    events, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            events.append((kind, json.loads(line[6:])))
    return events


def streamed(server, path: str, body: dict, **headers) -> tuple:
    with httpx.stream(
        "POST", f"{server}{path}", json=body, timeout=60, headers={"x-api-key": KEY, **headers}
    ) as response:
        assert response.status_code == 200, response.read()
        return response.headers, sse(response)


def test_a_claude_code_turn_and_its_tool_round_trip(server):
    headers, events = streamed(
        server,
        "/v1/messages?beta=true",
        CODING_AGENT,
        **{"anthropic-beta": "claude-code-20250219", "anthropic-version": "2023-06-01"},
    )
    assert headers["request-id"].startswith("req_")
    assert [k for k, _ in events][0] == "message_start" and events[-1][0] == "message_stop"
    (use,) = [
        d["content_block"] for k, d in events if k == "content_block_start" and d["content_block"]["type"] == "tool_use"
    ]
    arguments = "".join(
        d["delta"]["partial_json"]
        for k, d in events
        if k == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    )
    assert use["name"] == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    stop = next(d for k, d in events if k == "message_delta")
    assert stop["delta"]["stop_reason"] == "tool_use"
    # The next request: the call and its result (two calls answered in parallel), the same conversation before them.
    calls = [
        {"type": "tool_use", "id": use["id"], "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Lyon"}},
    ]
    results = [
        {"type": "tool_result", "tool_use_id": use["id"], "content": [{"type": "text", "text": "sunny"}]},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "rain", "is_error": False},
    ]
    following = dict(
        CODING_AGENT,
        messages=CODING_AGENT["messages"]
        + [
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": "x"}, *calls]},
            {"role": "user", "content": results},
        ],
    )
    _, events = streamed(server, "/v1/messages?beta=true", following)
    text = "".join(
        d["delta"]["text"] for k, d in events if k == "content_block_delta" and d["delta"]["type"] == "text_delta"
    )
    usage = next(d for k, d in events if k == "message_delta")["usage"]
    assert (
        text == "It is sunny." and usage["cache_read_input_tokens"] > 0
    )  # the first turn's prefix came from the prompt cache
    counted = httpx.post(
        f"{server}/v1/messages/count_tokens?beta=true", json=following, headers={"x-api-key": KEY}
    ).json()
    assert counted["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]


def test_a_second_session_of_an_agent_starts_from_the_instructions_the_first_left_in_the_cache(server):
    """Another session: the same instructions and tools, another question.
    Its prompt shares their tokens with the first session's, which the
    prompt cache holds: only the rest is prefilled."""
    first = dict(CODING_AGENT, stream=False, messages=[{"role": "user", "content": "Weather in Paris?"}])
    other = dict(first, messages=[{"role": "user", "content": "Weather in Paris? in Paris?"}])
    httpx.post(f"{server}/v1/messages", json=first, headers={"x-api-key": KEY}, timeout=60)
    usage = httpx.post(f"{server}/v1/messages", json=other, headers={"x-api-key": KEY}, timeout=60).json()["usage"]
    shared = httpx.post(
        f"{server}/v1/messages/count_tokens",
        json=dict(first, messages=[{"role": "user", "content": ""}]),
        headers={"x-api-key": KEY},
    ).json()["input_tokens"]
    assert (
        usage["cache_read_input_tokens"] >= shared - 4 > 0
    )  # the instructions and tools, up to where the question begins


def test_what_claude_code_calls_besides_messages(server):
    assert httpx.head(f"{server}/api/hello").status_code == 200  # its connectivity check, before any key
    models = httpx.get(f"{server}/v1/models", headers={"x-api-key": KEY}).json()
    (model,) = models["data"]
    assert (
        model["type"] == model["object"] == "model" and model["display_name"] and models["has_more"] is False
    )  # both APIs' shapes
    assert httpx.get(f"{server}/v1/models/any", headers={"x-api-key": KEY}).json()["id"] == "any"


@pytest.mark.parametrize(
    "change,message",
    [
        ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "structured output"),
        ({"thinking": {"type": "sometimes"}}, "'thinking'"),
        (
            {
                "context_management": {
                    "edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100}}]
                }
            },
            "clear_tool_uses",
        ),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919", "trigger": 5}]}}, "trigger"),
        (
            {
                "context_management": {
                    "edits": [{"type": "clear_thinking_20251015", "trigger": {"type": "input_tokens", "value": "x"}}]
                }
            },
            "trigger",
        ),
        ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "mcp_servers"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "text only"),
    ],
    ids=["format", "thinking", "clearing", "trigger", "trigger-value", "mcp", "image"],
)
def test_what_would_change_the_answer_unseen_is_refused_in_anthropics_shape(server, change, message):
    response = httpx.post(
        f"{server}/v1/messages?beta=true", json=dict(CODING_AGENT, stream=False, **change), headers={"x-api-key": KEY}
    )
    assert (
        response.status_code == 400
        and response.json()["type"] == "error"
        and message in response.json()["error"]["message"]
    )


CODEX = {
    "model": "any",
    "stream": True,
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "store": False,
    "reasoning": {"summary": "auto"},
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "thread-1",
    "client_metadata": {"thread_id": "thread-1"},
    "input": [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are a coding agent."}],
        },
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Skills: none."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    ],
    "tools": [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": SCHEMA,
            "strict": False,
        },
        {
            "type": "namespace",
            "name": "agents",
            "description": "Sub-agents.",
            "tools": [
                {
                    "type": "function",
                    "name": "spawn",
                    "description": "Start one.",
                    "parameters": {"type": "object", "properties": {}},
                    "strict": False,
                }
            ],
        },
        {"type": "web_search", "external_web_access": False},
    ],
}


def test_a_codex_turn_and_its_tool_round_trip(server):
    _, events = streamed(server, "/v1/responses", CODEX)
    done = events[-1][1]["response"]
    (call,) = [item for item in done["output"] if item["type"] == "function_call"]
    assert (
        call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"} and "namespace" not in call
    )
    assert done["redrafter"]["tools_left_out"] == ["web_search"]  # the hosted tool, left out of the prompt
    following = dict(
        CODEX,
        input=CODEX["input"]
        + [
            {"type": "reasoning", "summary": [], "encrypted_content": None},
            dict(call, status="completed"),
            {"type": "function_call", "call_id": "c2", "name": "spawn", "namespace": "agents", "arguments": "{}"},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "started"}]},
        ],
    )
    _, events = streamed(server, "/v1/responses", following)
    done = events[-1][1]["response"]
    assert done["output"][0]["content"][0]["text"] == "It is sunny."
    assert (
        done["usage"]["input_tokens_details"]["cached_tokens"] > 0
    )  # the first turn's prefix came from the prompt cache
    counted = httpx.post(f"{server}/v1/responses/input_tokens", json=following, headers={"x-api-key": KEY}).json()
    assert counted["input_tokens"] == done["usage"]["input_tokens"]


@pytest.fixture(scope="module")
def generic_tool_servers(tool_model, tmp_path_factory):
    """The tool model with a chat template that has no tool syntax, and with
    no chat template at all (its vocabulary has ChatML's tokens)."""
    import shutil

    from mlx_lm.utils import load_tokenizer

    servers = []
    for name, template in (
        (
            "plain-template",
            "{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}",
        ),
        ("no-template", None),
    ):
        folder = tmp_path_factory.mktemp(name)
        shutil.copytree(tool_model, folder, dirs_exist_ok=True)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        if template:
            config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        tokenizer = load_tokenizer(folder)
        assert not tokenizer.has_tool_calling and tokenizer.has_chat_template == bool(template)
        process, url, _ = start_server("--model", folder, *SERVE)
        servers.append((process, url))
    yield [url for _, url in servers]
    for process, _ in servers:
        stop_server(process)


def test_a_model_without_tool_syntax_is_offered_tools_and_calls_them_in_the_generic_one(generic_tool_servers):
    for url in generic_tool_servers:
        body = dict(CODING_AGENT, stream=False)
        answer = httpx.post(f"{url}/v1/messages", json=body, timeout=60).json()
        assert answer["stop_reason"] == "tool_use", (url, answer)
        assert [(b["name"], b["input"]) for b in answer["content"] if b["type"] == "tool_use"] == [
            ("get_weather", {"city": "Paris"})
        ]
