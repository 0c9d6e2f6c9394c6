"""`redrafter-mlx serve` as a real server process on loopback, driven by the
`openai` client package and by raw HTTP."""

import http.client
import json
import os
import re
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import run_cli, start_server, stop_server

openai = pytest.importorskip("openai")
MAX_BATCH = 4
BODY_LIMIT = 64 * 1024
QUESTIONS = ["pick a word", "w5 w6 w7 pick", "a word w100 w200 w300 w9 w9", "w17"]


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    model, drafter = chat_model[:2]
    log = tmp_path_factory.mktemp("server") / "prompts.jsonl"
    process, url, port = start_server(
        "--model",
        model,
        "--drafter",
        drafter,
        "--max-batch",
        MAX_BATCH,
        "--max-tokens",
        16,
        "--max-body-bytes",
        BODY_LIMIT,
        "--log-prompts",
        log,
    )
    yield url, port, model, str(log)
    stop_server(process)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(server):
    """Plain greedy decoding of each question in this process (the chat
    template applied), as token ids and text."""

    from redrafter_mlx.engine.autoregressive import autoregressive_steps
    from redrafter_mlx.engine.base_model import BaseModel
    from redrafter_mlx.loading.loader import load_base_model
    from redrafter_mlx.serving.api import encode_prompt

    model, tokenizer = load_base_model(server[2], dtype=None)
    base = BaseModel(model)

    def greedy(prompt_ids, max_tokens):
        tokens = []
        for (out,) in autoregressive_steps(
            base, [prompt_ids], max_tokens=max_tokens, eos_token_ids=tokenizer.eos_token_ids
        ):
            tokens += out.tokens
        return tokens

    def answer(text, max_tokens=16, chat=True):
        ids = encode_prompt(tokenizer, text) if chat else tokenizer.encode(text)
        tokens = greedy(ids, max_tokens)
        return ids, tokens, tokenizer.decode(tokens)

    answer.tokenizer, answer.greedy = tokenizer, greedy
    return answer


def chat(client, text, **kwargs):
    return client.chat.completions.create(
        model="anything", messages=[{"role": "user", "content": text}], temperature=0, **kwargs
    )


def streamed_chat(client, text, **kwargs):
    stream = client.chat.completions.create(
        model="anything", messages=[{"role": "user", "content": text}], temperature=0, stream=True, **kwargs
    )
    return list(stream)


def test_chat_completion_equals_plain_greedy_decoding_with_usage(client, reference):
    ids, tokens, text = reference(QUESTIONS[0], 12)
    response = chat(client, QUESTIONS[0], max_tokens=12)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == ("length" if len(tokens) == 12 else "stop")
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (
        len(ids),
        len(tokens),
        len(ids) + len(tokens),
    )
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    figures = response.model_extra["redrafter"]
    assert figures["steps"] >= 1 and 1 <= figures["tokens_per_step"] and figures["nodes_per_step"] >= 1
    # max_completion_tokens is the newer name of max_tokens.
    assert (
        client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": QUESTIONS[0]}], max_completion_tokens=12
        )
        .choices[0]
        .message.content
        == text
    )


def test_streamed_chat_gives_the_same_text_then_usage(client, reference):
    ids, tokens, text = reference(QUESTIONS[1], 16)
    chunks = streamed_chat(client, QUESTIONS[1], max_tokens=16, stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_text_completions_whole_and_streamed(client, reference):
    ids, tokens, text = reference("w1 w2 w3", 10, chat=False)
    response = client.completions.create(model="x", prompt="w1 w2 w3", max_tokens=10, temperature=0)
    assert response.choices[0].text == text and response.usage.prompt_tokens == len(ids)
    stream = client.completions.create(model="x", prompt="w1 w2 w3", max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == text
    by_ids = client.completions.create(model="x", prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == text


def test_stop_strings_cut_exactly_also_across_tokens_while_streaming(client, reference):
    _, _, text = reference(QUESTIONS[0], 16)
    words = text.split(" ")
    assert len(words) >= 6
    # Two words and the space between them: the stop spans three tokens.
    stop = " ".join(words[3:5])
    expected = text[: text.find(stop)]
    for kwargs in ({}, {"stream": True}):
        if kwargs:
            got = "".join(
                c.choices[0].delta.content or ""
                for c in streamed_chat(client, QUESTIONS[0], max_tokens=16, stop=[stop, "never"])
                if c.choices
            )
        else:
            response = chat(client, QUESTIONS[0], max_tokens=16, stop=stop)
            got = response.choices[0].message.content
            assert response.choices[0].finish_reason == "stop"
        assert got == expected


def test_models_health_and_an_unknown_model_name_loads_nothing(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [os.path.basename(server[2])]
    health = httpx.get(server[0] + "/health").json()
    assert health["status"] == "ok"
    preflight = httpx.options(
        server[0] + "/v1/chat/completions",
        headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in (
        "*",
        "http://localhost:3000",
    )
    response = client.chat.completions.create(
        model="no/such-model",
        messages=[{"role": "user", "content": "w17"}],
        max_tokens=2,
        extra_body={"unknown_field": 3},
    )
    assert response.usage.completion_tokens == 2


def test_sampling_fields_reach_the_sampler(client, reference):
    word = reference.tokenizer.encode("w42")
    assert len(word) == 1
    forced = chat(client, QUESTIONS[0], max_tokens=5, logit_bias={str(word[0]): 100})
    assert forced.choices[0].message.content == " ".join(["w42"] * 5)
    penalised = chat(
        client, QUESTIONS[0], max_tokens=5, logit_bias={str(word[0]): 100}, extra_body={"repetition_penalty": 1e6}
    )
    assert penalised.choices[0].message.content.split(" ")[0] == "w42"
    assert penalised.choices[0].message.content.split(" ")[1] != "w42"  # penalised once it has appeared
    sampled = client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": QUESTIONS[0]}],
        max_tokens=6,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        extra_body={"min_p": 0.05},
    )
    assert sampled.usage.completion_tokens == 6


def test_concurrent_clients_get_what_each_would_get_alone(client, reference):
    expected = [reference(q, 16)[2] for q in QUESTIONS]
    alone = [chat(client, q, max_tokens=16).choices[0].message.content for q in QUESTIONS]
    assert alone == expected
    jobs = QUESTIONS * 3  # 12 requests, more than the batch holds
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda q: chat(client, q, max_tokens=16).choices[0].message.content, jobs))
    assert together == [expected[QUESTIONS.index(q)] for q in jobs]


def test_seeded_sampling_is_reproducible_beside_other_requests(server, client):
    def sample(seed):
        return (
            client.chat.completions.create(
                model="x",
                messages=[{"role": "user", "content": QUESTIONS[0]}],
                max_tokens=12,
                temperature=1.0,
                seed=seed,
                extra_body={"top_k": 8},
            )
            .choices[0]
            .message.content
        )

    first = sample(7)
    with ThreadPoolExecutor(4) as pool:
        beside = list(pool.map(lambda s: sample(s), [7, 8, 7, 9]))
    assert beside[0] == beside[2] == first
    assert len({first, beside[1], beside[3]}) > 1
    # The same as `generate --seed` gives for that prompt.
    result = run_cli(
        "generate",
        "--model",
        server[2],
        "--drafter",
        "none",
        "--prompt",
        QUESTIONS[0],
        "--max-tokens",
        12,
        "--temp",
        1.0,
        "--top-k",
        8,
        "--seed",
        7,
        "--json",
    )
    assert json.loads(result.stdout)["text"] == first


def test_the_next_turn_reuses_the_cached_conversation(client, reference):
    first = chat(client, QUESTIONS[2], max_tokens=16)
    messages = [
        {"role": "user", "content": QUESTIONS[2]},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": QUESTIONS[3]},
    ]
    second = client.chat.completions.create(model="x", messages=messages, max_tokens=16, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    tokenizer = reference.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert second.usage.prompt_tokens == len(ids)
    assert second.choices[0].message.content == tokenizer.decode(reference.greedy(ids, 16))


def test_a_client_that_goes_away_frees_its_row_and_the_others_go_on(server, client):
    url = server[0]
    body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 100000, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data:") and '"content": "w' in line:
                break
        assert httpx.get(url + "/health").json()["running"] == 1
    deadline = time.time() + 20
    while httpx.get(url + "/health").json()["running"] and time.time() < deadline:
        time.sleep(0.1)
    assert httpx.get(url + "/health").json()["running"] == 0
    assert chat(client, QUESTIONS[3], max_tokens=3).usage.completion_tokens == 3


def test_a_bounded_load_completes_every_request(server, client):
    def one(i):
        question = QUESTIONS[i % len(QUESTIONS)]
        if i % 2:
            chunks = streamed_chat(client, question, max_tokens=8 + i % 5, stream_options={"include_usage": True})
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return (
                text,
                chunks[-1].usage.completion_tokens,
                [c.choices[0].finish_reason for c in chunks if c.choices][-1],
            )
        response = chat(client, question, max_tokens=8 + i % 5)
        return response.choices[0].message.content, response.usage.completion_tokens, response.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(32)))
    assert len(results) == 32
    for i, (text, completion_tokens, finish) in enumerate(results):
        assert finish in ("stop", "length") and 1 <= completion_tokens <= 8 + i % 5
        assert text == text.strip() and text
    health = httpx.get(server[0] + "/health").json()
    assert health == {"status": "ok", "running": 0, "waiting": 0}
    assert chat(client, QUESTIONS[0], max_tokens=2).usage.completion_tokens == 2


CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "w1"}]
BAD_REQUESTS = [
    (CHAT, b"{not json", 400, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, "JSON object"),
    (CHAT, {"max_tokens": 3}, 400, "'messages'"),
    (CHAT, {"messages": "w1"}, 400, "'messages'"),
    (CHAT, {"messages": [{"content": "w1"}]}, 400, "'role'"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    (CHAT, {"messages": MESSAGES, "max_tokens": -1}, 400, "'max_tokens' must be >= 0"),
    (CHAT, {"messages": MESSAGES, "max_tokens": "10"}, 400, "'max_tokens' must be an integer"),
    (CHAT, {"messages": MESSAGES, "temperature": -0.5}, 400, "'temperature' must be >= 0"),
    (CHAT, {"messages": MESSAGES, "top_p": 1.5}, 400, "'top_p' must be in"),
    (CHAT, {"messages": MESSAGES, "stream": "yes"}, 400, "'stream'"),
    (CHAT, {"messages": MESSAGES, "stop": 5}, 400, "'stop'"),
    (CHAT, {"messages": MESSAGES, "logit_bias": {"x": 1}}, 400, "'logit_bias'"),
    (CHAT, {"messages": MESSAGES, "n": 2}, 400, "'n'"),
    ("/v1/completions", {"max_tokens": 3}, 400, "'prompt'"),
    ("/v1/completions", {"prompt": [7] * 5000}, 400, "context"),
    ("/v1/completions", {"prompt": "w1 " * (BODY_LIMIT // 3)}, 413, "request body over"),
    ("/v1/nothing", {"prompt": "w1"}, 404, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,message", BAD_REQUESTS, ids=range(len(BAD_REQUESTS)))
def test_bad_requests_get_an_openai_style_error_and_the_server_goes_on(server, client, path, body, status, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server[0] + path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert chat(client, "w1", max_tokens=1).usage.completion_tokens == 1


def test_the_prompt_log_keeps_each_valid_request_as_distill_reads_it(server, client, reference):
    from redrafter_mlx.serving.api import encode_prompt
    from redrafter_mlx.serving.prompts import read_prompts

    question, ids = "w41 w42 w43 pick", [9, 8, 7, 6]
    chat(client, question, max_tokens=2)
    httpx.post(server[0] + "/v1/completions", json={"prompt": ids, "max_tokens": 2}).raise_for_status()
    refused = httpx.post(server[0] + "/v1/completions", json={"prompt": [5, 5, 5], "max_tokens": 2, "n": 2})
    assert refused.status_code == 400
    logged = read_prompts(server[3])
    conversation = [{"role": "user", "content": question}]
    assert logged[-2:] == [conversation, ids]
    assert encode_prompt(reference.tokenizer, logged[-2]) == reference(question)[0]
    assert [5, 5, 5] not in logged


def test_a_port_in_use_is_one_clear_error(server):
    result = run_cli("serve", "--port", server[1], "--drafter", "none")
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: cannot listen on 127.0.0.1:{server[1]} (Address already in use)"


def test_logprobs_whole_and_streamed_in_both_openai_forms(client, reference):
    """The chosen tokens' log-probabilities and their top alternatives, in
    chat's form and in the text completions' form, streamed alike."""
    import math

    ids, tokens, _ = reference(QUESTIONS[0])
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": QUESTIONS[0]}], logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == len(tokens) and all(len(c.top_logprobs) == 3 for c in content)
    for entry in content:  # greedy: the chosen token is the most likely, and its log-probability leads the list
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs) and entry.logprob <= 0
        assert entry.token == entry.top_logprobs[0].token and entry.bytes == list(entry.token.encode())
    assert sum(math.exp(t.logprob) for t in content[0].top_logprobs) <= 1 + 1e-5
    streamed = [
        c
        for chunk in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": QUESTIONS[0]}], logprobs=True, top_logprobs=3, stream=True
        )
        if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content
    ]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]
    text = client.completions.create(model="m", prompt=QUESTIONS[0], max_tokens=6, logprobs=2)
    legacy = text.choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == 6 and all(
        len(t) <= 2 for t in legacy.top_logprobs
    )


def test_penalties_xtc_and_chat_template_arguments_are_taken(client, reference):
    ids, tokens, text = reference(QUESTIONS[1])
    plain = client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTIONS[1]}])
    penalised = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": QUESTIONS[1]}],
        extra_body={"presence_penalty": 30.0, "frequency_penalty": 5.0},
    )
    assert plain.choices[0].message.content == text
    assert len(set(penalised.choices[0].message.content.split())) == len(
        penalised.choices[0].message.content.split()
    )  # no word twice
    xtc = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": QUESTIONS[1]}],
        temperature=1.0,
        seed=3,
        extra_body={"xtc_probability": 1.0, "xtc_threshold": 0.05},
    )
    assert xtc.choices[0].finish_reason in ("stop", "length")
    extra = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": QUESTIONS[1]}],
        extra_body={"chat_template_kwargs": {"unused": True}},
    )
    assert extra.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], extra_body={"chat_template_kwargs": [1]}
        )


# A server with short bounds of its own (`serve --read-timeout`,
# `--max-connections`, `--max-header-bytes`), for the tests of what no
# client may take.
READ_TIMEOUT = 3.0
CONNECTIONS = 6
HEADER_LIMIT = 4096


@pytest.fixture(scope="module")
def limited(chat_model):
    model, drafter = chat_model[:2]
    process, url, port = start_server(
        "--model",
        model,
        "--drafter",
        drafter,
        "--max-batch",
        2,
        "--max-tokens",
        4,
        "--read-timeout",
        READ_TIMEOUT,
        "--max-connections",
        CONNECTIONS,
        "--max-header-bytes",
        HEADER_LIMIT,
    )
    yield url, port
    stop_server(process)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=15)


def response_on(sock: socket.socket) -> tuple:
    """(status, headers, JSON body) of the answer read from a raw socket."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read())


def closed_after(sock: socket.socket, tic: float) -> float:
    """Seconds from ``tic`` until the server closed ``sock`` (reading
    whatever it sent first)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - tic


def gauge(url: str, name: str) -> float:
    return float(
        re.search(rf"^redrafter_{name}(?:{{[^}}]*}})? (\S+)$", httpx.get(url + "/metrics").text, re.M).group(1)
    )


def settled(url: str) -> None:
    """Wait until the connections of earlier tests are closed (the one
    asking is open)."""
    deadline = time.monotonic() + 2 * READ_TIMEOUT + 5
    while gauge(url, "connections_open") > 1:
        assert time.monotonic() < deadline, "connections of earlier tests stay open"
        time.sleep(0.1)


def test_a_body_sent_a_byte_at_a_time_gets_408_within_the_read_timeout_holding_no_engine_slot(limited):
    """Nothing reaches the scheduler before the body is in: while the body
    trickles, /health shows nothing running or waiting. At the read timeout
    the answer is a 408 in the route's dialect, and the connection closes."""
    url, port = limited
    body = json.dumps({"messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 2}).encode()

    def trickle(path):
        with connect(port) as sock:
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            )
            tic, sent, engine = time.monotonic(), 0, set()
            while not select.select([sock], [], [], 0.1)[0]:  # a byte every 0.1 s until the server answers
                assert sent < len(body) - 1, "the whole body but its last byte went, and no answer came"
                sock.sendall(body[sent : sent + 1])
                sent += 1
                health = httpx.get(url + "/health").json()
                engine.add((health["running"], health["waiting"]))
            status, headers, answer = response_on(sock)
            seconds = time.monotonic() - tic
            return status, headers, answer, seconds, engine, closed_after(sock, tic) - seconds

    with ThreadPoolExecutor(2) as pool:
        (status, headers, answer, seconds, engine, closing), anthropic = pool.map(trickle, [CHAT, "/v1/messages"])
    assert status == 408 and READ_TIMEOUT - 0.05 <= seconds <= READ_TIMEOUT + 1.5
    assert (
        answer["error"]["type"] == "invalid_request_error"
        and f"did not arrive within {READ_TIMEOUT:g} seconds" in answer["error"]["message"]
    )
    assert headers["connection"] == "close" and closing < 1.0
    assert engine == {(0, 0)}
    assert (
        anthropic[0] == 408
        and anthropic[2]["type"] == "error"
        and anthropic[2]["error"]["type"] == "invalid_request_error"
    )
    assert (
        httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": 2}).json()["usage"]["completion_tokens"] == 2
    )


def test_a_connection_that_sends_no_request_or_its_headers_a_line_at_a_time_is_closed_at_the_read_timeout(limited):
    url, port = limited

    def idle():
        with connect(port) as sock:
            return closed_after(sock, time.monotonic())

    def dribble():
        with connect(port) as sock:
            tic = time.monotonic()
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            try:
                for i in range(100):
                    if select.select([sock], [], [], 0.1)[0]:
                        break
                    sock.sendall(b"X-Slow-%d: a\r\n" % i)
            except (BrokenPipeError, ConnectionResetError):
                pass
            return closed_after(sock, tic)

    with ThreadPoolExecutor(2) as pool:
        seconds = list(pool.map(lambda f: f(), [idle, dribble]))
    assert all(READ_TIMEOUT - 0.05 <= s <= READ_TIMEOUT + 1.5 for s in seconds), seconds
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_headers_over_the_bound_get_431_in_the_routes_dialect(server, limited):
    """Whole in one read (the app's check) or arriving in pieces (h11's
    buffer stops at the bound), a head over the bound gets 431. The
    default bound is 64 KiB: 40 KB of headers pass, where h11's own default
    (16 KiB) would have answered 400."""
    url = server[0]
    assert httpx.get(url + "/v1/models", headers={"X-Big": "a" * 40_000}).status_code == 200
    over = httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": 1}, headers={"X-Big": "a" * 70_000})
    assert over.status_code == 431 and over.headers["connection"] == "close"
    assert (
        over.json()["error"]["type"] == "invalid_request_error"
        and "request headers over 65536 bytes" in over.json()["error"]["message"]
    )

    with connect(limited[1]) as sock:
        sock.sendall(b"POST /v1/messages?beta=true HTTP/1.1\r\nHost: x\r\n")
        for i in range(2 * HEADER_LIMIT // 500):
            if select.select([sock], [], [], 0.05)[0]:
                break
            sock.sendall(b"X-Piece-%d: %s\r\n" % (i, b"a" * 500))
        status, headers, answer = response_on(sock)
    assert status == 431 and headers["connection"] == "close"
    assert answer["type"] == "error" and f"request headers over {HEADER_LIMIT} bytes" in answer["error"]["message"]
    assert httpx.get(limited[0] + "/health").json()["status"] == "ok"


def test_connections_beyond_the_bound_are_refused_with_503_and_closed_soon(limited):
    """Idle connections count. With the bound open, a request on one more
    gets a 503 in the route's dialect with Retry-After; connections opened
    beyond the bound are closed within a second unless they send a request;
    once connections close, requests are served again."""
    url, port = limited
    settled(url)
    held = [connect(port) for _ in range(CONNECTIONS)]
    try:
        time.sleep(0.2)
        beyond = [connect(port) for _ in range(3)]
        tic = time.monotonic()
        refused = httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": 1})
        assert (
            refused.status_code == 503
            and refused.headers["retry-after"] == "1"
            and refused.headers["connection"] == "close"
        )
        assert refused.json()["error"]["type"] == "service_unavailable"
        with ThreadPoolExecutor(3) as pool:
            seconds = list(pool.map(lambda s: closed_after(s, tic), beyond))
        assert all(s < READ_TIMEOUT - 0.5 for s in seconds), seconds  # within a second, not the read timeout
    finally:
        for sock in held:
            sock.close()
    assert httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": 1}).status_code == 200
    assert gauge(url, "rejected_total") >= 1


def test_template_syntax_in_messages_and_tools_is_text_and_never_run(client):
    """Jinja syntax in what a client sends reaches the prompt as written:
    the word-level tokenizer counts its words ("{{ 7*7 }}" is three; run,
    "49" would be one)."""

    def prompt_tokens(content, description="w1 w2 w3"):
        tool = {
            "type": "function",
            "function": {"name": "f", "description": description, "parameters": {"type": "object", "properties": {}}},
        }
        return chat(client, content, max_tokens=1, tools=[tool]).usage.prompt_tokens

    plain = prompt_tokens("w1 w2 w3 w4")
    assert prompt_tokens("w1 {{ 7*7 }}") == plain
    assert prompt_tokens("w1 {% for %}") == plain
    assert prompt_tokens("w1 w2 w3 w4", description="{{ 7*7 }}") == plain
    assert prompt_tokens("w1 w2 w3 w4", description="{% endfor %} {{") == plain + 1  # four words for three


DEEP = {"a": {"a": {"a": {"a": {"a": {"a": {"a": {"a": {"a": 1}}}}}}}}}
BAD_TEMPLATE_KWARGS = [
    ({"chat_template": "{{ 7*7 }}"}, "may not set 'chat_template'"),
    ({"messages": []}, "may not set 'messages'"),
    ({"tools": [{"x": 1}]}, "may not set 'tools'"),
    ({"add_generation_prompt": False}, "may not set 'add_generation_prompt'"),
    ({"tokenize": True}, "may not set 'tokenize'"),
    ({"eos_token": "w5"}, "may not set 'eos_token'"),
    ({"raise_exception": 1}, "may not set 'raise_exception'"),
    ({"not a name": 1}, "must be identifiers"),
    ({"__class__": 1}, "must be identifiers"),
    ({"deep": DEEP}, "over 8 levels deep"),
    ({"huge": "w1 " * 10_000}, "bytes as JSON"),
]


@pytest.mark.parametrize("kwargs,message", BAD_TEMPLATE_KWARGS, ids=range(len(BAD_TEMPLATE_KWARGS)))
def test_chat_template_kwargs_that_would_reach_into_the_template_get_400(server, kwargs, message):
    for path in (CHAT, "/v1/messages", "/v1/responses"):
        body = {"max_tokens": 1, "chat_template_kwargs": kwargs}
        body.update({"input": "w1"} if path == "/v1/responses" else {"messages": MESSAGES})
        response = httpx.post(server[0] + path, json=body)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert (
            "chat_template_kwargs" in error["message"]
            and message in error["message"]
            and error["type"] == "invalid_request_error"
        )
    fine = httpx.post(
        server[0] + CHAT,
        json={
            "messages": MESSAGES,
            "max_tokens": 1,
            "chat_template_kwargs": {"enable_thinking": False, "effort": {"level": ["low"]}},
        },
    )
    assert fine.status_code == 200


def test_a_client_that_leaves_while_its_long_prompt_is_prefilled_frees_its_slot_within_a_chunk(chat_model, monkeypatch):
    """In this process, so that prefill can be slowed down: chunks of 64
    tokens that take 0.2 s each. A whole (not streamed) request whose
    prompt needs 16 chunks; its client closes the connection during the
    second. Within a chunk and the server's poll for clients that left, the
    prefill stops: nothing runs or waits, no chunk is fed after, the
    prefill's caches are dropped; the next request is answered."""
    import threading

    import uvicorn

    from redrafter_mlx.drafting.settings import DraftSettings
    from redrafter_mlx.engine.prefill import Prefill
    from redrafter_mlx.loading.loader import load
    from redrafter_mlx.serving.answer import POLL_SECONDS
    from redrafter_mlx.serving.chat_format import ChatRenderer
    from redrafter_mlx.serving.scheduler import Scheduler
    from redrafter_mlx.serving.server import Server, uvicorn_config

    chunk_seconds, fed = 0.2, []
    layers = Prefill.layers

    def slow_layers(self):
        fed.append(time.monotonic())
        time.sleep(chunk_seconds)
        yield from layers(self)

    monkeypatch.setattr(Prefill, "layers", slow_layers)
    redrafter, tokenizer = load(chat_model[0], drafter=chat_model[1], dtype=None)
    renderer = ChatRenderer(tokenizer)
    scheduler = Scheduler(redrafter, renderer.eos_token_ids, DraftSettings(), max_batch=2)
    scheduler.decoder.prefill_step_size = 64
    scheduler.start()
    server = Server(scheduler, renderer, "tiny", 4, redrafter.base.max_context)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    serving = uvicorn.Server(uvicorn_config(server, 1))
    server.connections = serving.server_state.connections
    thread = threading.Thread(target=serving.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while not serving.started:
            time.sleep(0.05)
        prompt = " ".join(f"w{10 + i % 400}" for i in range(1000))
        body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 4}).encode()
        with connect(port) as client_sock:
            client_sock.sendall(
                f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            deadline = time.monotonic() + 10
            while len(fed) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert httpx.get(url + "/health").json()["running"] == 1
        left = time.monotonic()
        while httpx.get(url + "/health").json()["running"]:
            assert time.monotonic() - left < 5
            time.sleep(0.02)
        assert time.monotonic() - left <= chunk_seconds + POLL_SECONDS + 1.0
        assert len([t for t in fed if t > left]) <= 3 and len(fed) <= 5  # of 16
        assert scheduler.coming is None and not scheduler.active and not scheduler.choosers and not scheduler.waiting
        answer = httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": 2}, timeout=30).json()
        assert answer["usage"]["completion_tokens"] == 2
    finally:
        serving.should_exit = True
        thread.join(10)
        scheduler.stop()
