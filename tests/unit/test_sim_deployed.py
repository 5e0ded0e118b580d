"""A profile measured as deployed (cluster/sim/deployed.py) and the control path it carries: the
instances' step logs (worker/profiler.py StepLog) and how they are read and fitted, and the
simulator's use of the measured call and front-end latencies (cluster/sim/cluster.py SimSettings,
cluster/sim/client.py). Deterministic: virtual time and synthetic steps, no timing assertions."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import pytest

from cluster.deploy.config import ClusterConfig
from cluster.loadgen.arrivals import PoissonArrivals
from cluster.loadgen.workloads import WorkloadConfig, build_workload
from cluster.sim import deployment_logs as logs
from cluster.sim.cluster import DEFAULT_RPC_LATENCY_S, SimSettings, build_instances, simulate
from cluster.sim.link import DATA_PLANES
from cluster.sim.profile import ProfileError, StepProfile, context_pairs

PROFILE = StepProfile(
    name="test", source="measured", device="test", model="test", step_overhead_s=1e-3, prefill_s_per_token=2e-5,
    prefill_s_per_token_pair=1e-8, decode_s_per_sequence=2e-4, decode_s_per_context_token=1e-7,
    handover_fixed_s=1e-3, kv_bytes_per_token=4096,
)


def _cluster(groups: list[tuple[str, int]]) -> ClusterConfig:
    return ClusterConfig.from_dict({
        "instances": [{"role": role, "count": count} for role, count in groups],
        "engine": {"num_blocks": 512, "max_batch_size": 16, "max_num_requests": 16},
    })


def _requests(count: int = 12):
    return build_workload(WorkloadConfig(num_requests=count, input_len=96, output_len=12), 0)


def test_measured_control_path_fields_round_trip_and_are_checked() -> None:
    measured = dataclasses.replace(PROFILE, rpc_latency_s=1.5e-3, frontend_latency_s=0.7e-3)
    again = StepProfile.from_dict(json.loads(json.dumps(measured.to_dict())))
    assert (again.rpc_latency_s, again.frontend_latency_s) == (1.5e-3, 0.7e-3)
    assert StepProfile.from_dict(PROFILE.to_dict()).rpc_latency_s is None  # older profiles: not measured
    with pytest.raises(ProfileError, match="rpc_latency_s"):
        dataclasses.replace(PROFILE, rpc_latency_s=-1.0)
    with pytest.raises(ProfileError, match="frontend_latency_s"):
        dataclasses.replace(PROFILE, frontend_latency_s="fast")


def test_the_profile_s_measured_call_latency_applies_unless_the_settings_name_one() -> None:
    config = _cluster([("PREFILL", 1), ("GENERATION", 1)])
    assert SimSettings(PROFILE).rpc_s == DEFAULT_RPC_LATENCY_S and SimSettings(PROFILE).frontend_s == 0.0
    measured = dataclasses.replace(PROFILE, rpc_latency_s=2e-3, frontend_latency_s=1e-3)
    instances, _ = build_instances(config, SimSettings(measured))
    assert {instance.rpc_latency_s for instance in instances} == {2e-3}
    instances, _ = build_instances(config, SimSettings(measured, rpc_latency_s=0.0, frontend_latency_s=0.0))
    assert {instance.rpc_latency_s for instance in instances} == {0.0}
    assert SimSettings(measured).frontend_s == 1e-3


def test_a_slower_call_latency_delays_every_first_token() -> None:
    config = _cluster([("PREFILL", 1), ("GENERATION", 1)])
    fast = simulate(config, SimSettings(PROFILE, DATA_PLANES["grpc-loopback"], rpc_latency_s=0.5e-3), _requests(), PoissonArrivals(5.0))
    slow = simulate(config, SimSettings(PROFILE, DATA_PLANES["grpc-loopback"], rpc_latency_s=3e-3), _requests(), PoissonArrivals(5.0))
    pairs = zip(fast.point.outcome.records, slow.point.outcome.records, strict=True)
    # At least a submit and a poll's answer stand between a request and its first token.
    assert all(b.ttft_s >= a.ttft_s + 2 * (3e-3 - 0.5e-3) - 1e-9 for a, b in pairs)


def test_the_front_end_latency_is_paid_on_the_way_in_and_on_every_message_out() -> None:
    config = _cluster([("PREFILL", 1), ("GENERATION", 1)])
    latency_s = 4e-3
    direct = simulate(config, SimSettings(PROFILE, frontend_latency_s=0.0), _requests(), PoissonArrivals(5.0))
    fronted = simulate(config, SimSettings(PROFILE, frontend_latency_s=latency_s), _requests(), PoissonArrivals(5.0))
    for a, b in zip(direct.point.outcome.records, fronted.point.outcome.records, strict=True):
        # The same run shifted by the way in; each message arrives one way out later (not queued
        # behind the previous message's delay): TTFT and e2e grow by both ways, TPOT not at all.
        assert b.ttft_s == pytest.approx(a.ttft_s + 2 * latency_s, abs=1e-9)
        assert b.e2e_s == pytest.approx(a.e2e_s + 2 * latency_s, abs=1e-9)
        assert b.tpot_s == pytest.approx(a.tpot_s, abs=1e-9)
        assert len(b.chunk_times_s) == len(a.chunk_times_s)
    assert fronted.point.metrics.completed == len(_requests())


def test_step_logs_are_read_from_a_given_time_with_the_loop_s_or_the_engine_s_seconds(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from worker.profiler import StepLog, read_step_logs

    path = tmp_path / "steps" / "prefill-0.jsonl"
    log = StepLog(path)

    class Recorder:  # what the runner seam recorded of the step's batch
        last: tuple[int, int, int, int, int] | None = None

    log.recorder = Recorder()  # type: ignore[assignment]
    log.recorder.last = (32, context_pairs(96, 32), 0, 0, 96)  # a 32-token chunk on 96 cached tokens
    log.record(0.010, 0.011)
    log.record(0.5, 0.5)  # no forward pass since the last record: nothing written
    log.recorder.last = (0, 0, 4, 400, 0)
    log.record(0.002, 0.003)
    log.close()
    with path.open("a") as file:
        file.write('{"t": 1, "ctx": 3')  # a line cut by a kill
    samples = read_step_logs([path])
    assert [(s.context_tokens, s.context_cached_tokens, s.decode_sequences, s.step_s) for s in samples] == [(32, 96, 0, 0.011), (0, 0, 4, 0.003)]
    # A log written before the cached tokens were recorded: read as none.
    old = tmp_path / "old.jsonl"
    old.write_text('{"t": 5.0, "ctx": 64, "pairs": 2080, "seqs": 0, "dctx": 0, "s": 0.01, "loop_s": 0.012}\n')
    assert [(s.context_tokens, s.context_cached_tokens, s.step_s) for s in read_step_logs([old])] == [(64, 0, 0.012)]
    assert [s.step_s for s in read_step_logs([path], seconds="s")] == [0.010, 0.002]
    last_t = json.loads(path.read_text().splitlines()[1])["t"]
    assert [s.decode_sequences for s in read_step_logs([path], since_s=last_t)] == [4]


def test_the_mean_fit_meets_the_mean_step_where_the_default_fit_meets_the_fast_ones() -> None:
    pytest.importorskip("torch")
    from worker.profiler import StepSample, fit

    samples = []
    for seqs in (1, 4, 16):
        fast = 1e-3 + 1e-4 * seqs
        for slow_factor in (1.0, 1.0, 3.0):  # every third step of each shape was slowed down (shared cores)
            samples.append(StepSample(0, 0, seqs, 0, fast * slow_factor))
    mean_fit, _ = fit(samples, trim_fraction=0.0, mean=True)
    typical_fit, _ = fit(samples, trim_fraction=0.0)
    for seqs in (1, 4, 16):
        fast = 1e-3 + 1e-4 * seqs
        assert mean_fit["step_overhead_s"] + mean_fit["decode_s_per_sequence"] * seqs == pytest.approx(fast * 5 / 3, rel=1e-6)
        assert typical_fit["step_overhead_s"] + typical_fit["decode_s_per_sequence"] * seqs < fast * 5 / 3 * 0.9


def test_an_instance_logs_each_step_it_runs_with_its_batch(tmp_path: Path) -> None:
    pytest.importorskip("torch")


    from worker.engine_types import EngineConfig
    from worker.instance import Instance, InstanceSpec
    from worker.profiler import read_step_logs
    from worker.protocol import (
        Decoder,
        Encoder,
        InstanceRole,
        Poll,
        PollBatch,
        Reply,
        RequestType,
        Submit,
        SubmitRequest,
    )
    from worker.sampling import SamplingParams

    path = tmp_path / "m0.jsonl"
    engine = EngineConfig(role=InstanceRole.MIXED, num_blocks=16, tokens_per_block=16)
    instance = Instance(InstanceSpec("m0", engine, dtype="float32", device="cpu", torch_threads=1, step_log=str(path)))
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        request = SubmitRequest("r", tuple(range(40, 60)), params, RequestType.CONTEXT_AND_GENERATION)
        instance.handle(Encoder().encode(Submit(request)))
        deadline = time.monotonic() + 60
        finished = False
        while not finished and time.monotonic() < deadline:
            batch = Decoder(Reply).decode(instance.handle(Encoder().encode(Poll(1.0))))
            assert isinstance(batch, PollBatch)
            finished = any(output.finished for output in batch.outputs)
        assert finished
    finally:
        instance.shutdown()
    samples = read_step_logs([path])
    # The context (20 tokens), then three single-request decode steps at a growing context.
    assert [(s.context_tokens, s.context_pairs, s.decode_sequences, s.decode_context_tokens) for s in samples] == [
        (20, context_pairs(0, 20), 0, 0), (0, 0, 1, 21), (0, 0, 1, 22), (0, 0, 1, 23),
    ]
    assert all(s.step_s > 0 for s in samples)


def test_a_step_with_context_pays_the_context_step_cost_and_a_decode_step_does_not() -> None:
    with_cost = dataclasses.replace(PROFILE, context_step_s=0.05)
    assert with_cost.step_s(96, context_pairs(0, 96), 0, 0) == pytest.approx(PROFILE.step_s(96, context_pairs(0, 96), 0, 0) + 0.05)
    assert with_cost.step_s(0, 0, 4, 400) == PROFILE.step_s(0, 0, 4, 400)
    # Applied by the simulated instances: requests far apart, each prefilled in one step of its own.
    config = _cluster([("MIXED", 1)])
    plain = simulate(config, SimSettings(PROFILE), _requests(6), PoissonArrivals(1.0))
    costly = simulate(config, SimSettings(with_cost), _requests(6), PoissonArrivals(1.0))
    for a, b in zip(plain.point.outcome.records, costly.point.outcome.records, strict=True):
        assert b.ttft_s == pytest.approx(a.ttft_s + 0.05, abs=1e-9)
        assert b.tpot_s == pytest.approx(a.tpot_s, abs=1e-9)


def test_a_profile_s_spread_scales_each_simulated_step_by_a_seeded_draw() -> None:
    spread = dataclasses.replace(PROFILE, step_time_ratios=(0.5, 1.0, 1.5))
    assert [spread.step_factor(u) for u in (0.0, 1 / 6, 0.25, 0.5, 5 / 6, 0.99)] == pytest.approx([0.5, 0.5, 0.625, 1.0, 1.5, 1.5])
    assert PROFILE.step_factor(0.3) == 1.0  # no spread listed: the model's time
    assert StepProfile.from_dict(json.loads(json.dumps(spread.to_dict()))) == spread
    with pytest.raises(ProfileError, match="step_time_ratios"):
        dataclasses.replace(PROFILE, step_time_ratios=(1.5, 0.5))
    config = _cluster([("MIXED", 1)])
    # Every step twice the model's: a lone request's TTFT is its one prefill step, doubled.
    plain = simulate(config, SimSettings(PROFILE, rpc_latency_s=0.0), _requests(6), PoissonArrivals(1.0))
    doubled = simulate(config, SimSettings(dataclasses.replace(PROFILE, step_time_ratios=(2.0,)), rpc_latency_s=0.0), _requests(6), PoissonArrivals(1.0))
    for a, b in zip(plain.point.outcome.records, doubled.point.outcome.records, strict=True):
        assert b.ttft_s == pytest.approx(2 * a.ttft_s, abs=1e-9)
        assert b.tpot_s == pytest.approx(2 * a.tpot_s, abs=1e-9)
    # A spread: steps differ from one another, and a rerun with the same seed is the same run.
    first = simulate(config, SimSettings(spread), _requests(6), PoissonArrivals(1.0))
    again = simulate(config, SimSettings(spread), _requests(6), PoissonArrivals(1.0))
    assert [r.chunk_times_s for r in first.point.outcome.records] == [r.chunk_times_s for r in again.point.outcome.records]
    gaps = [b - a for r in first.point.outcome.records for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:], strict=False)]
    assert max(gaps) > 2 * min(gaps)


def test_contention_slows_a_simulated_step_by_the_share_of_the_other_instances_mid_step() -> None:
    from cluster.sim.instance import SimInstance, SimNetwork
    from cluster.sim.link import Network
    from cluster.sim.vclock import run_virtual
    from worker.engine_types import EngineConfig
    from worker.protocol import RequestType, SubmitRequest
    from worker.sampling import SamplingParams

    contended = dataclasses.replace(PROFILE, contention=0.5)
    config = EngineConfig().with_overrides(num_blocks=64, tokens_per_block=16, max_num_tokens=128, chunk_unit_tokens=64, max_batch_size=8, max_num_requests=8)
    one_step = PROFILE.step_s(32, context_pairs(0, 32), 0, 0)  # a 32-token prompt, one token: one step

    async def main(kill_first: bool):
        network = SimNetwork(Network(DATA_PLANES["grpc-25gbe"]))
        first, second = (SimInstance(name, config, contended, network, rpc_latency_s=0.0) for name in ("a", "b"))
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        await first.submit(SubmitRequest("r0", tuple(range(32)), params, RequestType.CONTEXT_AND_GENERATION))
        if kill_first:
            await asyncio.sleep(one_step / 2)
            first.kill()  # mid-step: it no longer counts
            assert network.mid_step == 0
        await second.submit(SubmitRequest("r1", tuple(range(100, 132)), params, RequestType.CONTEXT_AND_GENERATION))
        while second.num_requests or (first.num_requests and not first.dead):
            await asyncio.sleep(0.001)
        assert network.mid_step == 0
        return first.stats.busy_s, second.stats.busy_s

    alone, overlapped = run_virtual(main(kill_first=False))
    assert alone == pytest.approx(one_step)  # nobody else was mid-step as it started
    assert overlapped == pytest.approx(1.5 * one_step)  # the other one was
    _, after_kill = run_virtual(main(kill_first=True))
    assert after_kill == pytest.approx(one_step)

    async def three():  # per busy instance, not per share of them: a third starts while two are busy
        network = SimNetwork(Network(DATA_PLANES["grpc-25gbe"]))
        instances = [SimInstance(name, config, contended, network, rpc_latency_s=0.0) for name in ("a", "b", "c")]
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for index, instance in enumerate(instances):
            await instance.submit(SubmitRequest(f"r{index}", tuple(range(100 * index, 100 * index + 32)), params, RequestType.CONTEXT_AND_GENERATION))
        while any(instance.num_requests for instance in instances):
            await asyncio.sleep(0.001)
        return [instance.stats.busy_s for instance in instances]

    assert run_virtual(three()) == pytest.approx([one_step, 1.5 * one_step, 2.0 * one_step])
    # No contention in the profile: the same steps, untouched (the simulated instances never look).
    assert StepProfile.from_dict(json.loads(json.dumps(contended.to_dict()))) == contended
    with pytest.raises(ProfileError, match="contention"):
        dataclasses.replace(PROFILE, contention=-0.1)


def test_the_deployed_fit_separates_a_step_alone_from_the_contention_of_the_other_instance(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from cluster.sim import deployed

    truth = dataclasses.replace(PROFILE, step_overhead_s=3e-3, prefill_s_per_token=4e-5, decode_s_per_sequence=3e-4,
                                decode_s_per_context_token=2e-6, context_step_s=2e-3, contention=0.4)
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    prefill, generation = [], []
    now = 1000.0
    # Generation steps start only while the prefill instance is idle (never contended); the prefill
    # steps start alternately inside a generation step (contended) and in a gap (alone).
    for index in range(60):
        seqs = 1 + index % 8
        decode_s = truth.step_s(0, 0, seqs, seqs * (64 + 16 * index % 5))
        generation.append({"t": now + decode_s, "ctx": 0, "pairs": 0, "seqs": seqs, "dctx": seqs * (64 + 16 * index % 5), "loop_s": decode_s})
        tokens = (64, 128, 256, 512)[index % 4]
        inside = index % 2 == 0
        start = now + (decode_s / 2 if inside else decode_s + 1e-3)
        prefill_s = truth.step_s(tokens, context_pairs(0, tokens), 0, 0) * truth.contended(1.0 if inside else 0.0)
        prefill.append({"t": start + prefill_s, "ctx": tokens, "pairs": context_pairs(0, tokens), "seqs": 0, "dctx": 0, "loop_s": prefill_s})
        now = start + prefill_s + 1e-3
    for name, rows in (("prefill-0", prefill), ("generation-0", generation)):
        (steps_dir / f"{name}.jsonl").write_text("".join(json.dumps(row | {"s": row["loop_s"]}) + "\n" for row in rows))
    steps = logs.logged_steps(steps_dir)
    assert len(steps) == 120
    assert sorted(step.busy for step in steps).count(1.0) == 30

    def as_profile(coefficients: dict[str, float], contention: float) -> StepProfile:
        return dataclasses.replace(truth, contention=contention, **coefficients)

    fitted, quality = deployed._fit_contended(steps, as_profile)
    assert fitted.contention == pytest.approx(0.4, abs=0.01)
    for tokens in (64, 512):
        assert fitted.step_s(tokens, context_pairs(0, tokens), 0, 0) == pytest.approx(truth.step_s(tokens, context_pairs(0, tokens), 0, 0), rel=0.02)
    assert fitted.step_s(0, 0, 4, 256) == pytest.approx(truth.step_s(0, 0, 4, 256), rel=0.02)
    assert quality["contended_median_relative_error"] < 0.01
    assert quality["mean_busy_instances"] == pytest.approx(0.25)
    # Alone, the steps say nothing of contention.
    (steps_dir / "generation-0.jsonl").unlink()
    alone, _ = deployed._fit_contended(logs.logged_steps(steps_dir), as_profile)
    assert alone.contention == 0.0






def test_steps_with_context_draw_from_their_own_spread_when_the_profile_has_one() -> None:
    both = dataclasses.replace(PROFILE, step_time_ratios=(0.5, 1.5), context_step_time_ratios=(0.9, 1.1))
    assert both.step_factor(0.0) == 0.5 and both.step_factor(0.0, True) == 0.9
    one = dataclasses.replace(PROFILE, step_time_ratios=(0.5, 1.5))
    assert one.step_factor(0.0, True) == 0.5  # none for context steps: the one spread
    assert StepProfile.from_dict(json.loads(json.dumps(both.to_dict()))) == both
    with pytest.raises(ProfileError, match="context_step_time_ratios"):
        dataclasses.replace(PROFILE, context_step_time_ratios=(1.0,))
    with pytest.raises(ProfileError, match="context_step_time_ratios"):
        dataclasses.replace(PROFILE, step_time_ratios=(1.0,), context_step_time_ratios=(1.1, 0.9))




def test_a_kept_calibration_has_its_step_logs_and_timelines(tmp_path) -> None:
    # What --keep-steps keeps of a calibration: the step logs its profile was fitted to (the same
    # files, read the same way) and the front end's timelines, in a directory of the caller's.
    from cluster.sim import deployed
    from worker.profiler import read_step_log

    source = tmp_path / "work"
    (source / "steps").mkdir(parents=True)
    for name in ("prefill-0", "generation-0"):
        (source / "steps" / f"{name}.jsonl").write_text(json.dumps({"t": 100.0, "ctx": 64, "pairs": 2080, "seqs": 0, "dctx": 0, "s": 0.01, "loop_s": 0.011}) + "\n")
    (source / "timelines.jsonl").write_text('{"request_id": "r-1"}\n')
    kept = tmp_path / "kept" / "1p1g" / "calibration"
    deployed.keep_calibration(source, kept)
    assert sorted(p.name for p in (kept / "steps").iterdir()) == ["generation-0.jsonl", "prefill-0.jsonl"]
    assert [sample.context_tokens for _, sample in read_step_log(kept / "steps" / "prefill-0.jsonl")] == [64]
    assert (kept / "timelines.jsonl").read_text() == '{"request_id": "r-1"}\n'


def test_the_calibration_s_shared_prefix_point_sends_short_chunks_on_a_long_cached_prefix() -> None:
    # The loaded pass's prefix-reuse point: its prompts come in groups that share their first
    # shared_prefix_tokens, so that after a group's first request the engine runs only the rest, a
    # step with many attended pairs per token (what separates the per-pair cost from the per-token one).
    from cluster.sim.deployed import SECOND_PASS, SUFFIXES_PER_PREFIX, CalibrationPoint

    shared = [point for point in SECOND_PASS if point.shared_prefix_tokens]
    assert shared, "the loaded pass measures no prefix hit"
    for point in shared + [CalibrationPoint(96, 4, 16, load=0.7, shared_prefix_tokens=80)]:
        requests = build_workload(point.workload(), 3)
        assert len(requests) == point.num_requests
        assert all(len(r.prompt) == point.prompt_tokens and r.max_tokens == point.output_tokens for r in requests)
        groups: dict[int, list] = {}
        for request in requests:
            groups.setdefault(request.group, []).append(request.prompt)
        assert len(groups) == point.num_requests // SUFFIXES_PER_PREFIX
        prefixes = set()
        for prompts in groups.values():
            assert len(prompts) == SUFFIXES_PER_PREFIX
            assert len({p[: point.shared_prefix_tokens] for p in prompts}) == 1  # one prefix per group
            assert len({p[point.shared_prefix_tokens:] for p in prompts}) == len(prompts)  # its own suffix each
            prefixes.add(prompts[0][: point.shared_prefix_tokens])
        assert len(prefixes) == len(groups)
        # What the engine runs per request on average, which the pass's load is aimed with.
        per_group = point.shared_prefix_tokens + SUFFIXES_PER_PREFIX * (point.prompt_tokens - point.shared_prefix_tokens)
        assert point.computed_prompt_tokens == pytest.approx(per_group / SUFFIXES_PER_PREFIX)
    plain = CalibrationPoint(384, 8, 48, load=0.7)
    assert plain.computed_prompt_tokens == 384
    assert all(len(r.prompt) == 384 for r in build_workload(plain.workload(), 0))


def test_the_deployed_fit_holds_the_cached_token_cost_at_0_where_one_process_fits_it(tmp_path: Path) -> None:
    # Steps with chunks on cached prefixes: `duet profile`'s fit (one process, its cached-prefill
    # series) finds what a chunk pays per cached token; the deployed fit leaves it to the per-pair
    # cost (deployed.DEPLOYED_WITHOUT says why) and still logs and reads the cached tokens.
    pytest.importorskip("torch")
    from cluster.sim import deployed
    from worker.profiler import StepSample, fit

    truth = dataclasses.replace(PROFILE, prefill_s_per_cached_token=2e-6)
    samples = []
    for tokens in (32, 128, 512):
        for cached in (0, 256, 1024):
            step_s = truth.step_s(tokens, context_pairs(cached, tokens), 0, 0, cached)
            samples.append(StepSample(tokens, context_pairs(cached, tokens), 0, 0, step_s, cached))
    for seqs, context in ((1, 100), (4, 700), (16, 300)):
        samples.append(StepSample(0, 0, seqs, seqs * context, truth.step_s(0, 0, seqs, seqs * context)))
    one_process, _ = fit(samples, trim_fraction=0.0)
    assert one_process["prefill_s_per_cached_token"] == pytest.approx(2e-6, rel=1e-6)
    held, _ = fit(samples, trim_fraction=0.0, without=deployed.DEPLOYED_WITHOUT)
    assert held["prefill_s_per_cached_token"] == 0.0 and held["prefill_s_per_token_pair"] > truth.prefill_s_per_token_pair

    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    rows = [{"t": 10.0 + i, "ctx": s.context_tokens, "pairs": s.context_pairs, "seqs": s.decode_sequences, "dctx": s.decode_context_tokens,
             "cached": s.context_cached_tokens, "s": s.step_s, "loop_s": s.step_s} for i, s in enumerate(samples)]
    (steps_dir / "mixed-0.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    logged = logs.logged_steps(steps_dir)
    assert [step.sample.context_cached_tokens for step in logged] == [s.context_cached_tokens for s in samples]
    fitted, _ = deployed._fit_contended(logged, lambda coefficients, contention: dataclasses.replace(truth, contention=contention, **coefficients))
    assert fitted.prefill_s_per_cached_token == 0.0
