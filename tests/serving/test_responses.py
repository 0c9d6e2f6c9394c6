"""`POST /v1/responses`, the OpenAI Responses API, on a real server process
driven by the `openai` client package: text answers as the chat route
gives them, the event stream, function calls (the scripted tool model of
conftest) and their round trip, and the errors of a server that keeps no
responses."""

import json

import httpx
import pytest

from conftest import start_server, stop_server

openai = pytest.importorskip("openai")
from openai.types.responses import Response  # noqa: E402

KEY = "test-key-123"
BODY_LIMIT = 64 * 1024
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
ANSWERED = ASK + [CALL, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]


@pytest.fixture(scope="module")
def server(tool_model):
    """Plain decoding (one token a step): a streamed answer comes in many deltas."""
    process, url, _ = start_server(
        "--model",
        tool_model,
        "--drafter",
        "none",
        "--max-tokens",
        32,
        "--max-nodes",
        0,
        "--api-key",
        KEY,
        "--max-body-bytes",
        BODY_LIMIT,
    )
    yield url
    stop_server(process)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server, body, path="/v1/responses", key=KEY):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(server + path, content=content, headers=headers, timeout=60)


def events_of(client, **kwargs) -> list:
    return list(client.responses.create(model="m", stream=True, **kwargs))


def test_a_text_answer_equals_the_chat_routes_with_usage(server, client):
    chat = client.chat.completions.create(model="m", messages=ASK)
    response = client.responses.create(model="m", input=ASK)
    assert response.output_text == chat.choices[0].message.content and "tool_call" in response.output_text
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    (message,) = response.output
    assert (
        message.type == "message"
        and message.role == "assistant"
        and message.status == "completed"
        and message.id.startswith("msg_")
    )
    assert [(c.type, c.annotations) for c in message.content] == [("output_text", [])]
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert (
        usage.total_tokens == usage.input_tokens + usage.output_tokens
        and usage.output_tokens_details.reasoning_tokens == 0
    )
    assert usage.input_tokens_details.cached_tokens >= 0
    assert (
        response.store is False
        and response.previous_response_id is None
        and response.temperature == 1.0  # what OpenAI's API takes where none is sent
        and response.tools == []
    )
    assert response.model_extra["redrafter"]["steps"] >= 1
    # A plain string is one user message; the body passes the SDK's own model, checked.
    assert client.responses.create(model="m", input=ASK[0]["content"]).output_text == response.output_text
    Response.model_validate(post(server, {"model": "m", "input": ASK, "tools": TOOLS}).json())


def test_instructions_are_a_system_message_first(client):
    system = [{"role": "system", "content": "Be brief."}]
    chat = client.chat.completions.create(model="m", messages=system + ASK)
    response = client.responses.create(model="m", instructions="Be brief.", input=ASK)
    assert response.instructions == "Be brief." and response.output_text == chat.choices[0].message.content
    assert (
        response.usage.input_tokens
        == chat.usage.prompt_tokens
        > client.responses.create(model="m", input=ASK).usage.input_tokens
    )
    developer = client.responses.create(
        model="m", input=[{"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]}] + ASK
    )
    assert developer.usage.input_tokens == response.usage.input_tokens


def test_max_output_tokens_cuts_the_answer_as_incomplete(client):
    response = client.responses.create(model="m", input=ASK, max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (
        response.usage.output_tokens == 3
        and response.max_output_tokens == 3
        and response.output[0].status == "incomplete"
    )
    events = events_of(client, input=ASK, max_output_tokens=3)
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 3
    assert events[-1].response.output_text == response.output_text


def test_what_a_request_leaves_out_is_what_openais_api_takes_within_the_servers_bound(tool_model):
    """Codex names no temperature and no max_output_tokens: the answer is
    sampled at temperature 1 and runs to the context, cut only by
    ``--max-output-tokens``; the chat route keeps ``--max-tokens``."""
    process, url, _ = start_server(
        "--model", tool_model, "--drafter", "none", "--max-tokens", 2, "--max-output-tokens", 5
    )
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        response = client.responses.create(model="m", input=ASK)
        assert response.temperature == 1.0 and response.max_output_tokens is None
        assert response.status == "incomplete" and response.usage.output_tokens == 5
        asked = client.responses.create(model="m", input=ASK, max_output_tokens=50, temperature=0)
        assert asked.usage.output_tokens == 5 and asked.output_text == response.output_text
        assert client.responses.create(model="m", input=ASK, max_output_tokens=3).usage.output_tokens == 3
        chat = client.chat.completions.create(model="m", messages=ASK)
        assert chat.usage.completion_tokens == 2 and chat.choices[0].finish_reason == "length"
    finally:
        stop_server(process)


def test_a_streamed_answer_comes_in_the_responses_event_order(client):
    whole = client.responses.create(model="m", input=ASK)
    events = events_of(client, input=ASK)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert kinds == (
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        + ["response.output_text.delta"] * len(deltas)
        + ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert "".join(deltas) == events[-4].text == done.output_text == whole.output_text
    assert done.id == events[0].response.id and done.status == "completed" and done.output[0].id == events[2].item.id
    assert (done.usage.input_tokens, done.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    with client.responses.stream(model="m", input=ASK) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_every_streamed_event_passes_the_sdks_own_models_checked(server):
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    for extra in (
        {"max_output_tokens": 3, "include": ["message.output_text.logprobs"], "top_logprobs": 1},
        {"tools": TOOLS},
    ):
        body = {"model": "m", "input": ASK, "stream": True, **extra}
        with httpx.stream(
            "POST", server + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        ) as response:
            lines = [line for line in response.iter_lines() if line]
        names = [line[7:] for line in lines if line.startswith("event: ")]
        events = [
            TypeAdapter(ResponseStreamEvent).validate_json(line[6:]) for line in lines if line.startswith("data: ")
        ]
        assert names == [e.type for e in events] and names[-1] in ("response.incomplete", "response.completed")


def test_a_function_call_round_trip(client):
    first = client.responses.create(model="m", input=ASK, tools=TOOLS)
    (call,) = first.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    )
    assert (
        call.call_id.startswith("call_")
        and call.id.startswith("fc_")
        and call.status == "completed"
        and first.status == "completed"
    )
    assert [t.name for t in first.tools] == ["get_weather"] and first.tool_choice == "auto"
    history = ASK + [
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]
    second = client.responses.create(model="m", input=history, tools=TOOLS)
    assert second.output_text == "It is sunny." and [item.type for item in second.output] == ["message"]
    # The items render as the chat route renders the same conversation.
    chat_history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]
    chat = client.chat.completions.create(model="m", messages=chat_history, tools=CHAT_TOOLS)
    assert (
        chat.usage.prompt_tokens == second.usage.input_tokens and chat.choices[0].message.content == second.output_text
    )


def test_a_streamed_function_call_sends_its_arguments_as_deltas(client):
    events = events_of(client, input=ASK, tools=TOOLS)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == (
        ["response.created", "response.in_progress", "response.output_item.added"]
        + ["response.function_call_arguments.delta"] * len(deltas)
        + ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    )
    added, done = events[2].item, events[-2].item
    assert (
        added.type == "function_call"
        and added.name == "get_weather"
        and added.arguments == ""
        and added.status == "in_progress"
    )
    assert (
        json.loads("".join(deltas))
        == json.loads(events[-3].arguments)
        == json.loads(done.arguments)
        == {"city": "Paris"}
    )
    assert done.call_id == added.call_id and [item.call_id for item in events[-1].response.output] == [done.call_id]


def test_tool_choice_none_required_and_named(client):
    assert client.responses.create(model="m", input=ANSWERED, tools=TOOLS).output_text == "It is sunny."
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        forced = client.responses.create(model="m", input=ANSWERED, tools=TOOLS, tool_choice=choice)
        assert [(i.type, i.name) for i in forced.output] == [("function_call", "get_weather")], choice
    none = client.responses.create(model="m", input=ASK, tools=TOOLS, tool_choice="none")
    assert [i.type for i in none.output] == ["message"] and "tool_call" in none.output_text
    with pytest.raises(openai.BadRequestError, match="not among 'tools'"):
        client.responses.create(model="m", input=ASK, tools=TOOLS, tool_choice={"type": "function", "name": "other"})


def test_logprobs_come_with_the_text_when_included(client):
    response = client.responses.create(model="m", input=ASK, include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens and all(
        len(p.top_logprobs) == 2 and p.logprob <= 0 for p in logprobs
    )
    assert "".join(p.token for p in logprobs).replace(" ", "") == response.output_text.replace(" ", "")
    assert client.responses.create(model="m", input=ASK).output[0].content[0].logprobs == []


def test_a_server_that_keeps_nothing_says_so(client):
    with pytest.raises(openai.BadRequestError, match="keeps no responses") as error:
        client.responses.create(model="m", input=ASK, previous_response_id="resp_123")
    assert error.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model="m", input=ASK, background=True)
    assert client.responses.create(model="m", input=ASK, store=True, max_output_tokens=1).store is False


BAD_REQUESTS = [
    (b"{not json", 400, "not valid JSON", None),
    ({"model": "m"}, 400, "'input'", "input"),
    ({"input": []}, 400, "'input'", "input"),
    ({"input": [{"type": "bogus"}]}, 400, '"bogus", which this server does not take', "input"),
    ({"input": [{"role": "tool", "content": "w"}]}, 400, "'role'", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "text only", "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "'input[0].call_id'", "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, 400, "'output'", "input"),
    (
        {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "x", "namespace": 5}]},
        400,
        "'input[0].namespace'",
        "input",
    ),
    (
        {
            "input": "w",
            "tools": [{"type": "function", "name": "f"}],
            "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": "f"},
        },
        400,
        "'tool_choice.tools'",
        "tool_choice",
    ),
    ({"input": "w", "instructions": 5}, 400, "'instructions'", "instructions"),
    (
        {"input": "w", "tools": [{"type": "namespace", "name": "n", "tools": "f"}]},
        400,
        '\'tools[0]\' must be {"type": "namespace"',
        "tools",
    ),
    ({"input": "w", "tools": CHAT_TOOLS}, 400, "flat", "tools"),
    ({"input": "w", "tool_choice": {"type": "web_search_preview"}}, 400, "'tool_choice'", "tool_choice"),
    ({"input": "w", "text": {"format": {"type": "json_schema"}}}, 400, "plain text", "text"),
    ({"input": "w", "max_output_tokens": "5"}, 400, "'max_output_tokens' must be an integer", "max_output_tokens"),
    ({"input": "w", "conversation": "conv_1"}, 400, "keeps no conversations", "conversation"),
    ({"input": "w " * (BODY_LIMIT // 2)}, 413, "request body over", None),
]


@pytest.mark.parametrize("body,status,message,param", BAD_REQUESTS, ids=range(len(BAD_REQUESTS)))
def test_bad_requests_get_one_openai_style_error(server, body, status, message, param):
    response = post(server, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert message in error["message"] and error["param"] == param


def test_context_key_and_queue_errors_in_the_openai_shape(server):
    from redrafter_mlx.serving.server import error_response

    long = post(server, {"input": " ".join(["Weather"] * 4200)}, path="/responses")
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    keyless = post(server, {"input": "w"}, key=None)
    assert keyless.status_code == 401 and keyless.json()["error"]["type"] == "authentication_error"
    busy = json.loads(error_response("/v1/responses", "too many requests are waiting", 429).body)
    assert busy["error"]["type"] == "rate_limit_error"


def test_an_engine_failure_mid_stream_ends_with_error_and_response_failed():
    """In process, an answer that fails after some text: every event parses
    as the SDK's, and the stream ends with error and response.failed."""
    import asyncio
    from types import SimpleNamespace

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from redrafter_mlx.engine.sampling import SamplingSettings
    from redrafter_mlx.serving.answer import KEEP_ALIVE, Part
    from redrafter_mlx.serving.requests import Job
    from redrafter_mlx.serving.responses_api import ResponsesAnswer
    from redrafter_mlx.serving.scheduler import Request

    echo = {
        "instructions": None,
        "max_output_tokens": None,
        "metadata": {},
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "top_logprobs": None,
        "names": {},
    }

    class Failing:
        tokenizer = SimpleNamespace(decode=lambda ids: "w")
        job = Job(Request([1, 2, 3], 8, SamplingSettings()), "responses", echo=echo)
        prompt_tokens, completion_tokens, cached_tokens, finish_reason, error = 3, 2, 0, None, None

        async def parts(self, request, keep_alive=None):
            yield Part(text="It ")
            yield KEEP_ALIVE
            yield Part(text="is")
            self.error = "the engine failed"

        def extension(self):
            return {"steps": 1, "tokens_per_step": 1.0, "nodes_per_step": 1.0}

    async def collect():
        return [chunk async for chunk in ResponsesAnswer(Failing(), "m").stream(None, 1.0)]

    chunks = asyncio.run(collect())
    assert ": keep-alive\n\n" in chunks
    events = [
        TypeAdapter(ResponseStreamEvent).validate_json(c.split("data: ", 1)[1])
        for c in chunks
        if c.startswith("event: ")
    ]
    assert [e.type for e in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    failed = events[-1].response
    assert (
        failed.status == "failed"
        and failed.error.code == "server_error"
        and failed.error.message == "the engine failed"
    )
    assert failed.output[0].content[0].text == "It is" and failed.usage.output_tokens == 2


def test_a_named_or_allowed_function_is_the_flat_one_first_then_a_namespaces():
    from redrafter_mlx.serving.responses_api import allowed_tools, shown_name, tool_list

    function = {"type": "function", "parameters": {"type": "object", "properties": {}}}
    tools, names, _ = tool_list(
        [
            {"type": "namespace", "name": "fs", "tools": [dict(function, name="read"), dict(function, name="list")]},
            dict(function, name="read"),
            dict(function, name="spawn"),
        ]
    )
    assert shown_name("read", names) == "read" and shown_name("list", names) == "fs.list"
    listed = lambda *entries: [
        t["function"]["name"]
        for t in allowed_tools({"type": "allowed_tools", "mode": "auto", "tools": list(entries)}, tools, names)
    ]  # noqa: E731
    assert listed({"type": "function", "name": "read", "namespace": "fs"}) == ["fs.read"]
    assert listed({"type": "function", "name": "spawn"}, {"type": "web_search"}) == ["spawn"]
    assert listed({"type": "namespace", "name": "fs"}) == ["fs.read", "fs.list"]
    assert allowed_tools("auto", tools, names) is tools
