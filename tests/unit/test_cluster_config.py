"""The cluster configuration (cluster/deploy/config.py) and the loader under it (worker/config.py):
unknown keys, wrong types and out-of-range values name their path at every depth, the sections other
areas own are validated at load, null sections mean their defaults, direct construction validates."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from cluster.deploy.config import ClusterConfig, FrontendConfig, InstanceGroup, RayConfig
from cluster.router.config import (
    ConfigError,
    HealthConfig,
    KvAwareParams,
    LeastLoadedParams,
    PlacementConfig,
    RoundRobinParams,
    RouterConfig,
    StageTimeoutBelowHealthBound,
    UnknownConfigKey,
)
from worker.config import DistinctSet, load_config
from worker.engine_types import EngineConfig
from worker.kv_transfer.config import SenderConfig, TransferConfigError
from worker.kv_transfer.faults import FaultPlan, FaultPlanError
from worker.protocol import EngineInputError, InstanceRole

TWO_ROLES = [{"role": "PREFILL"}, {"role": "GENERATION"}]


def _error(data: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_dict(data)
    return info.value


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"modle": "x"}, "modle"),
        ({"frontend": {"prot": 1}}, "frontend.prot"),
        ({"ray": {"adress": "auto"}}, "ray.adress"),
        ({"instances": [{"role": "PREFILL"}, {"role": "GENERATION", "num_cpuz": 1}]}, "instances[1].num_cpuz"),
        ({"router": {"placement": {"prefill_polciy": {"name": "kv_aware"}}}}, "router.placement.prefill_polciy"),
        ({"router": {"placement": {"prefill_policy": {"name": "kv_aware", "temprature": 1}}}}, "router.placement.prefill_policy.temprature"),
        ({"router": {"recovery": {"chain": [{"action": "fail", "attempts": 1}]}}}, "router.recovery.chain[0].attempts"),
        ({"kv_transfer": {"sendr": {}}}, "kv_transfer.sendr"),
        ({"kv_transfer": {"sender": {"num_stream": 2}}}, "kv_transfer.sender.num_stream"),
        ({"faults": {"rules": [{"kind": "drop", "chunks": 1}]}}, "faults.rules[0].chunks"),
        ({"engine": {"tokens_per_blok": 16}}, "engine.tokens_per_blok"),
        ({"instances": [{"role": "PREFILL"}, {"role": "GENERATION", "engine": {"tokens_per_blok": 16}}]}, "instances[1].engine.tokens_per_blok"),
    ],
)
def test_unknown_keys_at_every_depth_name_their_path(data, path) -> None:
    error = _error(data)
    assert isinstance(error, UnknownConfigKey)
    assert error.path == path
    assert str(error).startswith(f"{path}: ")


def test_a_bad_top_level_engine_key_is_named_under_engine_not_under_a_group() -> None:
    # It was reported as instances[0].engine.tokens_per_blok: the key is not in any group's section.
    assert _error({"engine": {"tokens_per_blok": 16}, "instances": TWO_ROLES}).path == "engine.tokens_per_blok"
    assert _error({"engine": {"max_num_tokens": "many"}}).path == "engine.max_num_tokens"
    # A group's own setting is named under the group, even when the cluster's engine sets it too.
    data = {"engine": {"max_num_tokens": 512}, "instances": [{"role": "PREFILL"}, {"role": "GENERATION", "engine": {"max_num_tokens": 0}}]}
    assert _error(data).path == "instances[1].engine.max_num_tokens"
    # A rule between settings neither section set is the group's (its engine is what fails).
    assert _error({"engine": {"tokens_per_block": 48}}).path == "instances[0].engine.chunk_unit_tokens"
    # Settings that are only valid together are fine where they meet.
    ClusterConfig.from_dict(
        {"engine": {"tokens_per_block": 48}, "instances": [{"role": r, "engine": {"chunk_unit_tokens": 96}} for r in ("PREFILL", "GENERATION")]}
    )


@pytest.mark.parametrize(
    ("data", "path", "words"),
    [
        ({"frontend": {"port": "50051"}}, "frontend.port", "expected `int`, got `str`"),
        ({"frontend": {"port": 70000}}, "frontend.port", "<= 65535, got 70000"),
        ({"instances": [{"role": "PREFILL", "count": -1}, {"role": "GENERATION"}]}, "instances[0].count", ">= 0, got -1"),
        ({"instances": [{"role": "PREFILL", "num_cpus": True}, {"role": "GENERATION"}]}, "instances[0].num_cpus", "got `bool`"),
        ({"instances": [{"role": "PREFILL"}, {"role": "DECODE"}]}, "instances[1].role", "'DECODE'; expected one of ['PREFILL', 'GENERATION', 'MIXED']"),
        ({"instances": [{"role": "PREFILL"}, {"count": 1}]}, "instances[1].role", "is required"),
        ({"instances": [{"role": "PREFILL", "resources": {"gpu_node": -1}}, {"role": "GENERATION"}]}, "instances[0].resources.gpu_node", ">= 0"),
        ({"dtype": "fp8"}, "dtype", "'fp8'"),
        ({"device": "tpu"}, "device", "must be auto, cpu or cuda[:N]"),
        ({"max_restarts": -1}, "max_restarts", ">= 0, got -1"),
        ({"actor_start_timeout_s": float("inf")}, "actor_start_timeout_s", "finite"),
        ({"ray": {"num_cpus": 0.5}}, "ray.num_cpus", ">= 1.0, got 0.5"),
        ({"router": {"health": {"dead_after_s": -1}}}, "router.health.dead_after_s", "> 0.0, got -1"),
        ({"router": {"placement": {"disaggregation": "sometimes"}}}, "router.placement.disaggregation", "'sometimes'"),
        ({"engine": {"capacity_policy": "fastest"}}, "engine.capacity_policy", "'fastest'"),
        ({"kv_transfer": {"sender": {"max_chunk_bytes": 10}}}, "kv_transfer.sender.max_chunk_bytes", ">= 65536, got 10"),
        ({"kv_transfer": {"receiver": {"port": -1}}}, "kv_transfer.receiver.port", ">= 0, got -1"),
        ({"kv_transfer": {"data_plane": "rdma"}}, "kv_transfer.data_plane", "'rdma'"),
        ({"faults": {"rules": [{"kind": "drop", "probability": 2}]}}, "faults.rules[0].probability", "<= 1.0, got 2"),
        ({"faults": {"rules": [{"kind": "delay"}]}}, "faults.rules[0]", "needs seconds"),
        ({"frontend": {"tls_cert": "cert.pem"}}, "frontend.tls_cert", "go together"),
    ],
)
def test_wrong_types_and_out_of_range_values_name_the_field(data, path, words) -> None:
    error = _error(data)
    assert not isinstance(error, UnknownConfigKey)
    assert error.path == path
    assert words in error.detail


def test_cross_field_rules_keep_their_error_types() -> None:
    data = {"router": {"health": {"heartbeat_interval_s": 1, "dead_after_s": 10}, "timeouts": {"reservation_s": 5}}}
    with pytest.raises(StageTimeoutBelowHealthBound) as info:
        ClusterConfig.from_dict(data)
    assert info.value.path == "router.timeouts.reservation_s"
    assert _error({"instances": [{"role": "PREFILL"}]}).path == "instances"
    assert _error({"instances": [{"role": "PREFILL", "count": 0}, {"role": "GENERATION", "count": 0}]}).detail == "deploys no instance"


def test_defaults_and_null_sections() -> None:
    config = ClusterConfig.from_dict({})
    assert config == ClusterConfig()
    assert [(g.role, g.count) for g in config.instances] == [(InstanceRole.PREFILL, 1), (InstanceRole.GENERATION, 1)]
    assert config.frontend.port == 50051 and config.ray.dashboard_host == "127.0.0.1" and config.faults is None
    # YAML writes `frontend:` with everything under it commented out as null: the defaults.
    nulls = ClusterConfig.from_dict(
        {"frontend": None, "router": None, "engine": None, "kv_transfer": None, "instances": [{"role": "prefill", "resources": None}, {"role": "GENERATION", "engine": None}]}
    )
    assert nulls == config
    # Where null means something (no metrics endpoint), it is kept.
    assert ClusterConfig.from_dict({"frontend": {"metrics_port": None}}).frontend.metrics_port is None


def test_a_deployment_without_prefill_instances_serves_colocated() -> None:
    config = ClusterConfig.from_dict({"instances": [{"role": "MIXED", "count": 2}]})
    assert config.router.placement.disaggregation.value == "never"
    # Unless the placement is given, and then it must say so.
    assert _error({"instances": [{"role": "MIXED"}], "router": {"placement": {}}}).path == "router.placement.disaggregation"
    assert ClusterConfig().with_instances({InstanceRole.PREFILL: 0}).router.placement.disaggregation.value == "never"


def test_plain_data_sections_stay_plain_and_engine_configs_are_built_per_group() -> None:
    config = ClusterConfig.from_dict(
        {
            "engine": {"num_blocks": 64, "capacity_policy": "max_utilization"},
            "instances": [{"role": "PREFILL", "engine": {"max_num_tokens": 512}}, {"role": "GENERATION"}],
            "kv_transfer": {"sender": {"num_streams": 2}},
            "faults": {"seed": 3, "rules": [{"kind": "drop"}]},
        }
    )
    assert config.kv_transfer == {"sender": {"num_streams": 2}} and config.faults == {"seed": 3, "rules": [{"kind": "drop"}]}
    prefill = config.engine_config(config.instances[0])
    assert (prefill.role, prefill.num_blocks, prefill.max_num_tokens) == (InstanceRole.PREFILL, 64, 512)
    assert prefill.capacity_policy.name == "MAX_UTILIZATION"
    assert config.engine_config(config.instances[1]).max_num_tokens == 2048


def test_callers_that_replace_sections_as_dataclasses_still_validate() -> None:
    # cluster/cli/main.py applies flags with dataclasses.replace.
    config = ClusterConfig()
    assert dataclasses.replace(config, frontend=dataclasses.replace(config.frontend, port=0)).frontend.port == 0
    assert dataclasses.replace(config.ray, address="auto").address == "auto"
    with pytest.raises(ConfigError):
        dataclasses.replace(config.frontend, port=-1)
    assert [f.name for f in dataclasses.fields(config.ray)] == list(RayConfig.__struct_fields__)


# --- the tagged union of placement policies --------------------------------------------------------


def test_placement_policies_are_a_union_tagged_by_name() -> None:
    placement = RouterConfig.from_dict(
        {"placement": {"prefill_policy": {"name": "kv_aware", "temperature": 0.5}, "generation_policy": {"name": "round_robin"}}}
    ).placement
    assert placement.prefill_policy == KvAwareParams(prefill_weight=1.0, temperature=0.5)
    assert placement.generation_policy == RoundRobinParams()
    # The name is written back, so the plain form reads back the same policy.
    assert RouterConfig(placement=placement).to_dict()["placement"]["generation_policy"] == {"name": "round_robin"}
    assert msgspec.to_builtins(LeastLoadedParams()) == {"name": "least_loaded"}
    for policy, path in [
        ({"name": "random"}, "placement.prefill_policy.name"),
        ({"temperature": 1.0}, "placement.prefill_policy.name"),
        ({"name": "least_loaded", "temperature": 1.0}, "placement.prefill_policy.temperature"),
    ]:
        with pytest.raises(ConfigError) as info:
            RouterConfig.from_dict({"placement": {"prefill_policy": policy}})
        assert info.value.path == path
    with pytest.raises(ConfigError) as info:
        RouterConfig.from_dict({"placement": {"prefill_policy": {"name": "random"}}})
    assert "'random'" in info.value.detail


# --- the loader itself (worker/config.py) ----------------------------------------------------------


def test_direct_construction_validates_and_normalises() -> None:
    assert type(HealthConfig(dead_after_s=5).dead_after_s) is float
    assert SenderConfig(checksum_algorithms=["CRC32"]).checksum_algorithms == ("CRC32",)
    assert isinstance(PlacementConfig(allowed_fallbacks=frozenset()).allowed_fallbacks, DistinctSet)
    with pytest.raises(ConfigError) as info:
        InstanceGroup("PREFILL")  # type: ignore[arg-type]  # a name is for loading; code passes the member
    assert info.value.path == "role"
    with pytest.raises(ConfigError) as info:
        FrontendConfig(port=True)  # type: ignore[arg-type]
    assert info.value.path == "port"
    with pytest.raises(EngineInputError) as engine_error:
        EngineConfig(max_seq_len=0)
    assert engine_error.value.field == "max_seq_len"
    with pytest.raises(EngineInputError) as engine_error:
        EngineConfig(sender_lease_s=float("nan"))
    assert engine_error.value.field == "sender_lease_s"


def test_each_area_keeps_its_error_type() -> None:
    with pytest.raises(EngineInputError) as engine_error:
        EngineConfig().with_overrides(tokens_per_blok=16)
    assert engine_error.value.field == "tokens_per_blok"
    with pytest.raises(TransferConfigError, match=r"kv.sender: unknown SenderConfig field\(s\) \['x'\]"):
        load_config(SenderConfig, {"x": 1}, "kv.sender")
    with pytest.raises(FaultPlanError, match=r"^faults\.rules\[1\]\.seconds: expected `float` >= 0.0, got -1$"):
        FaultPlan.from_mapping({"rules": [{"kind": "drop"}, {"kind": "delay", "seconds": -1}]})
    # The cluster words the same problems as ConfigErrors naming the whole path.
    with pytest.raises(ConfigError) as info:
        load_config(FaultPlan, {"rules": [{"kind": "delay"}]}, "faults", errors=ConfigError.from_problem)
    assert info.value.path == "faults.rules[0]" and "needs seconds" in info.value.detail


def test_a_set_written_as_a_list_must_not_repeat() -> None:
    with pytest.raises(ConfigError) as info:
        RouterConfig.from_dict({"placement": {"allowed_fallbacks": ["colocate_when_no_prefill"] * 2}})
    assert info.value.path == "placement.allowed_fallbacks" and "duplicates" in info.value.detail
    with pytest.raises(ConfigError) as info:
        RouterConfig.from_dict({"placement": {"allowed_fallbacks": ["colocate_always"]}})
    assert "'colocate_always' (entry 0)" in info.value.detail


def test_kv_transfer_data_plane_reaches_both_sides_of_every_instance() -> None:
    from cluster.deploy.launch import Deployment

    config = ClusterConfig.from_dict({"kv_transfer": {"data_plane": "grpc", "sender": {"num_streams": 2}}})
    deployment = Deployment(config)
    assert deployment._kv_section("sender") == {"num_streams": 2, "data_plane": "grpc"}
    assert deployment._kv_section("receiver") == {"data_plane": "grpc"}
    assert Deployment(ClusterConfig.from_dict({}))._kv_section("sender") is None


def test_kv_receivers_bind_loopback_in_the_embedded_cluster_else_their_node_or_bind_host(monkeypatch) -> None:
    from cluster.deploy.launch import transfer_bind_host

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    one_host = [{"NodeManagerAddress": "192.0.2.2", "Alive": True}] * 3  # Ray reports the routable address
    two_hosts = [{"NodeManagerAddress": "10.0.0.5", "Alive": True}, {"NodeManagerAddress": "10.0.0.6", "Alive": True}]
    assert transfer_bind_host(ClusterConfig.from_dict({}), one_host) == "127.0.0.1"  # duet starts its own Ray
    assert transfer_bind_host(ClusterConfig.from_dict({}), two_hosts) == "auto"  # a caller joined several hosts
    gone = [*one_host, {"NodeManagerAddress": "10.0.0.6", "Alive": False}]
    assert transfer_bind_host(ClusterConfig.from_dict({}), gone) == "127.0.0.1"
    joined = {"ray": {"address": "10.0.0.5:6379"}}
    assert transfer_bind_host(ClusterConfig.from_dict(joined), one_host) == "auto"  # each node's own address
    with_host = {**joined, "kv_transfer": {"bind_host": "10.1.2.3"}}
    assert transfer_bind_host(ClusterConfig.from_dict(with_host), two_hosts) == "10.1.2.3"
    assert transfer_bind_host(ClusterConfig.from_dict({"kv_transfer": {"bind_host": "0.0.0.0"}}), one_host) == "0.0.0.0"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert transfer_bind_host(ClusterConfig.from_dict({}), one_host) == "auto"
    with pytest.raises(ConfigError) as raised:
        ClusterConfig.from_dict({"kv_transfer": {"bind_host": ""}})
    assert "kv_transfer.bind_host" in str(raised.value)


def test_kv_transfers_are_mtls_as_soon_as_they_can_cross_ray_nodes(monkeypatch) -> None:
    from cluster.deploy.launch import transfer_tls_wanted

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    lone = [{"NodeManagerAddress": "192.0.2.2", "Alive": True}, {"NodeManagerAddress": "192.0.2.3", "Alive": False}]
    several = [{"NodeManagerAddress": "127.0.0.1", "Alive": True}] * 2  # two Ray nodes on one host are two nodes
    assert not transfer_tls_wanted(ClusterConfig.from_dict({}), lone)
    assert transfer_tls_wanted(ClusterConfig.from_dict({}), several)
    assert transfer_tls_wanted(ClusterConfig.from_dict({"ray": {"address": "10.0.0.5:6379"}}), lone)  # nodes may join
    assert not transfer_tls_wanted(ClusterConfig.from_dict({"kv_transfer": {"tls": "off"}}), several)
    assert transfer_tls_wanted(ClusterConfig.from_dict({"kv_transfer": {"tls": "on"}}), lone)  # asked for
    files = {"tls_certificate_chain": "c.pem", "tls_private_key": "k.pem", "tls_root_certificates": "ca.pem"}
    assert transfer_tls_wanted(ClusterConfig.from_dict({"kv_transfer": files}), lone)  # certificates given: used
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert transfer_tls_wanted(ClusterConfig.from_dict({}), lone)
    for bad in ({"tls": "always"}, {"tls": True}, {"tls_validity_days": 0}, {"tls_private_key": ""}):
        with pytest.raises(ConfigError) as raised:
            ClusterConfig.from_dict({"kv_transfer": bad})
        assert f"kv_transfer.{next(iter(bad))}" in str(raised.value)
    for bad, needle in [
        ({"tls_certificate_chain": "c.pem"}, "go together"),
        ({**files, "tls": "off"}, "tls is off, yet certificates are configured"),
        ({"tls_server_name": "kv.example"}, "configure them too"),
    ]:
        with pytest.raises(ConfigError) as raised:
            ClusterConfig.from_dict({"kv_transfer": bad})
        assert needle in str(raised.value)


def test_the_deployment_ca_is_made_only_for_mtls_kept_for_reissue_and_tls_off_is_a_warning(monkeypatch, caplog) -> None:
    import logging

    from cryptography import x509

    from cluster.deploy.launch import Deployment

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    several = [{"NodeManagerAddress": "127.0.0.1", "Alive": True}] * 2
    deployment = Deployment(ClusterConfig.from_dict({"kv_transfer": {"tls_validity_days": 30}}))
    issue = deployment._transfer_certificates(several)
    assert issue is not None and deployment.transfer_ca_pem is not None
    first, again = issue("prefill-0"), issue("prefill-0")
    assert first.root_certificates_pem == again.root_certificates_pem == deployment.transfer_ca_pem
    # A restarted instance gets another certificate of the same CA (the deployment keeps its CA).
    serials = {x509.load_pem_x509_certificate(tls.certificate_chain_pem).serial_number for tls in (first, again)}
    assert len(serials) == 2
    assert deployment._transfer_ca is not None and deployment._transfer_ca.issue == issue
    lone = Deployment(ClusterConfig.from_dict({}))
    assert lone._transfer_certificates(several[:1]) is None and lone.transfer_ca_pem is None
    assert Deployment(ClusterConfig.from_dict({"kv_transfer": {"tls": "on"}}))._transfer_certificates(several[:1]) is not None
    off = Deployment(ClusterConfig.from_dict({"kv_transfer": {"tls": "off"}}))
    with caplog.at_level(logging.WARNING, logger="cluster.deploy.launch"):
        assert off._transfer_certificates(several) is None
    assert any("kv_transfer.tls is off" in record.getMessage() for record in caplog.records)


def test_configured_certificates_go_to_every_instance_and_are_not_reissued(monkeypatch, tmp_path) -> None:
    from cluster.deploy.launch import Deployment, DeploymentError
    from cluster.deploy.preflight import StartupError, check_before_start
    from worker.kv_transfer.certificates import DeploymentCa

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    mine = DeploymentCa("users-own").issue("any")  # stands for certificates a user made
    (tmp_path / "chain.pem").write_bytes(mine.certificate_chain_pem)
    (tmp_path / "key.pem").write_bytes(mine.private_key_pem)
    (tmp_path / "ca.pem").write_bytes(mine.root_certificates_pem)
    files = {
        "tls_certificate_chain": str(tmp_path / "chain.pem"),
        "tls_private_key": str(tmp_path / "key.pem"),
        "tls_root_certificates": str(tmp_path / "ca.pem"),
        "tls_server_name": "kv.example.internal",
    }
    lone = [{"NodeManagerAddress": "127.0.0.1", "Alive": True}]
    deployment = Deployment(ClusterConfig.from_dict({"kv_transfer": files}))
    issue = deployment._transfer_certificates(lone)  # configured: mTLS even on one node
    assert issue is not None
    for instance_id in ("prefill-0", "generation-0"):
        tls = issue(instance_id)
        assert (tls.certificate_chain_pem, tls.private_key_pem) == (mine.certificate_chain_pem, mine.private_key_pem)
        assert tls.server_name_override == "kv.example.internal"
    assert deployment.transfer_ca_pem == mine.root_certificates_pem
    assert deployment._transfer_ca is None  # the user's certificates are the user's to renew

    (tmp_path / "key.pem").write_bytes(b"not a key")
    with pytest.raises(DeploymentError) as raised:
        Deployment(ClusterConfig.from_dict({"kv_transfer": files}))._transfer_certificates(lone)
    assert "private_key_pem must be PEM" in str(raised.value)
    missing = {**files, "tls_root_certificates": str(tmp_path / "absent.pem")}
    with pytest.raises(StartupError) as failed:  # `duet serve` says so before starting Ray
        check_before_start(ClusterConfig.from_dict({"kv_transfer": missing, "frontend": {"port": 0, "metrics_port": 0, "http_port": 0}}))
    assert "kv_transfer.tls_root_certificates" in str(failed.value)
