"""The OpenAI HTTP API inside a real `duet serve` (Ray, local cluster, 1 PREFILL + 1 GENERATION,
built-in model): greedy tokens over HTTP equal the gRPC path's, and the SDK chats with it."""

from __future__ import annotations

import socket

import openai
import pytest
from cluster_harness import ClusterHarness

from cluster.deploy.config import ClusterConfig
from worker.default_model import margin_corpus
from worker.tokenizer import ByteTokenizer

PROMPTS = margin_corpus(0, 4)  # free of greedy near-ties


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def served(ray_cluster):
    config = ClusterConfig.from_dict(
        {
            "dtype": "float32",
            "device": "cpu",
            "instances": [{"role": "PREFILL", "count": 1, "num_cpus": 0.5}, {"role": "GENERATION", "count": 1, "num_cpus": 0.5}],
            "engine": {"num_blocks": 256, "tokens_per_block": 16},
            "frontend": {"port": 0, "metrics_port": 0, "http_port": _free_port()},
            "seed": 1,
        }
    )
    harness = ClusterHarness(config).start()
    yield harness
    harness.stop()


def test_greedy_tokens_over_http_equal_grpcs(served) -> None:
    cluster = served.cluster
    assert cluster.http_url.endswith("/v1")
    http = openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0, timeout=120)
    tokenizer = ByteTokenizer()
    with served.client(timeout_s=120) as grpc_client:
        for prompt in PROMPTS:
            expected = grpc_client.complete(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
            response = http.completions.create(
                model="duet-default", prompt=prompt, max_tokens=16, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True},
            )
            choice = response.choices[0]
            assert choice.logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in expected.token_ids]
            assert choice.text == expected.text and response.usage.completion_tokens == len(expected.token_ids)
    served.assert_no_router_bug()


def test_a_conversation_is_the_same_prompt_over_grpc_and_http(served) -> None:
    """GenerateRequest.messages and chat completions render one conversation alike (the served
    template), so greedy replies match token for token."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "The quick brown fox"}]
    http = openai.OpenAI(base_url=served.cluster.http_url, api_key="unused", max_retries=0, timeout=120)
    with served.client(timeout_s=120) as grpc_client:
        expected = grpc_client.complete(messages, max_tokens=12, temperature=0.0, ignore_eos=True)
    chat = http.chat.completions.create(
        model="duet-default", messages=messages, max_tokens=12, temperature=0, logprobs=True, extra_body={"ignore_eos": True}
    )
    tokenizer = ByteTokenizer()
    assert [e.token for e in chat.choices[0].logprobs.content] == [
        tokenizer.decode([t], skip_special_tokens=False) for t in expected.token_ids
    ]
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens == expected.usage.prompt_tokens
