"""The router with real engines in this process (no Ray): a cluster of Instance objects driven
through LocalInstanceClient, KV over real gRPC on 127.0.0.1. Shared by tests/integration (CPU) and
tests/gpu (the same flow on CUDA); it imports neither Ray nor pytest."""

from __future__ import annotations

import asyncio

from cluster.router.api import ClientRequest, FinalEvent, collect
from cluster.router.config import RouterConfig
from cluster.router.driver import Router
from cluster.router.instance_client import LocalInstanceClient
from worker.default_model import margin_corpus
from worker.engine_types import EngineConfig
from worker.instance import Instance, InstanceSpec
from worker.protocol import InstanceRole
from worker.sampling import SamplingParams
from worker.tokenizer import ByteTokenizer

TOKEN = "router-local-test-token-0123456789"
PROMPTS = margin_corpus(0, 16)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, top_k=40, seed=77, ignore_eos=True)


def make_instance(
    instance_id: str,
    role: InstanceRole,
    faults=None,
    num_blocks: int = 256,
    device: str = "cpu",
    dtype: str = "float32",
    engine: dict | None = None,
    data_plane: str = "auto",
) -> Instance:
    spec = InstanceSpec(
        instance_id,
        EngineConfig(**{"role": role, "num_blocks": num_blocks, "tokens_per_block": 16, "sender_lease_s": 30.0, **(engine or {})}),
        dtype=dtype,
        device=device,
        cluster_token=TOKEN,
        torch_threads=1,
        faults=faults,
        sender={"max_chunk_bytes": 64 * 1024, "data_plane": data_plane},
        receiver={"max_chunk_bytes": 64 * 1024, "data_plane": data_plane},
    )
    return Instance(spec)


def router_config(**overrides) -> RouterConfig:
    data = {
        "health": {"heartbeat_interval_s": 0.2, "dead_after_s": 1.5},
        "timeouts": {"context_s": 30.0, "reservation_s": 10.0, "transfer_s": 10.0, "generation_s": 60.0},
    }
    data.update(overrides)
    return RouterConfig.from_dict(data)


class Cluster:
    def __init__(
        self,
        roles: dict[str, InstanceRole],
        faults: dict | None = None,
        config: RouterConfig | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        engine: dict | None = None,
        data_plane: str = "auto",
    ):
        if config is None and InstanceRole.PREFILL not in roles.values():
            config = router_config(placement={"disaggregation": "never"})
        self.instances = {
            name: make_instance(
                name, role, (faults or {}).get(name), device=device, dtype=dtype, engine=engine, data_plane=data_plane
            )
            for name, role in roles.items()
        }
        self.clients = {name: LocalInstanceClient(inst) for name, inst in self.instances.items()}
        self.router = Router(
            config or router_config(), ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16, seed=5
        )

    async def __aenter__(self) -> Cluster:
        await self.router.start()
        for client in self.clients.values():
            await self.router.add_instance(client)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.router.stop()
        for name, instance in self.instances.items():
            if not self.clients[name].killed:
                instance.shutdown()

    async def run(self, prompt, params, **kw) -> tuple[list[int], FinalEvent]:
        return await collect(await self.router.submit(ClientRequest(None, tuple(prompt), params, **kw)))

    async def free_blocks_settle(self, timeout_s: float = 10.0) -> dict[str, tuple[int, int]]:
        """Wait until every live instance reports all blocks free (cached-but-free count as free)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            seen = {}
            for name, instance in self.instances.items():
                if self.clients[name].killed:
                    continue
                engine = instance.engine
                seen[name] = (engine.blocks.num_free_blocks, engine.blocks.num_blocks)
            if all(free == total for free, total in seen.values()) or loop.time() > deadline:
                return seen
            await asyncio.sleep(0.05)


def run(coro):
    return asyncio.run(coro)


def states(final: FinalEvent) -> list[str]:
    return [entry.state for entry in final.timeline]
