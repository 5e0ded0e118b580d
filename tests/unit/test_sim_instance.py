"""The simulated instance (cluster/sim/instance.py) against the engine it stands for, and the simulated
cluster (cluster/sim/cluster.py) end to end on virtual time: roles, hand-over, pauses, prefix reuse,
transfer faults and instance deaths, with the router's invariants (every request ends once, only
legal transitions, no leaked blocks)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from cluster.deploy.config import ClusterConfig
from cluster.loadgen.arrivals import PoissonArrivals
from cluster.loadgen.workloads import BenchRequest, WorkloadConfig, WorkloadKind, build_workload
from cluster.sim.cluster import InstanceDeath, SimSettings, simulate
from cluster.sim.instance import SimInstance, SimNetwork
from cluster.sim.link import DATA_PLANES, Network
from cluster.sim.profile import StepProfile
from cluster.sim.vclock import run_virtual
from worker.engine_types import EngineConfig
from worker.protocol import RequestType, SubmitRequest
from worker.sampling import SamplingParams

PROFILE = StepProfile(
    name="test", source="measured", device="test", model="test", step_overhead_s=1e-3, prefill_s_per_token=2e-5,
    prefill_s_per_token_pair=1e-8, decode_s_per_sequence=2e-4, decode_s_per_context_token=1e-7,
    handover_fixed_s=1e-3, kv_bytes_per_token=4096,
)
SETTINGS = SimSettings(PROFILE, DATA_PLANES["grpc-25gbe"])


def _engine_config(**overrides) -> EngineConfig:
    base = dict(num_blocks=64, tokens_per_block=16, max_num_tokens=128, chunk_unit_tokens=64, max_batch_size=8,
                max_num_requests=8, enable_prefix_reuse=True)
    return EngineConfig().with_overrides(**(base | overrides))


PARITY_CASES = {
    "chunked prefill and decode": {},
    "pauses (MAX_UTILIZATION, a small pool)": {"num_blocks": 12, "capacity_policy": "MAX_UTILIZATION"},
    "prefix reuse, unchunked": {"chunking_policy": None, "max_num_tokens": 4096, "max_num_requests": 2},
}
MAX_TOKENS = 40


def _prompts() -> list[tuple[int, ...]]:
    shared = tuple(range(40, 88))
    return [shared + tuple(range(100 + i, 100 + i + 10 * (i + 1))) for i in range(6)]


@pytest.fixture(scope="module")
def default_model():
    torch = pytest.importorskip("torch")
    from worker.default_model import build_default_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend with the rest of the suite
    try:
        yield build_default_model()[:2]
    finally:
        torch.set_num_threads(threads)


def _engine_steps(config: EngineConfig, default_model) -> list[tuple[int, int, int, int]]:
    from worker.engine import Engine
    from worker.profiler import _BatchRecorder

    model, tokenizer = default_model
    box = []

    def factory(m, cache):
        box.append(_BatchRecorder(m, cache))
        return box[-1]

    engine = Engine(model, tokenizer, config, runner_factory=factory)
    for index, prompt in enumerate(_prompts()):
        params = SamplingParams(max_tokens=MAX_TOKENS + index, temperature=0.0, ignore_eos=True, seed=index)
        engine.add_request(SubmitRequest(f"r{index}", prompt, params, RequestType.CONTEXT_AND_GENERATION))
    steps = []
    while engine.num_requests:
        box[0].last = None
        engine.step()
        if box[0].last is not None:
            steps.append(box[0].last)
    return steps


def _sim_steps(config: EngineConfig) -> SimInstance:
    async def main():
        instance = SimInstance("m", config, PROFILE, SimNetwork(Network(DATA_PLANES["grpc-25gbe"])), rpc_latency_s=0.0)
        instance.step_log = []
        for index, prompt in enumerate(_prompts()):
            params = SamplingParams(max_tokens=MAX_TOKENS + index, temperature=0.0, ignore_eos=True, seed=index)
            await instance.submit(SubmitRequest(f"r{index}", prompt, params, RequestType.CONTEXT_AND_GENERATION))
        while instance.num_requests:
            await asyncio.sleep(0.01)
        instance.check_integrity()
        return instance

    return run_virtual(main())


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_simulated_instance_schedules_every_step_as_the_engine_does(case: str, default_model) -> None:
    # Same scheduler, same block manager, same order of block operations: the same batches, step by step.
    config = _engine_config(**PARITY_CASES[case])
    instance = _sim_steps(config)
    assert instance.step_log == _engine_steps(config, default_model)
    if "pauses" in case:
        assert instance.stats.pauses > 0
    if "reuse" in case:  # a first chunk that starts past cached blocks attends more than its own tokens
        assert any(ctx and pairs > ctx * (ctx + 1) // 2 and cached for ctx, pairs, _, _, cached in instance.step_log)


def _cluster(groups: list[tuple[str, int]], **engine) -> ClusterConfig:
    return ClusterConfig.from_dict({
        "instances": [{"role": role, "count": count} for role, count in groups],
        "engine": {"num_blocks": 512, "max_batch_size": 16, "max_num_requests": 16, **engine},
    })


def _requests(count: int = 24, **workload):
    return build_workload(WorkloadConfig(**({"num_requests": count, "input_len": 96, "output_len": 12} | workload)), 0)


def _check_invariants(outcome) -> None:
    assert outcome.router["illegal_transitions"] == 0
    assert outcome.router["inconsistent_reports"] == 0
    assert outcome.leaked_blocks == 0
    assert outcome.held_requests == 0


def test_a_disaggregated_cluster_serves_a_workload_on_virtual_time() -> None:
    outcome = simulate(_cluster([("PREFILL", 1), ("GENERATION", 2)]), SETTINGS, _requests(), PoissonArrivals(50.0))
    metrics = outcome.point.metrics
    assert metrics.completed == 24 and metrics.failed == 0
    _check_invariants(outcome)
    assert outcome.router["transfers"]["committed"] == 24
    assert outcome.transfer_bytes == sum(r.bytes_received for r in outcome.instances) > 0
    assert 0 < metrics.ttft_ms.p50 < 1000 and metrics.tpot_ms.p50 > 0
    assert outcome.virtual_s > 0 and outcome.wall_s < 30
    # Virtual time: a rerun gives the same latencies to the last digit.
    again = simulate(_cluster([("PREFILL", 1), ("GENERATION", 2)]), SETTINGS, _requests(), PoissonArrivals(50.0))
    assert [r.ttft_s for r in again.point.outcome.records] == [r.ttft_s for r in outcome.point.outcome.records]


def test_mixed_instances_run_colocated_and_reuse_shared_prefixes() -> None:
    workload = dict(kind=WorkloadKind.SHARED_PREFIX, num_prefixes=2, suffixes_per_prefix=6, prefix_len=128)
    config = _cluster([("MIXED", 2)])
    outcome = simulate(config, SETTINGS, _requests(**workload), PoissonArrivals(20.0))
    assert outcome.point.metrics.completed == 12
    assert outcome.point.metrics.prefix_cache_hit_rate > 0.3
    assert outcome.transfer_bytes == 0
    _check_invariants(outcome)


def test_a_small_pool_pauses_and_recomputes_without_losing_a_request() -> None:
    config = _cluster([("MIXED", 1)], num_blocks=40, capacity_policy="MAX_UTILIZATION")
    outcome = simulate(config, SETTINGS, _requests(16), PoissonArrivals(1000.0))
    assert outcome.point.metrics.completed == 16
    assert sum(r.pauses for r in outcome.instances) > 0
    _check_invariants(outcome)


def test_transfer_faults_from_the_fault_plan_are_recovered() -> None:
    config = ClusterConfig.from_dict({
        "instances": [{"role": "PREFILL", "count": 1}, {"role": "GENERATION", "count": 2}],
        "engine": {"num_blocks": 512},
        "faults": {"seed": 3, "rules": [{"kind": "corrupt", "scope": "transfer", "probability": 0.5}]},
    })
    outcome = simulate(config, SETTINGS, _requests(), PoissonArrivals(50.0))
    assert outcome.point.metrics.completed == 24
    assert sum(r.transfers_failed for r in outcome.instances) > 0
    assert outcome.router["recovery_actions"]
    _check_invariants(outcome)
    # The fault plan draws from each request's id: the router gives the simulation's requests the
    # same ids in every run, so a rerun meets the same faults and gives the same results.
    again = simulate(config, SETTINGS, _requests(), PoissonArrivals(50.0))
    assert again.router == outcome.router
    assert [(r.end_s, r.chunk_times_s) for r in again.point.outcome.records] == [(r.end_s, r.chunk_times_s) for r in outcome.point.outcome.records]


@pytest.mark.parametrize("reserve", ["at_context_done", "at_context_start"])
def test_a_stalled_push_is_cancelled_when_the_transfer_is_retried_elsewhere(monkeypatch, reserve) -> None:
    """A push that stalls is given up by the router (TRANSMISSION's bound, about 2 s for this KV)
    and the transfer retried to the other generation instance. As worker/instance.py does, the
    prefill instance cancels the stalled push when the retry's push comes, instead of letting it
    pin the blocks until its deadline (the transfer deadline, 60 s, for a push relayed during the
    prefill); the request ends handed over, never with a push in flight, and nothing is left."""
    ends = []
    finish = SimInstance._finish

    def recording(self, request, *args, **kwargs):
        ends.append((self.role.name, request.pushes, kwargs.get("handed_over", False), self._now()))
        return finish(self, request, *args, **kwargs)

    monkeypatch.setattr(SimInstance, "_finish", recording)
    config = ClusterConfig.from_dict({
        "instances": [{"role": "PREFILL", "count": 1}, {"role": "GENERATION", "count": 2}],
        "engine": {"num_blocks": 512},
        "router": {"handover": {"reserve": reserve}},
        "faults": {"seed": 1, "rules": [{"kind": "stall", "scope": "transfer", "probability": 1.0, "max_fires": 3}]},
    })
    outcome = simulate(config, SETTINGS, _requests(6), PoissonArrivals(20.0))
    assert outcome.point.metrics.completed == 6
    assert outcome.router["recovery_actions"] == {"retry_transfer": 3}, outcome.router
    assert outcome.router["transfers"]["failed_CANCELLED"] == 3, outcome.router
    _check_invariants(outcome)
    handed_over = [(pushes, at_s) for role, pushes, handed, at_s in ends if role == "PREFILL" and handed]
    assert len(handed_over) == 6 and all(pushes == 0 for pushes, _ in handed_over)
    assert all(at_s < 10.0 for _, at_s in handed_over), handed_over  # none waited for a deadline


def test_an_instance_death_is_detected_on_virtual_time_and_its_requests_recovered() -> None:
    settings = SimSettings(PROFILE, deaths=(InstanceDeath("generation-0", at_s=0.2),))
    config = _cluster([("PREFILL", 1), ("GENERATION", 2)])
    outcome = simulate(config, settings, _requests(40, output_len=200), PoissonArrivals(100.0))
    records = outcome.point.outcome.records
    assert len(records) == 40 and outcome.point.metrics.completed >= 30
    assert outcome.router["recovery_actions"]
    # Detected on the simulated clock (two failed polls in a row, cluster/router/fleet.py), well
    # before the health bound's silence, and the run went on after it.
    assert outcome.virtual_s > settings.deaths[0].at_s + 2 * min(0.2, config.router.health.heartbeat_interval_s)
    assert outcome.wall_s < 30
    # A death of an instance the cluster does not have is refused before anything runs.
    unknown = SimSettings(PROFILE, deaths=(InstanceDeath("generation-2", at_s=0.2),))
    with pytest.raises(ValueError, match=r"no instance 'generation-2' \(instances: prefill-0, generation-0 to generation-1\)"):
        simulate(config, unknown, _requests(4), PoissonArrivals(100.0))


@pytest.mark.parametrize("stream_interval_s", [0.0, 0.05])
def test_a_landed_hand_over_is_reported_with_the_token_of_its_first_decode_step(monkeypatch, stream_interval_s) -> None:
    """As the real instance does (worker/instance.py _AFTER_THE_STEP; its test is in
    tests/integration/test_router_local.py): the commit and the decode step taking it up reach the
    router in the poll answer that carries that step's token, not in one of their own mid-step."""
    from scheduler.state import LlmRequestState as L

    batches = []
    polled = SimInstance.poll

    async def recording(self, timeout_s):
        batch = await polled(self, timeout_s)
        if self.role.name == "GENERATION":
            batches.append(batch)
        return batch

    monkeypatch.setattr(SimInstance, "poll", recording)
    settings = SimSettings(PROFILE, DATA_PLANES["grpc-25gbe"], stream_interval_s=stream_interval_s)
    outcome = simulate(_cluster([("PREFILL", 1), ("GENERATION", 1)]), settings, _requests(12, output_len=20), PoissonArrivals(30.0))
    assert outcome.point.metrics.completed == 12
    _check_invariants(outcome)
    landed = [(b, e.request_id) for b in batches for e in b.events if e.state is L.DISAGG_GENERATION_TRANS_COMPLETE]
    assert len(landed) == 12
    for batch, request_id in landed:
        mine = [event.state for event in batch.events if event.request_id == request_id]
        assert mine[:2] == [L.DISAGG_GENERATION_TRANS_COMPLETE, L.GENERATION_IN_PROGRESS], mine
        assert any(o.request_id == request_id and o.new_token_ids for o in batch.outputs), batch


def test_a_stream_interval_merges_tokens_but_keeps_ttft_tpot_and_e2e_exact() -> None:
    config = _cluster([("PREFILL", 1), ("GENERATION", 1)])
    requests = _requests(20, output_len=40)
    every_step = simulate(config, SETTINGS, requests, PoissonArrivals(40.0))
    merged = simulate(config, SimSettings(PROFILE, stream_interval_s=0.05), requests, PoissonArrivals(40.0))
    for a, b in zip(every_step.point.outcome.records, merged.point.outcome.records, strict=True):
        assert (a.ttft_s, a.e2e_s, a.output_tokens) == pytest.approx((b.ttft_s, b.e2e_s, b.output_tokens), abs=1e-12)
        assert a.tpot_s == pytest.approx(b.tpot_s, abs=1e-12)
        assert len(b.chunk_times_s) < len(a.chunk_times_s)  # fewer, larger token messages
    _check_invariants(merged)


def test_the_configured_stream_interval_is_simulated_unless_the_settings_name_one() -> None:
    """engine.stream_interval_ms, which served instances apply (worker/stream_merge.py), is what a
    simulation of that configuration merges by, unless its settings (--stream-interval-ms) say."""
    config = _cluster([("PREFILL", 1), ("GENERATION", 1)], stream_interval_ms=50)
    requests = _requests(20, output_len=40)
    configured = simulate(config, SETTINGS, requests, PoissonArrivals(40.0))
    named = simulate(_cluster([("PREFILL", 1), ("GENERATION", 1)]), SimSettings(PROFILE, stream_interval_s=0.05), requests, PoissonArrivals(40.0))
    overridden = simulate(config, SimSettings(PROFILE, stream_interval_s=0.0), requests, PoissonArrivals(40.0))
    every_step = simulate(_cluster([("PREFILL", 1), ("GENERATION", 1)]), SETTINGS, requests, PoissonArrivals(40.0))
    chunks = [[len(r.chunk_times_s) for r in outcome.point.outcome.records] for outcome in (configured, named, overridden, every_step)]
    assert chunks[0] == chunks[1] and chunks[2] == chunks[3] and sum(chunks[0]) < sum(chunks[3])


def test_the_router_figures_of_a_run_with_several_recovery_actions_are_json() -> None:
    import json

    config = ClusterConfig.from_dict({
        "instances": [{"role": "PREFILL", "count": 1}, {"role": "GENERATION", "count": 2}],
        "engine": {"num_blocks": 512},
        "faults": {"seed": 3, "rules": [{"kind": "corrupt", "scope": "transfer", "probability": 0.9}]},
    })
    outcome = simulate(config, SETTINGS, _requests(), PoissonArrivals(50.0))
    assert len(outcome.router["recovery_actions"]) >= 2, outcome.router
    assert json.loads(json.dumps(outcome.router, sort_keys=True)) == outcome.router


def test_a_request_no_pool_can_hold_is_refused_at_once_not_left_waiting() -> None:
    # 8 blocks of 16 tokens per instance: 100 prompt tokens + 40 new ones need 9.
    config = _cluster([("PREFILL", 1), ("GENERATION", 1)], num_blocks=8)
    requests = (BenchRequest(0, tuple(range(1, 101)), 40), BenchRequest(1, tuple(range(1, 61)), 20))
    outcome = simulate(config, SETTINGS, requests, PoissonArrivals(10.0))
    big, small = outcome.point.outcome.records
    assert big.status == "INVALID_ARGUMENT" and "needs 9 KV blocks" in big.message and "could never run here" in big.message
    assert small.ok and small.output_tokens == 20
    # Refused at submission, not after the context stage's timeout (600 s by default).
    assert outcome.virtual_s < 5
    _check_invariants(outcome)


def _load_figures(load) -> tuple[int, ...]:
    return (load.queued_requests, load.running_requests, load.queued_prompt_tokens, load.pending_context_tokens,
            load.tokens_in_flight, load.free_blocks)


def test_a_simulated_instance_reports_the_load_the_engine_does_after_every_step(default_model) -> None:
    """The router places by these (cluster/router/placement.py): a context in progress is pending
    for every chunk still to run, though no longer queued."""
    from worker.engine import Engine
    from worker.profiler import _BatchRecorder

    config = _engine_config(max_num_requests=3, max_num_tokens=32, chunk_unit_tokens=16)  # prompts of 58-108 tokens: several steps each; the rest wait
    model, tokenizer = default_model
    box = []

    def factory(m, cache):
        box.append(_BatchRecorder(m, cache))
        return box[-1]

    def submits():
        for index, prompt in enumerate(_prompts()):
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, seed=index)
            yield SubmitRequest(f"r{index}", prompt, params, RequestType.CONTEXT_AND_GENERATION)

    engine = Engine(model, tokenizer, config, runner_factory=factory)
    for submit in submits():
        engine.add_request(submit)
    engine_loads = []
    while engine.num_requests:
        box[0].last = None
        engine.step()
        if box[0].last is not None:
            engine_loads.append(_load_figures(engine.load()))

    async def main():
        instance = SimInstance("m", config, PROFILE, SimNetwork(Network(DATA_PLANES["grpc-25gbe"])), rpc_latency_s=0.0)
        loads = []
        complete = instance._complete

        def recorded(schedule, *step):
            complete(schedule, *step)
            loads.append(_load_figures(instance.load()))

        instance._complete = recorded
        for submit in submits():
            await instance.submit(submit)
        while instance.num_requests:
            await asyncio.sleep(0.01)
        return loads

    sim_loads = run_virtual(main())
    assert sim_loads == engine_loads
    queued, pending = 2, 3
    assert any(figures[pending] > figures[queued] for figures in engine_loads)  # contexts in progress, counted
    assert engine_loads[-1][pending] == 0


def test_a_hand_over_to_an_instance_mid_step_takes_the_profile_s_busy_control_path(monkeypatch) -> None:
    """`handover_busy_s` (duet profile --deployed measures it: the receiver shares a busy instance's
    cores) is charged when the receiving instance is mid-step as the push starts; otherwise, and
    for profiles without it, `handover_fixed_s`."""
    from cluster.sim.handover import HandoverSide

    started, took = {}, []
    transfer, done = HandoverSide._transfer, HandoverSide._transfer_done

    def recording_transfer(self, request, target, transfer_id, deadline_s, target_request_id):
        receiver = self.net.by_address[target]
        started[transfer_id] = (self._now(), receiver._stepping)
        return transfer(self, request, target, transfer_id, deadline_s, target_request_id)

    def recording_done(self, request, receiver, transfer_id, target_request_id, num_bytes, *rest):
        start_s, busy = started[transfer_id]
        took.append((busy, self._now() - start_s - self.net.network.link.transfer_s(num_bytes)))
        return done(self, request, receiver, transfer_id, target_request_id, num_bytes, *rest)

    monkeypatch.setattr(HandoverSide, "_transfer", recording_transfer)
    monkeypatch.setattr(HandoverSide, "_transfer_done", recording_done)
    busy_profile = dataclasses.replace(PROFILE, handover_busy_s=0.02)
    for profile in (PROFILE, busy_profile):
        took.clear()
        outcome = simulate(_cluster([("PREFILL", 1), ("GENERATION", 1)]), SimSettings(profile, DATA_PLANES["grpc-25gbe"]),
                           _requests(12, output_len=20), PoissonArrivals(30.0))
        assert outcome.point.metrics.completed == 12
        _check_invariants(outcome)
        assert len(took) == 12 and {busy for busy, _ in took} == {True, False}  # both kinds happen
        for busy, control_s in took:
            expected = profile.handover_busy_s if busy and profile.handover_busy_s is not None else profile.handover_fixed_s
            assert control_s == pytest.approx(expected, abs=5e-4)  # the NIC queue may add a little
