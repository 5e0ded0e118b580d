"""The simulator's pieces: the virtual-time loop, step-time profiles (measured fit, roofline), the link
model, trace replay in the Azure format, and the `duet sim` command line."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
from pathlib import Path

import pytest

from cluster.loadgen.arrivals import ArrivalError, ScheduledArrivals
from cluster.loadgen.trace import parse_rows, read_trace, trace_workload
from cluster.loadgen.workloads import WorkloadError
from cluster.sim.catalog import load_profile, shipped_profiles
from cluster.sim.link import DATA_PLANES, LinkModel, Network
from cluster.sim.profile import ProfileError, StepProfile, context_pairs
from cluster.sim.roofline import DEVICES, MODELS, RooflineInputs, roofline_profile
from cluster.sim.vclock import SimulationDeadlock, run_virtual

TRACE = Path(__file__).resolve().parents[1] / "data" / "azure_trace_sample.csv"


def test_the_virtual_loop_jumps_to_the_next_timer_instead_of_sleeping() -> None:
    async def main() -> tuple[float, list[str]]:
        loop = asyncio.get_running_loop()
        order = []
        loop.call_later(5.0, order.append, "b")
        loop.call_later(1.0, order.append, "a")
        await asyncio.sleep(3600.0)
        try:
            await asyncio.wait_for(asyncio.Event().wait(), 2.5)
        except asyncio.TimeoutError:
            order.append("timeout")
        return loop.time(), order

    now, order = run_virtual(main())
    assert now == pytest.approx(3602.5)
    assert order == ["a", "b", "timeout"]


def test_timers_due_together_run_in_scheduling_order_and_cancelled_ones_never_run() -> None:
    async def main() -> tuple[float, list[object], int, int]:
        loop = asyncio.get_running_loop()
        order: list[object] = []
        handles = [loop.call_at(10.0, order.append, index) for index in range(300)]
        loop.call_at(0.1 + 0.2, order.append, "early")
        for index, handle in enumerate(handles):
            if index % 3:
                handle.cancel()  # two thirds cancelled: the queue drops them at its next pass
        queued_before = len(loop._timers)
        await asyncio.sleep(0)
        queued_after = len(loop._timers)
        await asyncio.sleep(0.1 + 0.2)
        early_s = loop.time()
        await asyncio.sleep(20.0 - early_s)
        return early_s, order, queued_before, queued_after

    early_s, order, queued_before, queued_after = run_virtual(main())
    assert early_s == 0.1 + 0.2  # the clock jumps to a timer's time exactly, not by adding waits
    assert order == ["early", *range(0, 300, 3)]
    assert queued_before == 301
    assert queued_after == 101  # compacted, not left until the cancelled timers come due


def test_a_wait_on_nothing_is_a_deadlock_not_a_hang() -> None:
    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(SimulationDeadlock):
        run_virtual(main())


def test_the_cyclic_collector_is_off_while_a_simulation_runs_and_as_it_was_afterwards() -> None:
    import gc

    async def main() -> bool:
        await asyncio.sleep(1.0)
        return gc.isenabled()

    assert gc.isenabled()
    assert run_virtual(main()) is False
    assert gc.isenabled()
    gc.disable()
    try:
        assert run_virtual(main()) is False
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_step_time_is_overhead_plus_the_batch_and_zero_when_idle() -> None:
    profile = StepProfile("p", "measured", "cpu", "m", 1e-3, 1e-5, 1e-8, 1e-4, 1e-7, 2e-3, 1024)
    assert profile.step_s(0, 0, 0, 0) == 0.0
    assert profile.step_s(100, context_pairs(0, 100), 0, 0) == pytest.approx(1e-3 + 1e-3 + 5050e-8)
    assert profile.step_s(0, 0, 8, 8000) == pytest.approx(1e-3 + 8e-4 + 8e-4)
    roof = StepProfile("r", "roofline", "gpu", "m", 1e-3, 1e-5, 0.0, 1e-4, 1e-6, 2e-3, 1024, combine="max")
    assert roof.step_s(0, 0, 8, 8000) == pytest.approx(1e-3 + 8e-3)  # memory-bound: the max, not the sum
    assert StepProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    with pytest.raises(ProfileError):
        StepProfile.from_dict({"format": "other"})
    with pytest.raises(ProfileError):
        StepProfile("p", "measured", "cpu", "m", -1.0, 0, 0, 0, 0, 0, 1)


def test_shipped_profiles_load_and_describe_this_kind_of_cpu() -> None:
    shipped = shipped_profiles()
    assert {"cpu-builtin", "cpu-bench8"} <= set(shipped)
    for name in ("cpu-builtin", "cpu-bench8"):
        profile = load_profile(name)
        assert profile.source == "measured" and profile.combine == "sum"
        assert profile.step_s(0, 0, 1, 100) > 0 and profile.handover_fixed_s > 0
    # The bench model (8 layers, hidden 512) is slower per token than the built-in (4 layers, 128).
    assert load_profile("cpu-bench8").step_s(256, context_pairs(0, 256), 0, 0) > load_profile("cpu-builtin").step_s(256, context_pairs(0, 256), 0, 0)
    with pytest.raises(ProfileError, match="shipped"):
        load_profile("no-such-profile")


def test_roofline_profile_matches_a_hand_calculation() -> None:
    model, device = MODELS["llama-3-8b"], DEVICES["h100-sxm"]
    assert 7.4e9 < model.parameters < 7.6e9  # Llama 3 8B: 8.03e9 less the 0.53e9 embedding table (a lookup)
    assert model.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2  # 128 KiB per token in bf16
    profile = roofline_profile(RooflineInputs(model, device, compute_efficiency=0.5, memory_efficiency=0.8, step_overhead_s=0.0))
    assert profile.source == "roofline" and "estimate" in profile.notes
    weights_s = model.parameters * 2 / (3.35e12 * 0.8)
    assert profile.step_overhead_s == pytest.approx(weights_s)
    assert profile.prefill_s_per_token == pytest.approx(2 * model.parameters / (989e12 * 0.5))
    # A decode step of 64 requests at 1k context is memory-bound at about weights + KV reads.
    kv_s = 64 * 1024 * model.kv_bytes_per_token(2) / (3.35e12 * 0.8)
    assert profile.step_s(0, 0, 64, 64 * 1024) == pytest.approx(weights_s + kv_s)
    assert load_profile("roofline:h200:llama-3-70b").device == "h200"
    with pytest.raises(ProfileError):
        load_profile("roofline:tpu:llama-3-8b")


def test_the_profile_fit_recovers_known_coefficients() -> None:
    pytest.importorskip("torch")
    from worker.profiler import StepSample, fit

    # The last two: context_step_s (paid by a step with any context) and prefill_s_per_cached_token.
    truth = (2e-3, 3e-5, 4e-8, 1e-4, 1e-6, 5e-3, 1.5e-6)
    samples = []
    for ctx in (0, 64, 256, 1024):
        for cached in ((0, 512) if ctx else (0,)):  # a chunk on a cached prefix attends it too
            for seqs in (0, 1, 8, 32):
                for length in (100, 700):
                    if ctx == seqs == 0:
                        continue
                    row = (ctx, context_pairs(cached, ctx), seqs, seqs * length)
                    step_s = truth[0] + sum(c * x for c, x in zip(truth[1:5], row, strict=True)) + (truth[5] if ctx else 0.0) + truth[6] * cached
                    samples.append(StepSample(*row, step_s, cached))
    coefficients, quality = fit(samples)
    assert list(coefficients.values()) == pytest.approx(truth, rel=1e-6)
    profile = StepProfile("fitted", "measured", "cpu", "m", **coefficients, handover_fixed_s=0.0, kv_bytes_per_token=1)
    for sample in samples[6], samples[20]:
        modelled = profile.step_s(sample.context_tokens, sample.context_pairs, sample.decode_sequences, sample.decode_context_tokens, sample.context_cached_tokens)
        assert modelled == pytest.approx(sample.step_s, rel=1e-6)
    assert samples[20].context_cached_tokens == 512
    assert quality["median_relative_error"] < 1e-9


def test_the_link_model_queues_transfers_on_each_nic() -> None:
    network = Network(LinkModel("test", 1e9, 1e-3))
    first = network.schedule("p0", "g0", 10**9, now_s=0.0)
    assert first == pytest.approx(1.001)
    # Same sender: waits for the first; a different pair goes at once.
    assert network.schedule("p0", "g1", 10**9, now_s=0.5) == pytest.approx(2.002)
    assert network.schedule("p1", "g2", 10**6, now_s=0.5) == pytest.approx(0.502)
    assert network.bytes_sent["p0"] == 2 * 10**9 and network.bytes_received["g2"] == 10**6
    assert DATA_PLANES["nvlink-h100"].transfer_s(10**6) < DATA_PLANES["grpc-25gbe"].transfer_s(10**6)


def test_an_azure_format_trace_replays_with_its_send_times(tmp_path: Path) -> None:
    rows = read_trace(TRACE)
    assert len(rows) == 200
    requests, arrivals = trace_workload(rows, seed=1, max_requests=50)
    assert len(requests) == 50 and arrivals.offsets[0] == 0.0
    assert all(b >= a for a, b in zip(arrivals.offsets, arrivals.offsets[1:], strict=False))
    assert [len(r.prompt) for r in requests] == [r.prompt_tokens for r in sorted(rows, key=lambda r: r.arrival_s)[:50]]
    assert 4 < arrivals.x_value < 16  # the sample is ~8 requests/s
    halved = trace_workload(rows, seed=1, max_requests=50, time_scale=0.5)[1]
    assert halved.offsets[-1] == pytest.approx(arrivals.offsets[-1] / 2)
    # Seconds and JSONL rows under the other names.
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"timestamp": 2.5, "prompt_tokens": 10, "output_tokens": 3}\n{"timestamp": 1.0, "prompt_tokens": 5, "output_tokens": 1}\n')
    requests, arrivals = trace_workload(read_trace(jsonl))
    assert arrivals.offsets == (0.0, 1.5) and [r.max_tokens for r in requests] == [1, 3]
    with pytest.raises(WorkloadError, match="row 1"):
        parse_rows([{"TIMESTAMP": "yesterday", "ContextTokens": 1, "GeneratedTokens": 1}])
    with pytest.raises(ArrivalError):
        ScheduledArrivals((1.0, 0.5))


def _envelope(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def test_duet_sim_prints_the_bench_table_and_envelope(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli.main import main

    code = main(["sim", "--quick", "--instances", "1P,2G", "--out", str(tmp_path), "--no-plots", "--no-progress",
                 "--slo-ttft-ms", "500", "--slo-tpot-ms", "100"])
    out = capsys.readouterr().out
    assert code == 0
    assert "TTFT p50" in out and "util mean" in out
    envelope = _envelope(out)
    assert envelope["bench"] == "duet_sim"
    assert envelope["targets"]["completed_fraction"]["met"]
    points = envelope["figures"]["simulation"]["points"]
    assert points[0]["transfers"] > 0 and "GENERATION" in points[0]["utilisation_by_role"]
    document = json.loads((tmp_path / "results.json").read_text())
    assert len(document["simulation"]["points"][0]["instances"]) == 3


def test_duet_sim_warns_when_the_instances_settle_holding_something(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """Every end path frees (a leak is a bug in duet): none in a run, but if one ever shows after
    the instances settled (cluster/sim/cluster.py simulate_async), duet sim says so."""
    import dataclasses

    from cluster.cli import sim as sim_cli
    from cluster.cli.main import main

    args = ["sim", "--quick", "--instances", "1P,1G", "--out", str(tmp_path), "--no-plots", "--no-progress"]
    assert main(args) == 0
    assert "still held" not in capsys.readouterr().err
    simulate = sim_cli.simulate
    monkeypatch.setattr(sim_cli, "simulate", lambda *a, **k: dataclasses.replace(simulate(*a, **k), leaked_blocks=3, held_requests=1))
    assert main(args) == 0
    assert "once the instances settled they still held 1 requests and 3 KV blocks (a leak in duet" in capsys.readouterr().err


def test_duet_sim_replays_a_trace_on_a_mixed_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli.main import main

    code = main(["sim", "--workload", "trace", "--trace", str(TRACE), "--num-requests", "40", "--mixed", "2",
                 "--prefill", "0", "--generation", "0", "--out", str(tmp_path), "--no-plots", "--no-progress"])
    envelope = _envelope(capsys.readouterr().out)
    assert code == 0 and envelope["figures"]["points"]["trace"]["completed"] == 40


def test_duet_sim_names_a_bad_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli.main import main

    assert main(["sim", "--instances", "3X"]) == 2
    assert "--instances" in capsys.readouterr().err
    assert main(["sim", "--profile", "nope"]) == 2
    capsys.readouterr()
    # A cluster the configuration refuses, and an instance to kill that it does not have: a usage
    # error naming the flag, before anything is simulated.
    assert main(["sim", "--instances", "1P"]) == 2
    assert capsys.readouterr().err.strip() == (
        "duet sim: --instances: PREFILL instances need a GENERATION or MIXED instance to hand over to"
    )
    assert main(["sim", "--instances", "2P,3G", "--kill", "mixed-0@1", "--kill", "generation-2@1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "duet sim: --kill: no instance 'mixed-0' (instances: prefill-0 to prefill-1, generation-0 to generation-2)"


def test_duet_sim_and_plan_say_when_the_kv_pool_cannot_hold_the_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli.main import main

    # The roofline Llama 3 8B profile with a pool of 256 MiB (the engine's default, given explicitly:
    # unsized, the profile's estimate of the device's memory would apply): 128 blocks of 16 tokens.
    # Log-normal prompts around 1,200 tokens: some exceed the pool with their outputs.
    config = tmp_path / "small-pool.yaml"
    config.write_text("engine: {kv_cache_bytes: 268435456}\n")
    workload = ["--workload", "lognormal", "--num-requests", "30", "--input-len", "1200", "--output-len", "64"]
    cluster = ["--config", str(config), "--profile", "roofline:h100-sxm:llama-3-8b", "--out", str(tmp_path), "--no-plots"]
    common = [*cluster, *workload]
    assert main(["sim", "--instances", "1P,1G", "--rate", "2", "--no-progress", *common]) == 0
    err = capsys.readouterr().err
    assert "KV pool of 128 blocks (2048 tokens of llama-3-8b) cannot hold" in err and "engine.kv_cache_bytes" in err
    assert main(["plan", "--instances", "2", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", *common]) == 2
    assert "cannot hold" in capsys.readouterr().err
    # No request fits: duet sim refuses to run.
    assert main(["sim", "--instances", "1P,1G", "--rate", "2", "--no-progress", *cluster, "--workload", "fixed",
                 "--num-requests", "5", "--input-len", "3000", "--output-len", "8"]) == 2
    assert "holds none of the workload's requests" in capsys.readouterr().err


def test_a_roofline_profile_sizes_the_kv_pool_of_a_configuration_that_sizes_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli.main import main
    from cluster.deploy.config import ClusterConfig
    from cluster.sim.capacity import pool_blocks
    from cluster.sim.cluster import with_profile_pool

    model, device = MODELS["llama-3-8b"], DEVICES["h100-sxm"]
    profile = roofline_profile(RooflineInputs(model, device))
    # 90 % of 81,559 MiB less 5 % and less the weights with the embedding table (8.03e9 in bf16).
    expected = int(81_559 * 2**20 * 0.85 - 8_029_995_008 * 2)
    assert model.stored_parameters == 8_029_995_008 and profile.kv_pool_bytes == expected
    assert StepProfile.from_dict(profile.to_dict()).kv_pool_bytes == expected
    seventy = load_profile("roofline:h100-sxm:llama-3-70b")  # 141 GB of weights: no room on one device
    assert seventy.kv_pool_bytes is None and "do not fit" in seventy.notes
    with pytest.raises(ProfileError, match="kv_pool_bytes"):
        StepProfile.from_dict({**profile.to_dict(), "kv_pool_bytes": 5})

    unsized = ClusterConfig()
    sized = with_profile_pool(unsized, profile)
    engine = sized.engine_config(sized.instances[0])
    assert engine.kv_cache_bytes == expected and pool_blocks(engine, profile) == expected // (model.kv_bytes_per_token(2) * 16) == 27_004
    # A configuration that sizes its pool, or a measured profile (none of its own), keeps the configured one.
    for given in ({"num_blocks": 500}, {"kv_cache_bytes": 1 << 30}):
        config = ClusterConfig.from_dict({"engine": given})
        assert with_profile_pool(config, profile) is config
    assert with_profile_pool(unsized, load_profile("cpu-builtin")) is unsized
    # A group that sizes its own keeps it; the others take the estimate.
    grouped = with_profile_pool(ClusterConfig.from_dict({"instances": [
        {"role": "PREFILL", "count": 1, "engine": {"num_blocks": 300}}, {"role": "GENERATION", "count": 1}]}), profile)
    assert [pool_blocks(grouped.engine_config(g), profile) for g in grouped.instances] == [300, 27_004]
    every_group = ClusterConfig.from_dict({"instances": [
        {"role": "PREFILL", "count": 1, "engine": {"num_blocks": 300}}, {"role": "GENERATION", "count": 1, "engine": {"num_blocks": 400}}]})
    assert with_profile_pool(every_group, profile) is every_group

    # duet sim says where the pool came from; duet plan writes it into the YAML duet serve reads.
    common = ["--profile", "roofline:h100-sxm:llama-3-8b", "--workload", "fixed", "--num-requests", "20", "--input-len", "64",
              "--output-len", "16", "--no-plots"]
    assert main(["sim", "--instances", "1P,1G", "--rate", "50", "--no-progress", "--out", str(tmp_path / "sim"), *common]) == 0
    assert "duet sim: KV pool per instance: 27,004 blocks (432,064 tokens), the roofline-h100-sxm-llama-3-8b" in capsys.readouterr().err
    assert main(["plan", "--instances", "2", "--policies", "round_robin", "--splits", "0", "--duration", "1", "--jobs", "1",
                 "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50", "--out", str(tmp_path / "plan"), *common]) == 0
    assert "duet plan: KV pool per instance: 27,004 blocks (432,064 tokens)" in capsys.readouterr().err
    written = ClusterConfig.from_yaml(tmp_path / "plan" / "best-cluster.yaml")
    assert written.engine["kv_cache_bytes"] == expected


def test_duet_sim_and_plan_say_when_the_engines_request_limit_capped_the_batches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli.main import main

    config = tmp_path / "cluster.yaml"
    common = ["--config", str(config), "--profile", "roofline:h100-sxm:llama-3-8b", "--workload", "fixed", "--num-requests", "40",
              "--input-len", "64", "--output-len", "32", "--out", str(tmp_path / "out"), "--no-plots"]
    # 4 requests per instance against a burst of 40: most steps run 4 while the rest wait.
    config.write_text("engine: {max_num_requests: 4}\n")
    assert main(["sim", "--instances", "1M", "--rate", "1000", "--no-progress", *common]) == 0
    err = capsys.readouterr().err
    assert "of the MIXED instances' steps ran at the engine's request limits (engine.max_num_requests: 4, engine.max_batch_size: 64)" in err
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    assert document["simulation"]["points"][0]["request_limited_by_role"]["MIXED"] >= 0.5
    assert main(["plan", "--instances", "2", "--policies", "round_robin", "--splits", "0", "--duration", "1", "--jobs", "1",
                 "--slo-ttft-ms", "5000", "--slo-tpot-ms", "50", *common]) == 0
    assert "ran at least 50% of some role's steps at the engine's request limits (engine.max_num_requests: 4," in capsys.readouterr().err
    # The micro-batch's limit binds the same way.
    config.write_text("engine: {max_batch_size: 4}\n")
    assert main(["sim", "--instances", "1M", "--rate", "1000", "--no-progress", *common]) == 0
    assert "(engine.max_num_requests: 64, engine.max_batch_size: 4) with more requests waiting" in capsys.readouterr().err
    # A limit the burst never reaches: no warning.
    config.write_text("engine: {max_num_requests: 64}\n")
    assert main(["sim", "--instances", "1M", "--rate", "1000", "--no-progress", *common]) == 0
    assert "request limits" not in capsys.readouterr().err
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    assert document["simulation"]["points"][0]["request_limited_by_role"] == {"MIXED": 0.0}


def test_duet_sim_and_plan_say_when_the_routers_admission_limit_capped_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli.main import main

    config = tmp_path / "cluster.yaml"
    config.write_text("router: {admission: {max_queued_requests: 3}}\n")
    common = ["--config", str(config), "--profile", "roofline:h100-sxm:llama-3-8b", "--workload", "fixed", "--num-requests", "30",
              "--input-len", "64", "--output-len", "32", "--out", str(tmp_path / "out"), "--no-plots"]
    assert main(["sim", "--instances", "2M", "--rate", "1000", "--no-progress", *common]) == 0
    err = capsys.readouterr().err
    assert "the router refused" in err and "(router.admission.max_queued_requests: 3)" in err
    assert main(["plan", "--instances", "2", "--policies", "round_robin", "--splits", "0", "--duration", "1", "--jobs", "1",
                 "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50", *common]) == 0
    err = capsys.readouterr().err
    assert "duet plan: warning: the router refused requests at its admission limit (router.admission.max_queued_requests: 3)" in err
    probes = json.loads((tmp_path / "out" / "plan.json").read_text())["probes"]["2 MIXED round_robin"]
    assert any(p["refused"] for p in probes)
    # A limit the run never reaches: no warning.
    config.write_text("router: {admission: {max_queued_requests: 1000}}\n")
    assert main(["sim", "--instances", "2M", "--rate", "1000", "--no-progress", *common]) == 0
    assert "refused" not in capsys.readouterr().err


def test_duet_plan_marks_the_best_split_and_writes_a_config_duet_serve_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli.main import main
    from cluster.deploy.config import ClusterConfig

    code = main(["plan", "--instances", "2", "--policies", "round_robin", "--workload", "fixed", "--num-requests", "60",
                 "--input-len", "64", "--output-len", "8", "--duration", "1", "--slo-ttft-ms", "200", "--slo-tpot-ms", "50",
                 "--out", str(tmp_path), "--no-plots"])
    out = capsys.readouterr().out
    assert code == 0
    envelope = _envelope(out)["figures"]
    assert set(envelope["candidates"]) == {"2 MIXED round_robin", "1P:1D round_robin"}
    assert envelope["best"] in envelope["candidates"] and "* " + envelope["best"] in out
    searched = {label: value for label, value in envelope["candidates"].items() if value is not None}
    assert envelope["best_goodput_per_instance"] == max(searched.values()) > 0
    # A candidate left below the best rate has no figure of its own, only the rate it failed.
    assert set(envelope["candidates"]) - set(searched) == set(envelope["below_best"])
    assert envelope["at_least"] == []
    config = ClusterConfig.from_yaml(envelope["cluster_yaml"])
    assert sum(group.count for group in config.instances) == 2
    assert json.loads((tmp_path / "plan.json").read_text())["probes"]


def test_a_candidate_becomes_the_config_it_names() -> None:
    from cluster.deploy.config import ClusterConfig
    from cluster.router.config import DisaggMode
    from cluster.sim.plan import Candidate, candidates

    assert [c.label for c in candidates(3, ["kv_aware"])] == ["3 MIXED kv_aware", "1P:2D kv_aware", "2P:1D kv_aware"]
    # Some splits only (duet plan --splits): in increasing order, once each.
    assert [c.label for c in candidates(4, ["kv_aware"], [3, 0, 3])] == ["4 MIXED kv_aware", "3P:1D kv_aware"]
    for counts in ([4], [-1], [True], []):
        with pytest.raises(ValueError):
            candidates(4, ["kv_aware"], counts)
    base = ClusterConfig.from_dict({"engine": {"num_blocks": 100}})
    mixed = Candidate(0, 4, "least_loaded").config(base)
    assert [(g.role.name, g.count) for g in mixed.instances] == [("MIXED", 4)]
    assert mixed.router.placement.disaggregation is DisaggMode.NEVER and mixed.engine == {"num_blocks": 100}
    split = Candidate(1, 3, "round_robin").config(base)
    assert [(g.role.name, g.count) for g in split.instances] == [("PREFILL", 1), ("GENERATION", 3)]
    assert split.router.placement.prefill_policy.__class__.__name__ == "RoundRobinParams"


def test_duet_profile_measures_this_machine_and_writes_a_profile_duet_sim_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    from cluster.cli.main import main

    out = tmp_path / "here.json"
    assert main(["profile", "--quick", "--out", str(out)]) == 0
    profile = load_profile(str(out))
    assert profile.source == "measured" and profile.model == "builtin" and profile.kv_bytes_per_token == 2048
    assert profile.step_s(0, 0, 4, 400) > 0 and 0 < profile.handover_fixed_s < 1.0
    assert profile.fit["samples"] >= 8
    # It measured a chunk on a cached prefix (the quick plan's 32 tokens on 128), each other prompt
    # its own (no step of them found another's blocks in the cache).
    table = profile.fit["samples_table"]
    assert [row[5] for row in table if row[5]] == [128]
    assert [row for row in table if row[5]][0][:2] == [32, context_pairs(128, 32)]
    roof = tmp_path / "roof.json"
    assert main(["profile", "--roofline", "a100-80g:qwen2-7b", "--out", str(roof)]) == 0
    assert load_profile(str(roof)).source == "roofline"
    assert main(["profile", "--roofline", "tpu:llama", "--out", str(roof)]) == 2


def _plan_case():
    from cluster.deploy.config import ClusterConfig
    from cluster.loadgen.metrics import Slo
    from cluster.loadgen.runner import SamplingSpec
    from cluster.loadgen.workloads import WorkloadConfig, WorkloadKind, build_workload
    from cluster.sim.cluster import SimSettings
    from cluster.sim.plan import Candidate

    base = ClusterConfig.from_dict({"instances": [{"role": "PREFILL", "count": 1}, {"role": "GENERATION", "count": 1}]})
    config = Candidate(2, 2, "round_robin").config(base)
    settings = SimSettings(load_profile("cpu-builtin"), sampling=SamplingSpec(timeout_s=None))
    pool = build_workload(WorkloadConfig(kind=WorkloadKind.FIXED, num_requests=40, input_len=32, output_len=8), 0)
    return base, config, settings, pool, Slo(ttft_ms=2000, tpot_ms=200)


def test_an_overloaded_probe_fails_even_when_the_pool_is_smaller_than_its_window() -> None:
    from cluster.sim.plan import Candidate, search

    base, _config, settings, pool, slo = _plan_case()
    # 4,096 req/s for 2 s is 8,192 requests, far beyond 4 CPU instances; the pool holds 40, which
    # this cluster absorbs as one burst within these lax SLOs: the probe must not be that burst.
    result = search(Candidate(2, 2, "round_robin"), base, settings, pool, slo, start_rate_per_s=4096.0, duration_s=2.0,
                    max_doublings=1, bisections=0)
    (first,) = result.probes
    assert first.requests == 8192 and not first.passed and result.max_rate_per_s == 0.0
    assert first.decided_early and first.attainment < 0.9  # most never finished: a miss each


def test_a_probe_decided_early_gives_the_verdict_of_the_whole_run() -> None:
    from cluster.loadgen.arrivals import PoissonArrivals
    from cluster.sim.cluster import simulate
    from cluster.sim.plan import probe, slo_attainment, window_requests

    _base, config, settings, pool, slo = _plan_case()
    verdicts = []
    for rate in (400.0, 4000.0):  # within this cluster's reach, and beyond it
        requests = window_requests(pool, round(rate * 0.5))
        verdict = probe(config, settings, requests, rate, slo, 0.9)
        whole = simulate(config, settings, requests, PoissonArrivals(rate), slo)
        assert verdict.passed == (slo_attainment(whole.point.outcome.records, slo) >= 0.9)
        assert verdict.requests == len(whole.point.outcome.records) == len(requests)
        verdicts.append(verdict)
    assert [v.passed for v in verdicts] == [True, False] and all(v.decided_early for v in verdicts)


@pytest.mark.parametrize(("ttft_ms", "tpot_ms"), [(20, 1000), (10_000, 5)], ids=["ttft", "tpot"])
def test_an_overloaded_probe_fails_at_its_first_certain_misses_of_either_objective(ttft_ms: int, tpot_ms: int) -> None:
    """A request has missed once it is certain: no token by its send + TTFT, or unfinished by its first
    token + TPOT x (max_tokens - 1). The verdict is the whole run's, and it comes before the reading
    that waited for each request's end or its send + TTFT + TPOT x (max_tokens - 1) could give it."""
    from cluster.loadgen.arrivals import PoissonArrivals
    from cluster.loadgen.metrics import Slo
    from cluster.sim.cluster import simulate
    from cluster.sim.plan import probe, slo_attainment, slo_deadline_s, window_requests

    _base, config, settings, pool, _slo = _plan_case()
    slo = Slo(ttft_ms=ttft_ms, tpot_ms=tpot_ms)
    rate = 1600.0  # prompts queue (TTFT p50 ~27 ms) and decode batches swell (TPOT p50 ~6 ms); none refused
    requests = window_requests(pool, round(rate * 0.5))
    verdict = probe(config, settings, requests, rate, slo, 0.9)
    records = simulate(config, settings, requests, PoissonArrivals(rate), slo).point.outcome.records
    assert slo_attainment(records, slo) < 0.9 and not verdict.passed and verdict.decided_early
    # Only the objective under test decides: the other one is met by every request.
    lax = Slo(ttft_ms=None, tpot_ms=tpot_ms) if ttft_ms == 20 else Slo(ttft_ms=ttft_ms, tpot_ms=None)
    assert slo_attainment(records, lax) == 1.0
    # When the earlier reading would have failed it: at the (count - needed + 1)-th miss, each
    # counted at its end or at its send + TTFT + TPOT x (max_tokens - 1), whichever came first.
    old_deadline_s = slo_deadline_s(slo, pool[0].max_tokens)
    missed_at_s = sorted(min(r.end_s, r.sent_s + old_deadline_s) for r in records if not slo.met_by(r))
    needed = math.ceil(0.9 * len(requests) - 1e-9)
    old_verdict_s = missed_at_s[len(requests) - needed]
    assert 0 < verdict.simulated_s < old_verdict_s


def test_the_window_continues_the_pool_with_copies_that_share_no_prefix() -> None:
    from cluster.sim.plan import window_requests

    *_, pool, _slo = _plan_case()
    window = window_requests(pool, 100)
    assert [r.index for r in window] == list(range(100)) and window[:40] == list(pool)
    assert [len(r.prompt) for r in window[40:80]] == [len(r.prompt) for r in pool]
    assert all(copy.prompt[0] != original.prompt[0] for copy, original in zip(window[40:80], pool, strict=True))


@functools.cache
def _search_case() -> tuple:
    """The plan case with outputs long and SLOs tight enough that every candidate's maximum is well
    below the search's doubling limit (3 instances, round robin)."""
    from cluster.loadgen.metrics import Slo
    from cluster.loadgen.workloads import WorkloadConfig, WorkloadKind, build_workload

    base, _config, settings, _pool, _slo = _plan_case()
    pool = build_workload(WorkloadConfig(kind=WorkloadKind.FIXED, num_requests=40, input_len=64, output_len=48), 0)
    return base, settings, pool, Slo(ttft_ms=300, tpot_ms=50)


@functools.cache
def _sequential_plan() -> list:
    """The search case's plan, pruned, one candidate at a time (shared by the tests that compare with it)."""
    from cluster.sim.plan import plan

    base, settings, pool, slo = _search_case()
    return plan(base, settings, pool, slo, 3, policies=("round_robin",), duration_s=1.0)


def test_a_plan_worker_takes_the_parents_log_level() -> None:
    """Spawned workers start with logging unconfigured (WARNING): duet plan --log-level ERROR must
    keep a parallel plan's simulated router as quiet as a sequential one's."""
    import logging
    import signal

    from cluster.sim.plan import _init_worker

    root = logging.getLogger()
    level, handler = root.level, signal.getsignal(signal.SIGINT)
    try:
        root.setLevel(logging.WARNING)
        _init_worker(*_search_case(), {}, logging.ERROR, False)
        assert root.getEffectiveLevel() == logging.ERROR
    finally:
        root.setLevel(level)
        signal.signal(signal.SIGINT, handler)


def test_a_plan_of_some_splits_searches_those_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli.main import main
    from cluster.sim.plan import plan

    base, settings, pool, slo = _search_case()
    # The first candidate's search depends on no other: alone, it is what the whole plan found for it.
    assert plan(base, settings, pool, slo, 3, policies=("round_robin",), duration_s=1.0, prefill_counts=[0]) == _sequential_plan()[:1]
    common = ["--policies", "round_robin", "--workload", "fixed", "--num-requests", "20", "--input-len", "64", "--output-len", "8",
              "--duration", "1", "--slo-ttft-ms", "200", "--slo-tpot-ms", "50", "--out", str(tmp_path), "--no-plots", "--jobs", "1"]
    assert main(["plan", "--instances", "3", "--splits", "2", *common]) == 0
    document = json.loads((tmp_path / "plan.json").read_text())
    assert list(document["candidates"]) == ["2P:1D round_robin"] and document["splits"] == [2]
    capsys.readouterr()
    assert main(["plan", "--instances", "3", "--splits", "0", "3", *common]) == 2
    assert "--splits: prefill instance counts from 0 (all MIXED) to 2" in capsys.readouterr().err


def test_more_bisections_narrow_each_candidates_rate_from_below(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli.main import main
    from cluster.sim.plan import DEFAULT_BISECTIONS, plan

    base, settings, pool, slo = _search_case()
    (coarse,) = _sequential_plan()[:1]  # all MIXED, searched first: no rate to beat
    (fine,) = plan(base, settings, pool, slo, 3, policies=("round_robin",), duration_s=1.0, prefill_counts=[0],
                   bisections=DEFAULT_BISECTIONS + 2)
    # The same doubling and the same first bisections, then two more probes inside the last bracket.
    assert [p.rate_per_s for p in fine.probes[: len(coarse.probes)]] == [p.rate_per_s for p in coarse.probes]
    assert len(fine.probes) == len(coarse.probes) + 2
    bracket = min(p.rate_per_s for p in coarse.probes if not p.passed) - coarse.max_rate_per_s  # the last bisection's
    assert coarse.max_rate_per_s <= fine.max_rate_per_s < coarse.max_rate_per_s + bracket
    common = ["plan", "--instances", "3", "--splits", "0", "--policies", "round_robin", "--workload", "fixed",
              "--num-requests", "20", "--input-len", "64", "--output-len", "8", "--duration", "1", "--slo-ttft-ms", "200",
              "--slo-tpot-ms", "50", "--out", str(tmp_path), "--no-plots", "--jobs", "1"]
    assert main([*common, "--bisections", "1"]) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["bisections"] == 1
    capsys.readouterr()
    assert main([*common, "--bisections", "13"]) == 2
    assert "--bisections: an integer from 0 to 12" in capsys.readouterr().err
    with pytest.raises(ValueError, match="bisections"):
        plan(base, settings, pool, slo, 3, bisections=-1)


def test_a_pruned_plan_finds_the_best_split_and_rate_of_an_exhaustive_one() -> None:
    from cluster.sim.plan import best, plan

    base, settings, pool, slo = _search_case()
    runs = {True: _sequential_plan(), False: plan(base, settings, pool, slo, 3, policies=("round_robin",), duration_s=1.0, prune=False)}
    assert all(max(p.rate_per_s for p in r.probes) < 0.75 * 2**11 for r in runs[False])
    pruned, exhaustive = best(runs[True]), best(runs[False])
    assert (pruned.candidate, pruned.max_rate_per_s) == (exhaustive.candidate, exhaustive.max_rate_per_s)
    below = [r for r in runs[True] if r.below_rate_per_s is not None]
    assert below and all(len(r.probes) == 1 for r in below)
    full = {r.candidate: r.max_rate_per_s for r in runs[False]}
    assert all(full[r.candidate] < r.below_rate_per_s for r in below)


def test_a_candidate_that_passes_every_rate_tried_is_marked_a_lower_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.sim.plan import Candidate, search

    base, _config, settings, pool, slo = _plan_case()
    result = search(Candidate(2, 2, "round_robin"), base, settings, pool, slo, start_rate_per_s=1.0, duration_s=1.0,
                    max_doublings=2, bisections=0)
    assert [p.passed for p in result.probes] == [True, True]  # 1 and 2 req/s: far within reach
    assert result.unbounded and result.max_rate_per_s == 2.0  # "at least 2", not "at most"
    bounded = search(Candidate(2, 2, "round_robin"), base, settings, pool, slo, start_rate_per_s=4096.0, duration_s=2.0,
                     max_doublings=1, bisections=0)
    assert not bounded.unbounded



def test_a_probe_window_holds_several_lives_of_a_request_and_a_shorter_one_is_warned_of(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli.main import main
    from cluster.loadgen.metrics import Slo
    from cluster.loadgen.workloads import WorkloadConfig, WorkloadKind, build_workload
    from cluster.sim.plan import MIN_WINDOW_LIVES, probe_window_s, request_life_s

    decode_heavy = build_workload(WorkloadConfig(kind=WorkloadKind.FIXED, num_requests=5, input_len=256, output_len=1024), 0)
    slo = Slo(ttft_ms=1000, tpot_ms=50)
    assert request_life_s(slo, decode_heavy) == pytest.approx(1.0 + 0.05 * 1023)  # TTFT + TPOT x (n - 1)
    assert probe_window_s(request_life_s(slo, decode_heavy)) == pytest.approx(MIN_WINDOW_LIVES * 52.15)
    short = build_workload(WorkloadConfig(kind=WorkloadKind.FIXED, num_requests=5, input_len=64, output_len=8), 0)
    assert probe_window_s(request_life_s(slo, short)) == 30.0  # the floor
    assert request_life_s(Slo(ttft_ms=1000), short) == 0.0  # no bound on a request's end

    code = main(["plan", "--instances", "2", "--policies", "round_robin", "--workload", "fixed", "--num-requests", "20",
                 "--input-len", "64", "--output-len", "8", "--duration", "1", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "500",
                 "--out", str(tmp_path), "--no-plots"])
    assert code == 0
    err = capsys.readouterr().err
    assert "shorter than 3 lives of a request" in err and "overstates" in err
    document = json.loads((tmp_path / "plan.json").read_text())
    assert document["window_s"] == 1.0 and document["request_life_s"] == pytest.approx(2.0 + 0.5 * 7)


def test_a_parallel_plan_finds_the_sequential_best_and_repeats_itself(capfd: pytest.CaptureFixture[str]) -> None:
    from cluster.sim.plan import best, plan

    base, settings, pool, slo = _search_case()
    sequential = _sequential_plan()
    parallel, again = (
        plan(base, settings, pool, slo, 3, policies=("round_robin",), duration_s=1.0, jobs=2, probe_progress=progress)
        for progress in (True, False)
    )
    # The workers write a line per probe to the stderr they share with this process (once, for the
    # plan that asked for them).
    lines = [line for line in capfd.readouterr().err.splitlines() if " req/s: " in line]
    assert sorted(re.sub(r" in [0-9.]+ s\)$", "", line) for line in lines) == sorted(
        f"  {r.candidate.label} at {p.rate_per_s:.4g} req/s: {'passed' if p.passed else 'failed'} ({p.simulated_s:.1f} s simulated"
        for r in parallel for p in r.probes
    )
    assert (best(parallel).candidate, best(parallel).max_rate_per_s) == (best(sequential).candidate, best(sequential).max_rate_per_s)
    assert parallel == again  # every probe of every candidate: the workers' timing changes nothing
    assert [r.candidate for r in parallel] == [r.candidate for r in sequential]  # in candidate order
    assert parallel[0] == sequential[0]
    # Two at once: the second candidate starts before the first is done, so it has no rate to beat
    # and is searched from the start to its own maximum; the third is pruned against the first alone.
    assert parallel[1].below_rate_per_s is None and parallel[1].probes[0].rate_per_s == parallel[0].probes[0].rate_per_s
    assert parallel[1].max_rate_per_s == sequential[1].max_rate_per_s > parallel[0].max_rate_per_s
    assert parallel[2].below_rate_per_s == parallel[0].max_rate_per_s and len(parallel[2].probes) == 1
    with pytest.raises(ValueError, match="jobs"):
        plan(base, settings, pool, slo, 3, policies=("round_robin",), duration_s=1.0, jobs=0)


def test_duet_plan_writes_the_stream_interval_it_simulated_into_the_yaml(tmp_path: Path) -> None:
    from cluster.cli.main import main
    from cluster.deploy.config import ClusterConfig

    common = ["plan", "--instances", "2", "--policies", "round_robin", "--splits", "0", "--duration", "1", "--jobs", "1",
              "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50", "--profile", "roofline:h100-sxm:llama-3-8b", "--workload", "fixed",
              "--num-requests", "20", "--input-len", "64", "--output-len", "16", "--no-plots"]
    assert main([*common, "--stream-interval-ms", "25", "--out", str(tmp_path / "merged")]) == 0
    assert ClusterConfig.from_yaml(tmp_path / "merged" / "best-cluster.yaml").engine["stream_interval_ms"] == 25
    assert main([*common, "--out", str(tmp_path / "plain")]) == 0
    assert "stream_interval_ms" not in ClusterConfig.from_yaml(tmp_path / "plain" / "best-cluster.yaml").engine
