"""`duet bench` flags: quick defaults, sweeps, and errors that name the flag (no cluster started)."""

from __future__ import annotations

import math

import pytest

from cluster.cli.bench import add_parser, run, settings_from_args
from cluster.cli.common import CliError
from cluster.cli.main import build_parser
from cluster.loadgen.arrivals import FixedConcurrency, PoissonArrivals
from cluster.loadgen.workloads import WorkloadConfig, WorkloadKind, warmup_config


def parse(*flags: str):
    return build_parser((add_parser,)).parse_args(["bench", *flags])


def test_quick_defaults_are_small_and_sweep_two_rates() -> None:
    settings = settings_from_args(parse("--quick", "--out", "x"))
    assert settings.workload.num_requests == 12 and settings.workload.output_len == 16
    assert settings.points == (PoissonArrivals(4.0), PoissonArrivals(16.0))
    assert settings.warmup == 2
    assert settings.sampling.temperature == 0.0 and settings.sampling.ignore_eos


def test_explicit_flags_win_over_quick_and_defaults() -> None:
    settings = settings_from_args(parse("--quick", "--input-len", "7", "--rate", "1", "2", "inf", "--burstiness", "0.5", "--out", "x"))
    assert settings.workload.input_len == 7
    assert [p.rate_per_s for p in settings.points] == [1.0, 2.0, math.inf]
    assert all(p.burstiness == 0.5 for p in settings.points)
    full = settings_from_args(parse("--out", "x"))
    assert full.workload.num_requests == 100 and full.points == (PoissonArrivals(math.inf),)


def test_concurrency_sweep_and_sampling_flags() -> None:
    settings = settings_from_args(parse("--concurrency", "1", "4", "--no-ignore-eos", "--temperature", "0.8", "--out", "x"))
    assert settings.points == (FixedConcurrency(1), FixedConcurrency(4))
    assert not settings.sampling.ignore_eos and settings.sampling.temperature == 0.8


def test_shared_prefix_counts_and_default_out_dir() -> None:
    settings = settings_from_args(parse("--workload", "shared-prefix", "--num-prefixes", "3", "--suffixes-per-prefix", "5"))
    assert settings.workload.total_requests == 15
    assert settings.out_dir.parts[0] == "bench-results"


def test_warmup_of_shared_prefix_caches_no_measured_prefix() -> None:
    config = WorkloadConfig(kind=WorkloadKind.SHARED_PREFIX, prefix_len=100, input_len=10)
    warm = warmup_config(config, 3)
    assert warm.kind is WorkloadKind.FIXED and warm.num_requests == 3 and warm.input_len == 110
    assert warmup_config(WorkloadConfig(kind=WorkloadKind.MULTI_TURN), 3).kind is WorkloadKind.MULTI_TURN


def test_rate_and_concurrency_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        parse("--rate", "1", "--concurrency", "2")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--rate", "0"], "--rate"),
        (["--burstiness", "0"], "--burstiness"),
        (["--concurrency", "2", "--burstiness", "0.5"], "--burstiness"),
        (["--concurrency", "0"], "--concurrency"),
        (["--input-len", "0"], "--input-len"),
        (["--dataset", "x.json"], "--dataset"),
        (["--workload", "sharegpt"], "--dataset"),
        (["--workload", "shared-prefix", "--num-requests", "5"], "--num-requests"),
        (["--target", "127.0.0.1:1", "--mixed", "2"], "--mixed"),
        (["--slo-ttft-ms", "-5"], "--slo-ttft-ms"),
        (["--warmup", "-1"], "--warmup"),
        (["--request-timeout", "0"], "--request-timeout"),
    ],
)
def test_flag_errors_name_the_flag(flags, named, tmp_path) -> None:
    with pytest.raises(CliError) as info:
        run(parse(*flags, "--out", str(tmp_path)))
    assert info.value.exit_code == 2 and str(info.value).startswith(named + ":")


def test_unreadable_dataset_is_a_usage_error(tmp_path) -> None:
    with pytest.raises(CliError) as info:
        run(parse("--workload", "sharegpt", "--dataset", str(tmp_path / "none.json"), "--out", str(tmp_path)))
    assert info.value.exit_code == 2 and "--dataset" in str(info.value)
