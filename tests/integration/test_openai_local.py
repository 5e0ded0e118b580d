"""The OpenAI HTTP API with the official openai client in front of the real router and real engines
in this process (no Ray): 1 PREFILL + 1 GENERATION with the built-in model, KV over gRPC on
127.0.0.1. Text, stop strings, seeds, logprobs, the request-id conflict, and a client that leaves
mid-stream having its request aborted and its blocks freed on both instances."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import openai
import pytest
from local_cluster import Cluster

from cluster.router.api import ClientRequest, collect
from worker.protocol import InstanceRole
from worker.sampling import SamplingParams
from worker.tokenizer import ByteTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from openai_server import MODEL, ServerThread  # noqa: E402


class _Engines:
    """Real instances for ServerThread, on its loop; the router is the ServerThread's."""

    def __init__(self) -> None:
        self.cluster: Cluster | None = None

    async def __call__(self, router):
        cluster = Cluster({"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION})
        cluster.router = router  # the server's router drives these engines
        for client in cluster.clients.values():
            await router.add_instance(client)
        self.cluster = cluster

        async def shutdown():
            for instance in cluster.instances.values():
                instance.shutdown()

        return shutdown


@pytest.fixture(scope="module")
def served():
    engines = _Engines()
    with ServerThread(instances=engines, router_config={
        "health": {"heartbeat_interval_s": 0.2, "dead_after_s": 5.0},
        "timeouts": {"context_s": 30.0, "reservation_s": 10.0, "transfer_s": 10.0, "generation_s": 60.0},
    }) as server:
        yield server, engines


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def test_greedy_text_equals_the_routers_tokens(served) -> None:
    server, _ = served
    prompt = "The quick brown fox"
    response = client(server).completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens, _ = server.call(_direct(server, ByteTokenizer().encode(prompt), params))
    assert response.choices[0].text == ByteTokenizer().decode(tokens)
    assert response.usage.completion_tokens == 12 and response.choices[0].finish_reason == "length"


async def _direct(server, prompt, params):
    return await collect(await server.router.submit(ClientRequest(None, tuple(prompt), params)))


def test_stream_deltas_join_to_the_unary_text_and_usage_counts(served) -> None:
    server, _ = served
    kw = {"model": MODEL, "prompt": "Once upon", "max_tokens": 10, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client(server).completions.create(**kw)
    chunks = list(client(server).completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_seed_same_text_and_n_choices_differ(served) -> None:
    server, _ = served
    kw = {"model": MODEL, "prompt": "Seeded", "max_tokens": 12, "temperature": 1.0, "seed": 1234, "extra_body": {"ignore_eos": True}}
    first = client(server).completions.create(**kw)
    again = client(server).completions.create(**kw)
    assert first.choices[0].text == again.choices[0].text
    many = client(server).completions.create(n=3, **kw)
    texts = [c.text for c in many.choices]
    assert texts[0] == first.choices[0].text  # choice 0 keeps the seed
    assert len(set(texts)) == 3  # the others derive their own


def test_stop_string_ends_the_text(served) -> None:
    server, _ = served
    kw = {"model": MODEL, "prompt": "Stop here", "max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
    free = client(server).completions.create(**kw).choices[0].text
    stop = free[3:5]
    assert stop
    stopped = client(server).completions.create(stop=[stop], **kw).choices[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert free.startswith(stopped.text)


def test_logprobs_completions_and_chat(served) -> None:
    server, _ = served
    response = client(server).completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(lp <= 0.0 for lp in logprobs.token_logprobs)
    assert all(len(top) <= 2 and len(top) >= 1 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == response.choices[0].text
    chat = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(entry.top_logprobs) == 3 for entry in content)
    # Greedy: the sampled token is the most likely one.
    assert all(entry.top_logprobs[0].logprob == pytest.approx(entry.logprob) for entry in content)


def test_chat_streams_text_with_the_role_first(served) -> None:
    server, _ = served
    chunks = list(
        client(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 1


def test_a_request_id_in_use_is_409_and_a_disconnect_aborts_and_frees_blocks(served) -> None:
    server, engines = served
    body = json.dumps(
        {"model": MODEL, "prompt": "long " * 20, "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: leaver\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    received = b""
    while received.count(b"data: ") < 3:  # mid-stream
        received += sock.recv(4096)
    with pytest.raises(openai.ConflictError):
        client(server).completions.create(model=MODEL, prompt="x", max_tokens=1, extra_headers={"X-Request-Id": "leaver"})
    sock.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        view = server.router.get_request(client_request_id="leaver")
        if view.final is not None:
            break
        time.sleep(0.05)
    assert view.state == "ABORTED", view.state
    assert view.final is not None and view.final.usage.completion_tokens < 3000
    free = server.call(engines.cluster.free_blocks_settle())
    assert all(f == t for f, t in free.values()), free


def test_async_client_chat(served) -> None:
    server, _ = served

    async def scenario():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(
                *(
                    aclient.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4, temperature=0
                    )
                    for i in range(4)
                )
            )

    results = asyncio.run(scenario())
    assert all(r.usage.completion_tokens <= 4 and r.choices[0].finish_reason in ("stop", "length") for r in results)


def test_chat_over_http_equals_the_offline_llm_chat(served) -> None:
    """One conversation is one prompt everywhere: the HTTP API and LLM.chat render it alike, so
    greedy replies match token for token (the engines are the same seeded built-in model)."""
    from worker.llm import LLM

    server, _ = served
    messages = [{"role": "system", "content": "terse"}, {"role": "user", "content": "The quick brown fox"}]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    offline = LLM(dtype="float32", device="cpu").chat(messages, params)[0]
    response = client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True, extra_body={"ignore_eos": True}
    )
    tokenizer = ByteTokenizer()
    assert [e.token for e in response.choices[0].logprobs.content] == [
        tokenizer.decode([t], skip_special_tokens=False) for t in offline.token_ids
    ]
    assert response.choices[0].message.content == offline.text


def test_draining_finishes_open_streams_and_refuses_new_requests(served) -> None:
    """As on SIGTERM (cluster/deploy/serve.py): /health 503, new requests 503, open streams run to
    their end and [DONE] before the drain returns."""
    server, _ = served
    body = json.dumps(
        {"model": MODEL, "prompt": "drain " * 4, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    received = b""
    while received.count(b"data: ") < 2:
        received += sock.recv(4096)
    server.server.set_serving(False)
    drain = asyncio.run_coroutine_threadsafe(server.router.drain(60.0), server.loop)
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            client(server).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert caught.value.status_code == 503
        status = urllib_status(server, "/health")
        assert status == 503
        while chunk := sock.recv(65536):
            received += chunk
        assert drain.result(60) == 0  # nothing was left to fail
    finally:
        sock.close()
        server.router.set_accepting(True)
        server.server.set_serving(True)
    assert b"data: [DONE]" in received and b'"finish_reason":"length"' in received


def urllib_status(server, path: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(server.base_url.removesuffix("/v1") + path, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_a_client_that_leaves_a_non_streamed_request_aborts_it(served) -> None:
    server, engines = served
    body = json.dumps({"model": MODEL, "prompt": "wait " * 8, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: unary leaver\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # until it runs
        try:
            if server.router.get_request(client_request_id="unary leaver").state == "GENERATING":
                break
        except Exception:  # NOT_FOUND until admitted
            pass
        time.sleep(0.02)
    sock.close()
    while time.monotonic() < deadline:
        view = server.router.get_request(client_request_id="unary leaver")
        if view.final is not None:
            break
        time.sleep(0.05)
    assert view.state == "ABORTED" and view.final.usage.completion_tokens < 3000
    free = server.call(engines.cluster.free_blocks_settle())
    assert all(f == t for f, t in free.values()), free
