"""What the router's status and metrics say, checked against a real router over instant instances:
the idle in-flight gauge, the token counters and ITL, no `_created` series, the served model, the
metrics server's one path, and ClusterStatus's recovery chain and policy names."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest

from cluster.router.api import ClientRequest, FinalEvent, Outcome
from cluster.router.config import RouterConfig
from cluster.router.driver import Router
from cluster.router.instance_client import InstantInstanceClient
from cluster.router.observe import ModelInfo, RouterMetrics
from worker.instant import InstantInstance, InstantNetwork
from worker.protocol import InstanceRole
from worker.sampling import SamplingParams
from worker.tokenizer import ByteTokenizer

CONFIG = {
    "health": {"heartbeat_interval_s": 0.05, "dead_after_s": 5.0},
    "placement": {"prefill_policy": {"name": "kv_aware"}, "generation_policy": {"name": "least_loaded"}},
    "recovery": {"chain": [{"action": "retry_transfer", "max_attempts": 2}, {"action": "recompute_local"}, {"action": "fail"}]},
}


async def _serve_requests(metrics: RouterMetrics, count: int, model_info: ModelInfo | None = None):
    network = InstantNetwork()
    router = Router(
        RouterConfig.from_dict(CONFIG), ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16,
        seed=3, metrics=metrics, model_info=model_info,
    )
    await router.start()
    try:
        for name, role in {"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}.items():
            await router.add_instance(InstantInstanceClient(InstantInstance(name, role, network)))
        finals = []
        for i in range(count):
            params = SamplingParams(max_tokens=5, temperature=0.0, seed=i, ignore_eos=True)
            handle = await router.submit(ClientRequest(None, tuple(range(1, 21)), params, client_request_id=f"r{i}"))
            async for event in handle.events():
                if isinstance(event, FinalEvent):
                    finals.append(event)
        return finals, router.cluster_status()
    finally:
        await router.stop()


def _sample(metrics: RouterMetrics, name: str, labels: dict[str, str] | None = None) -> float | None:
    return metrics.registry.get_sample_value(name, labels or {})


def test_metrics_after_requests_and_when_idle() -> None:
    metrics = RouterMetrics()
    finals, status = asyncio.run(_serve_requests(metrics, 3))
    assert [final.outcome for final in finals] == [Outcome.COMPLETE] * 3
    assert _sample(metrics, "duet_router_in_flight") == 0.0
    assert _sample(metrics, "duet_router_queue_depth") == 0.0
    assert _sample(metrics, "duet_prompt_tokens_total") == 3 * 20
    assert _sample(metrics, "duet_generation_tokens_total") == 3 * 5
    itl_count = _sample(metrics, "duet_itl_seconds_count")
    assert itl_count is not None and 0 < itl_count <= 3 * 4
    assert _sample(metrics, "duet_instance_kv_utilization_ratio", {"instance": "g0", "role": "GENERATION"}) is not None
    names = {sample.name for family in metrics.registry.collect() for sample in family.samples}
    assert not [name for name in names if name.endswith("_created")]
    assert "duet_instance_kv_utilization" not in names


def test_cluster_status_names_the_recovery_chain_policies_and_model() -> None:
    model = ModelInfo("built-in", "LlamaForCausalLM", "float32", 4096, 1024)
    _, status = asyncio.run(_serve_requests(RouterMetrics(), 1, model))
    assert status.model == model
    assert status.fallbacks == ("retry_transfer x2", "recompute_local", "fail")
    assert status.max_recovery_attempts == 3
    assert status.placement_policy == (
        "prefill=kv_aware, generation=least_loaded, disaggregation=always, allowed_fallbacks=none"
    )


def test_model_info_is_exported() -> None:
    metrics = RouterMetrics()
    metrics.set_model(ModelInfo("/models/llama", "LlamaForCausalLM", "float32", 2048, 4096))
    labels = {
        "model": "/models/llama", "architecture": "LlamaForCausalLM", "dtype": "float32",
        "max_model_len": "2048", "kv_capacity_tokens": "4096",
    }
    assert _sample(metrics, "duet_model_info", labels) == 1.0


def test_the_metrics_server_serves_metrics_only() -> None:
    metrics = RouterMetrics()
    port = metrics.serve("127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
            assert response.status == 200 and b"duet_router_in_flight 0.0" in response.read()
        for path, method, status in (("/", "GET", 404), ("/v1/chat/completions", "POST", 404), ("/metrics", "POST", 405)):
            request = urllib.request.Request(f"{base}{path}", data=b"{}" if method == "POST" else None, method=method)
            with pytest.raises(urllib.error.HTTPError) as error:
                urllib.request.urlopen(request, timeout=10)
            assert error.value.code == status, (path, method)
    finally:
        metrics.close()
