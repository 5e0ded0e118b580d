"""`duet bench --backend openai` drives the OpenAI HTTP API with the same runner as gRPC: the
load generator's HTTP client (cluster/loadgen/openai_client.py) against the real front end and
router over instant instances."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from openai_server import ServerThread

from cluster.cli.main import main
from cluster.client import DuetError
from cluster.client.sdk import Delta, Result
from cluster.loadgen.openai_client import OpenAIClient


def test_the_client_streams_token_ids_and_usage_and_maps_errors() -> None:
    async def scenario(url: str):
        async with OpenAIClient(url) as client:
            events = [event async for event in client.generate([1, 2, 3], max_tokens=5, temperature=0.0, ignore_eos=True, seed=4)]
            again = [event async for event in client.generate("hi", max_tokens=2)]  # the connection is reused
            with pytest.raises(DuetError) as caught:
                async for _ in client.generate([1, 999], max_tokens=2):
                    pass
            return events, again, caught.value, await client.health()

    with ServerThread() as server:
        events, again, error, healthy = asyncio.run(scenario(server.base_url))
    deltas = [e for e in events if isinstance(e, Delta)]
    result = events[-1]
    assert isinstance(result, Result) and result.finish_reason == "length"
    assert sum(len(d.token_ids) for d in deltas) == 5 and result.usage.completion_tokens == 5
    assert result.usage.prompt_tokens == 3
    assert isinstance(again[-1], Result) and again[-1].usage.completion_tokens == 2
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in error.message
    assert healthy


def test_duet_bench_backend_openai_completes_every_request(tmp_path, capsys) -> None:
    with ServerThread() as server:
        code = main([
            "bench", "--backend", "openai", "--target", server.base_url.removesuffix("/v1"), "--quick",
            "--no-plots", "--no-progress", "--out", str(tmp_path), "--concurrency", "4",
        ])  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["targets"]["completed_fraction"]["value"] == 1.0
