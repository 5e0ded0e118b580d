"""The OpenAI-compatible HTTP front end (cluster/frontend/http.py) with the official openai client,
over real HTTP on 127.0.0.1, in front of the real router over instant instances (worker/instant.py:
tokens are a pure function of (seed, position), every token at once, no text)."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request

import openai
import pytest
from openai_server import MODEL, ServerThread
from test_frontend_auth import certs as tls_certs  # a fixture: a CA and a server certificate

from cluster.frontend.openai_render import router_error_body
from cluster.router.api import ErrorKind, RouterError
from cluster.router.observe import RouterMetrics
from worker.tokenizer import ByteTokenizer, ChatTemplateError

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server():
    with ServerThread(registry=RouterMetrics().registry) as running:
        yield running


def client(server: ServerThread, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, **kw)


def http(server: ServerThread, method: str, path: str, body: object | None = None, headers: dict | None = None):
    url = server.base_url.removesuffix("/v1") + path
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


def test_completions_n_choices_seeded_usage_and_ids(server) -> None:
    response = client(server).completions.create(
        model=MODEL, prompt="hello", max_tokens=4, n=3, seed=11, extra_body={"return_timeline": True},
        extra_headers={"X-Request-Id": "batch one"},
    )
    assert response.object == "text_completion" and response.model == MODEL
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.prompt_tokens == 6  # BOS + 5 bytes, counted once for the prompt
    assert response.usage.completion_tokens == 12 and response.usage.total_tokens == 18
    requests = response.model_extra["duet"]["requests"]
    # Each choice is its own request, with an id derived from the client's under the one rule.
    assert [r["request_id"] for r in requests] == ["batch one-0", "batch one-1", "batch one-2"]
    assert requests[0]["timeline"][-1]["state"] == "COMPLETE"
    assert {u["instance_id"] for u in requests[0]["instances"]} == {"p0", "g0"}


def test_batch_of_token_prompts_and_text_prompts(server) -> None:
    response = client(server).completions.create(model=MODEL, prompt=[[1, 2], [3, 4, 5]], max_tokens=2)
    assert len(response.choices) == 2 and response.usage.prompt_tokens == 5
    response = client(server).completions.create(model=MODEL, prompt=["a", "bc"], max_tokens=2, n=2)
    assert len(response.choices) == 4 and response.usage.completion_tokens == 8


def test_chat_non_streamed_and_streamed(server) -> None:
    chat = client(server).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, seed=1)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    rendered = ByteTokenizer().apply_chat_template(CHAT)
    assert chat.usage.prompt_tokens == 1 + len(rendered.encode())  # BOS + the plain template's bytes

    chunks = list(
        client(server).chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=5, seed=1, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_async_client_streams_completions() -> None:
    async def scenario(server: ServerThread):
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as aclient:
            stream = await aclient.completions.create(model=MODEL, prompt="x", max_tokens=3, n=2, stream=True)
            finished = [chunk.choices[0] async for chunk in stream if chunk.choices and chunk.choices[0].finish_reason]
            single = await aclient.completions.create(model=MODEL, prompt="x", max_tokens=3)
            return finished, single

    with ServerThread() as server:
        finished, single = asyncio.run(scenario(server))
    assert sorted(c.index for c in finished) == [0, 1]
    assert single.usage.completion_tokens == 3


def test_raw_sse_framing(server) -> None:
    body = json.dumps({"model": MODEL, "prompt": [1, 2], "max_tokens": 3, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + b"X-Request-Id: sse framing\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"x-request-id: sse framing" in head.lower()  # honoured and echoed
    assert b"content-type: text/event-stream" in head.lower()
    payload = _dechunk(rest) if b"transfer-encoding: chunked" in head.lower() else rest
    events = payload.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    for event in events[:-2]:
        assert event.startswith(b"data: {") and b"\n" not in event
        chunk = json.loads(event[len(b"data: "):])
        assert chunk["object"] == "text_completion" and len(chunk["choices"]) == 1
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "length"


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return out


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),
        ({"prompt": [1, 999]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt[1]"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
        ({"prompt": "x", "suffix": "end"}, "suffix"),
        ({"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
        ({"prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "x", "logprobs": 99}, "logprobs"),
        ({"prompt": "x", "stop_token_ids": [300]}, "stop_token_ids"),
        ({"prompt": 5}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_bad_completions_are_400_naming_the_field(server, body, field) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).post("/completions", body={"model": MODEL, **body}, cast_to=object)
    error = caught.value.body
    assert error["param"] == field, error
    assert error["message"].startswith(field), error
    assert caught.value.status_code == 400


def test_bad_chat_and_bad_json_are_400(server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        )
    assert caught.value.body["param"] == "messages[0].content[0].type"
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(model=MODEL, messages=[])
    assert caught.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10_000)
    assert caught.value.body["param"] == "max_completion_tokens"
    status, raw, _ = http(server, "POST", "/v1/completions", b"{not json")
    assert status == 400 and json.loads(raw)["error"]["param"] == "body"
    status, raw, _ = http(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"


def test_chat_text_parts_are_joined(server) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    joined = client(server).chat.completions.create(model=MODEL, messages=parts, max_tokens=1)
    plain = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=1)
    assert joined.usage.prompt_tokens == plain.usage.prompt_tokens


def test_unknown_model_and_route_are_404(server) -> None:
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="other", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("other")
    assert client(server).models.retrieve(MODEL).id == MODEL
    assert [m.id for m in client(server).models.list()] == [MODEL]
    status, raw, _ = http(server, "GET", "/v2/anything")
    assert status == 404 and "error" in json.loads(raw)


def test_bearer_tokens_are_401_without_the_right_one() -> None:
    with ServerThread(tokens=["openai-test-token-0123456789"]) as server:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
        status, _, _ = http(server, "GET", "/v1/models")
        assert status == 401
        assert http(server, "GET", "/health")[0] == 200  # exempt, as gRPC's health service
        ok = openai.OpenAI(base_url=server.base_url, api_key="openai-test-token-0123456789", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_a_request_id_in_use_is_409_naming_the_header() -> None:
    # The router's ALREADY_EXISTS, which gRPC answers with the same name (the live conflict is
    # driven end to end in tests/integration/test_openai_local.py).
    error = RouterError(ErrorKind.ALREADY_EXISTS, "client_request_id 'x' is in use", "client_request_id")
    status, body = router_error_body(error)
    assert status == 409
    assert body["error"]["type"] == "conflict_error" and body["error"]["code"] == "ALREADY_EXISTS"
    assert body["error"]["param"] == "X-Request-Id"


def test_a_batch_that_does_not_fit_is_429_and_nothing_runs() -> None:
    with ServerThread(router_config={"admission": {"max_queued_requests": 2}}) as server:
        with pytest.raises(openai.RateLimitError):
            client(server).completions.create(model=MODEL, prompt="x", max_tokens=1, n=3)
        with pytest.raises(openai.RateLimitError):
            client(server).completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=1)
        assert sum(server.router.observer.outcomes.values()) == 0  # nothing was admitted
        assert client(server).completions.create(model=MODEL, prompt="x", max_tokens=1, n=2).usage.completion_tokens == 2


def test_draining_is_503_and_health_follows() -> None:
    with ServerThread() as server:
        assert http(server, "GET", "/health")[0] == 200
        server.router.set_accepting(False)
        server.server.set_serving(False)
        assert http(server, "GET", "/health")[0] == 503
        with pytest.raises(openai.InternalServerError) as caught:
            client(server).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert caught.value.status_code == 503


def test_no_healthy_instance_is_503() -> None:
    async def none(router):
        return None

    with ServerThread(instances=none) as server:
        assert http(server, "GET", "/health")[0] == 503
        with pytest.raises(openai.APIStatusError) as caught:
            client(server).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert caught.value.status_code == 503


def test_tokenize_detokenize_version_metrics(server) -> None:
    status, raw, _ = http(server, "POST", "/tokenize", {"model": MODEL, "prompt": "hi"})
    assert status == 200 and json.loads(raw) == {"count": 3, "max_model_len": 4096, "tokens": [256, 104, 105]}
    status, raw, _ = http(server, "POST", "/tokenize", {"messages": CHAT})
    rendered = ByteTokenizer().apply_chat_template(CHAT)
    assert json.loads(raw)["tokens"] == [256, *rendered.encode()]
    status, raw, _ = http(server, "POST", "/detokenize", {"tokens": [104, 105]})
    assert status == 200 and json.loads(raw) == {"prompt": "hi"}
    status, raw, _ = http(server, "POST", "/detokenize", {"tokens": [104, 9999]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "tokens"
    status, raw, _ = http(server, "GET", "/version")
    assert status == 200 and "version" in json.loads(raw)
    status, raw, headers = http(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")


class _NoTemplate(ByteTokenizer):
    def apply_chat_template(self, messages, add_generation_prompt=True):
        raise ChatTemplateError("this tokenizer has no chat template")


def test_chat_template_override_and_missing_template() -> None:
    async def instant(router):
        from openai_server import instant_pair

        await instant_pair(router)

    with ServerThread(instances=instant, chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}") as server:
        status, raw, _ = http(server, "POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False})
        assert json.loads(raw)["tokens"] == [256, *b"<user>hi"]
    with ServerThread(tokenizer=_NoTemplate()) as server:
        with pytest.raises(openai.BadRequestError) as caught:
            client(server).chat.completions.create(model=MODEL, messages=CHAT)
        assert caught.value.body["param"] == "messages" and "no chat template" in caught.value.body["message"]


certs = tls_certs


def test_tls_with_the_front_ends_certificate_files(certs, tmp_path) -> None:
    import ssl

    from cluster.frontend.http import HttpTls

    (tmp_path / "server.pem").write_bytes(certs["server"][0])
    (tmp_path / "server.key").write_bytes(certs["server"][1])
    tls = HttpTls(str(tmp_path / "server.pem"), str(tmp_path / "server.key"))
    with ServerThread(tls=tls) as server:
        assert server.base_url.startswith("https://")
        context = ssl.create_default_context(cadata=certs["ca"].decode())
        with urllib.request.urlopen(f"https://127.0.0.1:{server.port}/v1/models", context=context, timeout=10) as response:
            assert json.loads(response.read())["data"][0]["id"] == MODEL
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models", timeout=10).read()
