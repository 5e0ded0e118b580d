"""An overdue poll is a suspicion the router confirms with a probe (issue 18, "recover at the speed
of the failure"): a killed Ray actor's in-flight poll hangs for about 1.5 s before Ray fails it,
while Ray's own record says RESTARTING at once. Scripted instances make the poll hang for as long
as the test likes; dead_after_s (25 s) is far beyond the tests' bounds, so only the probe can end a wait."""

from __future__ import annotations

import asyncio

from scripted_instance import ScriptedInstance, until

from cluster.router.api import ClientRequest
from cluster.router.config import RouterConfig
from cluster.router.driver import Router
from cluster.router.instance_client import InstanceRejected, InstantInstanceClient
from worker.instant import InstantInstance, InstantNetwork
from worker.protocol import InstanceRole, PollBatch
from worker.sampling import SamplingParams
from worker.tokenizer import ByteTokenizer

CONFIG = RouterConfig.from_dict(
    {"health": {"heartbeat_interval_s": 0.05, "dead_after_s": 25.0, "probe_after_s": 0.05}, "placement": {"disaggregation": "never"}}
)


class HangingInstance(ScriptedInstance):
    """Its polls hang while `hung` is set (a killed process's in-flight call); `verdict` is what its
    probe says."""

    def __init__(self, instance_id: str, role: InstanceRole) -> None:
        super().__init__(instance_id, role)
        self.hung = False
        self.verdict: str | None = None
        self.probes = 0

    async def poll(self, timeout_s: float) -> PollBatch:
        while self.hung:
            await asyncio.sleep(0.01)
        return await super().poll(timeout_s)

    async def probe(self, timeout_s: float, incarnation: str) -> str | None:
        self.probes += 1
        assert incarnation == self.info.incarnation
        return self.verdict


async def _router(*instances: ScriptedInstance) -> Router:
    router = Router(CONFIG, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16, seed=1)
    await router.start()
    for instance in instances:
        await router.add_instance(instance)
    return router


def _member(router: Router, instance_id: str):
    member = router.fleet.get(instance_id)
    assert member is not None
    return member


def test_an_overdue_poll_whose_probe_says_the_actor_is_restarting_declares_the_instance_dead_at_once() -> None:
    async def run() -> None:
        m0, m1 = HangingInstance("m0", InstanceRole.MIXED), HangingInstance("m1", InstanceRole.MIXED)
        router = await _router(m0, m1)
        try:
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            await router.submit(ClientRequest(None, (256, 1, 2, 3), params, client_request_id="r"))
            await until(lambda: m0.called("submit") or m1.called("submit"))
            victim, survivor = (m0, m1) if m0.called("submit") else (m1, m0)
            victim.verdict = "Ray reports the actor RESTARTING"
            victim.hung = True
            # Recovered on the survivor long before dead_after_s (25 s): the probe confirmed it.
            await until(lambda: _member(router, victim.instance_id).dead and survivor.called("submit"), timeout_s=10.0)
            assert victim.probes >= 1
            assert survivor.probes == 0  # its polls answer in time: never probed
        finally:
            m0.hung = m1.hung = False
            await router.stop()

    asyncio.run(run())


def test_a_slow_probe_of_an_overdue_poll_proves_nothing() -> None:
    async def run() -> None:
        m0 = HangingInstance("m0", InstanceRole.MIXED)
        router = await _router(m0)
        try:
            m0.hung = True  # the probe finds nothing wrong (None): a loaded machine, not a death
            await until(lambda: m0.probes >= 1)
            await asyncio.sleep(0.3)
            assert not _member(router, "m0").dead
            m0.hung = False
            m0.report()
            await until(lambda: _member(router, "m0").health.name == "HEALTHY")
            assert not _member(router, "m0").dead
        finally:
            m0.hung = False
            await router.stop()

    asyncio.run(run())


def test_the_probe_of_an_instance_client_names_a_new_incarnation_or_a_refusal() -> None:
    async def run() -> None:
        client = InstantInstanceClient(InstantInstance("i0", InstanceRole.MIXED, InstantNetwork()))
        incarnation = await client.ping()
        assert await client.probe(0.5, incarnation) is None
        assert await client.probe(0.5, "an-older-incarnation") == "restarted (another incarnation answers)"

    asyncio.run(run())


class RestartingInstance(ScriptedInstance):
    """Counts the router's `restarted` calls; `refuse` makes them fail as a refused input would."""

    def __init__(self, instance_id: str, role: InstanceRole) -> None:
        super().__init__(instance_id, role)
        self.restarts_seen = 0
        self.refuse = False

    async def restarted(self) -> bool:
        self.restarts_seen += 1
        if self.refuse:
            raise InstanceRejected("tls", "plain TCP")
        return True


def test_a_new_incarnation_is_handed_what_its_spec_could_not_give_it_once_and_serves_even_if_that_fails() -> None:
    import msgspec

    async def run() -> None:
        m0 = RestartingInstance("m0", InstanceRole.MIXED)
        router = await _router(m0)
        try:
            m0.report()
            await until(lambda: _member(router, "m0").health.name == "HEALTHY")
            assert m0.restarts_seen == 0  # the first incarnation got everything in its spec
            m0.info = msgspec.structs.replace(m0.info, incarnation="incarnation-2")  # Ray restarted it
            m0.report()
            await until(lambda: m0.restarts_seen == 1 and not _member(router, "m0").dead)
            m0.report()
            m0.report()
            await asyncio.sleep(0.2)
            assert m0.restarts_seen == 1  # once per incarnation
            m0.refuse = True
            m0.info = msgspec.structs.replace(m0.info, incarnation="incarnation-3")
            m0.report()
            await until(lambda: m0.restarts_seen == 2)
            await until(lambda: not _member(router, "m0").dead and _member(router, "m0").info.incarnation == "incarnation-3")
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            await router.submit(ClientRequest(None, (256, 1, 2, 3), params, client_request_id="after"))
            await until(lambda: m0.called("submit"))  # it still serves
        finally:
            await router.stop()

    asyncio.run(run())
