"""GPU checks (skipped without CUDA): the disaggregated flow with both instances' KV caches on the GPU.

A PREFILL and a GENERATION instance on CUDA, the KV exported from one device cache, pushed over real
gRPC on 127.0.0.1 and imported into the other, driven by the router in this process: the tokens equal
a MIXED CUDA instance's (greedy and seeded), every request goes through the disaggregated states, and
every block is free afterwards on both sides.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(300),
]

# The in-process cluster helper (no Ray) is shared with tests/integration.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))


# float32: the two sides batch the prompts differently, and bf16 rounding could then move a token.
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_cuda_disaggregated_equals_cuda_colocated(sampling: str) -> None:
    from local_cluster import GREEDY, PROMPTS, SEEDED, Cluster, run, states

    from cluster.router.api import Outcome
    from worker.protocol import InstanceRole

    params = GREEDY if sampling == "greedy" else SEEDED

    async def scenario():
        async with Cluster({"m0": InstanceRole.MIXED}, device="cuda") as colocated_cluster:
            colocated = [await colocated_cluster.run(p, params) for p in PROMPTS[:8]]
        roles = {"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}
        async with Cluster(roles, device="cuda") as disagg_cluster:
            results = await asyncio.gather(*(disagg_cluster.run(p, params) for p in PROMPTS[:8]))
            free = await disagg_cluster.free_blocks_settle()
            assert disagg_cluster.router.inconsistent_reports == 0
            assert all(i.engine.kv_cache.tensor.device.type == "cuda" for i in disagg_cluster.instances.values())
        for (ref_tokens, _), (tokens, final) in zip(colocated, results, strict=True):
            assert final.outcome is Outcome.COMPLETE, final.error_message
            assert tokens == ref_tokens
            assert "TRANSMISSION" in states(final)
            assert [u.phase for u in final.instances] == ["prefill", "generation"]
        assert all(f == t for f, t in free.values()), free

    run(scenario())
