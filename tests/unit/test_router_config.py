"""Router configuration: defaults, from_dict strictness, cross-field rules, recovery chain."""

from __future__ import annotations

import copy

import pytest

from cluster.router.config import (
    AdmissionConfig,
    ConditionalDisaggConfig,
    ConfigError,
    DisaggMode,
    FallbackKind,
    HealthConfig,
    KvAwareParams,
    PlacementConfig,
    RecoveryAction,
    RecoveryConfig,
    RecoveryStep,
    RoundRobinParams,
    RouterConfig,
    StageTimeoutBelowHealthBound,
    StageTimeouts,
    UnknownConfigKey,
)

A = RecoveryAction

FULL = {
    "placement": {
        "prefill_policy": {"name": "kv_aware", "prefill_weight": 2, "temperature": 0.5},
        "generation_policy": {"name": "round_robin"},
        "disaggregation": "conditional",
        "conditional": {"colocate_below_prompt_tokens": 128, "colocate_below_uncached_fraction": 0.2},
        "allowed_fallbacks": ["colocate_when_no_prefill"],
    },
    "recovery": {
        "chain": [
            {"action": "retry_transfer", "max_attempts": 2},
            {"action": "reprefill_elsewhere"},
            {"action": "fail"},
        ]
    },
    "admission": {"max_queued_requests": 64},
    "health": {"heartbeat_interval_s": 0.5, "dead_after_s": 2},
    "timeouts": {"context_s": 120, "reservation_s": 10, "transfer_s": 30.0, "generation_s": 900},
}


def test_defaults_are_valid_and_documented_values():
    config = RouterConfig()
    assert config.placement.prefill_policy == KvAwareParams()
    # Unset: least_loaded for a decode hop, kv_aware where requests run colocated (placement.py Placer).
    assert config.placement.generation_policy is None
    assert config.placement.disaggregation is DisaggMode.ALWAYS
    assert config.placement.allowed_fallbacks == frozenset()
    assert [(s.action, s.max_attempts) for s in config.recovery.chain] == [
        (A.RETRY_TRANSFER, 1),
        (A.RECOMPUTE_LOCAL, 1),
        (A.WAIT_FOR_INSTANCE, 2),
        (A.FAIL, 1),
    ]
    assert config.recovery.step(A.WAIT_FOR_INSTANCE).max_wait_s == 60.0
    assert RouterConfig.from_dict({}) == config


def test_from_dict_builds_every_section():
    config = RouterConfig.from_dict(FULL)
    assert config.placement.prefill_policy == KvAwareParams(prefill_weight=2.0, temperature=0.5)
    assert config.placement.generation_policy == RoundRobinParams()
    assert config.placement.disaggregation is DisaggMode.CONDITIONAL
    assert config.placement.conditional == ConditionalDisaggConfig(128, 0.2)
    assert config.placement.allowed_fallbacks == {FallbackKind.COLOCATE_WHEN_NO_PREFILL}
    assert config.recovery.chain[0] == RecoveryStep(A.RETRY_TRANSFER, 2)
    assert config.recovery.chain[1] == RecoveryStep(A.REPREFILL_ELSEWHERE, 1)
    assert config.admission == AdmissionConfig(64)
    assert config.health == HealthConfig(0.5, 2.0)
    assert type(config.health.dead_after_s) is float
    assert config.timeouts == StageTimeouts(120.0, 10.0, 30.0, 900.0)


def test_to_dict_round_trips():
    config = RouterConfig.from_dict(FULL)
    assert RouterConfig.from_dict(config.to_dict()) == config
    assert RouterConfig.from_dict(RouterConfig().to_dict()) == RouterConfig()


def test_configs_are_frozen():
    # msgspec's frozen structs raise AttributeError, as frozen dataclasses do (FrozenInstanceError).
    with pytest.raises(AttributeError):
        RouterConfig().admission = AdmissionConfig(1)  # type: ignore[misc]


def _with(path: str, value: object) -> dict:
    data = copy.deepcopy(FULL)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[last] = value
    return data


@pytest.mark.parametrize(
    "path",
    [
        "transfer_timeout_s",
        "placement.policy",
        "placement.prefill_policy.temprature",
        "placement.conditional.threshold",
        "health.interval_s",
        "timeouts.decode_s",
    ],
)
def test_unknown_keys_are_rejected_with_their_path(path):
    with pytest.raises(UnknownConfigKey) as info:
        RouterConfig.from_dict(_with(path, 1))
    assert info.value.path == path


def test_unknown_key_inside_a_list_names_its_index():
    data = copy.deepcopy(FULL)
    data["recovery"]["chain"][1]["attempts"] = 3
    with pytest.raises(UnknownConfigKey) as info:
        RouterConfig.from_dict(data)
    assert info.value.path == "recovery.chain[1].attempts"


def test_round_robin_takes_no_params():
    with pytest.raises(UnknownConfigKey) as info:
        RouterConfig.from_dict(
            _with("placement.generation_policy", {"name": "round_robin", "temperature": 1})
        )
    assert info.value.path == "placement.generation_policy.temperature"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("placement.prefill_policy", {"name": "random"}),
        ("placement.prefill_policy", {"temperature": 1.0}),
        ("placement.prefill_policy", "kv_aware"),
        ("placement.prefill_policy.temperature", -1.0),
        ("placement.prefill_policy.temperature", float("inf")),
        ("placement.prefill_policy.prefill_weight", True),
        ("placement.prefill_policy.prefill_weight", "1"),
        ("placement.disaggregation", "sometimes"),
        ("placement.conditional.colocate_below_prompt_tokens", -1),
        ("placement.conditional.colocate_below_prompt_tokens", 1.5),
        ("placement.conditional.colocate_below_uncached_fraction", 1.5),
        ("placement.allowed_fallbacks", ["colocate_always"]),
        ("placement.allowed_fallbacks", ["colocate_when_no_prefill", "colocate_when_no_prefill"]),
        ("placement.allowed_fallbacks", "colocate_when_no_prefill"),
        ("recovery.chain", []),
        ("recovery.chain", [{"action": "retry_transfer"}]),
        ("recovery.chain", [{"action": "fail"}, {"action": "retry_transfer"}]),
        ("recovery.chain", [{"action": "retry_transfer"}, {"action": "retry_transfer"}, {"action": "fail"}]),
        ("recovery.chain", [{"action": "retry_transfer", "max_attempts": 0}, {"action": "fail"}]),
        ("recovery.chain", [{"action": "fail", "max_attempts": 3}]),
        ("recovery.chain", [{"action": "pray"}, {"action": "fail"}]),
        ("admission.max_queued_requests", 0),
        ("admission.max_queued_requests", True),
        ("health.heartbeat_interval_s", 0),
        ("health.dead_after_s", 0.5),  # not above the heartbeat interval
        ("health", "fast"),
        ("timeouts.transfer_s", -5),
    ],
)
def test_invalid_values_are_rejected_with_their_path(path, value):
    with pytest.raises(ConfigError) as info:
        RouterConfig.from_dict(_with(path, value))
    assert info.value.path.startswith(path)
    assert not isinstance(info.value, UnknownConfigKey)


def test_error_path_names_the_exact_field():
    with pytest.raises(ConfigError) as info:
        RouterConfig.from_dict(_with("placement.prefill_policy.temperature", -1.0))
    assert info.value.path == "placement.prefill_policy.temperature"
    with pytest.raises(ConfigError) as info:
        RouterConfig.from_dict(
            _with("recovery.chain", [{"action": "retry_transfer", "max_attempts": 0}, {"action": "fail"}])
        )
    assert info.value.path == "recovery.chain[0].max_attempts"


def test_conditional_mode_needs_a_threshold():
    data = _with(
        "placement.conditional", {"colocate_below_prompt_tokens": 0, "colocate_below_uncached_fraction": 0}
    )
    with pytest.raises(ConfigError) as info:
        RouterConfig.from_dict(data)
    assert info.value.path == "placement.conditional"
    # The same thresholds are fine when the mode does not read them.
    data["placement"]["disaggregation"] = "always"
    RouterConfig.from_dict(data)


@pytest.mark.parametrize("stage", ["context_s", "reservation_s", "transfer_s", "generation_s"])
def test_stage_timeout_shorter_than_the_health_bound_is_rejected(stage):
    data = _with(f"timeouts.{stage}", 1.5)  # dead_after_s is 2
    with pytest.raises(StageTimeoutBelowHealthBound) as info:
        RouterConfig.from_dict(data)
    assert info.value.path == f"timeouts.{stage}"
    RouterConfig.from_dict(_with(f"timeouts.{stage}", 2.0))  # equal is allowed


def test_stage_rule_applies_to_direct_construction_too():
    with pytest.raises(StageTimeoutBelowHealthBound):
        RouterConfig(health=HealthConfig(1.0, 10.0), timeouts=StageTimeouts(reservation_s=5))


def test_direct_construction_validates_and_normalises():
    assert HealthConfig(dead_after_s=5).dead_after_s == 5.0
    with pytest.raises(ConfigError) as info:
        KvAwareParams(temperature=True)
    assert info.value.path == "temperature"
    with pytest.raises(ConfigError):
        PlacementConfig(prefill_policy="kv_aware")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        RouterConfig(health={"dead_after_s": 3})  # type: ignore[arg-type]


def test_top_level_must_be_a_mapping():
    with pytest.raises(ConfigError):
        RouterConfig.from_dict(["placement"])  # type: ignore[arg-type]


# --- recovery chain ---------------------------------------------------------------------------------


def test_default_chain_retries_once_then_recomputes_then_waits_then_fails():
    chain = RecoveryConfig()
    assert chain.next_action({}) is A.RETRY_TRANSFER
    assert chain.next_action({A.RETRY_TRANSFER: 1}) is A.RECOMPUTE_LOCAL
    assert chain.next_action({A.RETRY_TRANSFER: 1, A.RECOMPUTE_LOCAL: 1}) is A.WAIT_FOR_INSTANCE
    assert chain.next_action({A.RETRY_TRANSFER: 1, A.RECOMPUTE_LOCAL: 1, A.WAIT_FOR_INSTANCE: 2}) is A.FAIL
    # Waiting applies only to an outage (cluster/router/flow.py decides).
    assert chain.next_action({A.RETRY_TRANSFER: 1, A.RECOMPUTE_LOCAL: 1}, frozenset({A.RETRY_TRANSFER})) is A.FAIL


def test_chain_skips_actions_the_failure_rules_out():
    chain = RecoveryConfig()
    # The sender died: the transfer cannot be retried.
    assert (
        chain.next_action({}, applicable=frozenset({A.RECOMPUTE_LOCAL, A.REPREFILL_ELSEWHERE}))
        is A.RECOMPUTE_LOCAL
    )
    assert chain.next_action({}, applicable=frozenset()) is A.FAIL


def test_chain_honours_max_attempts():
    chain = RecoveryConfig((RecoveryStep(A.RETRY_TRANSFER, 3), RecoveryStep(A.FAIL)))
    assert [chain.next_action({A.RETRY_TRANSFER: n}) for n in range(5)] == [A.RETRY_TRANSFER] * 3 + [
        A.FAIL
    ] * 2


def test_the_startup_line_names_what_an_unset_generation_policy_stands_for():
    from cluster.router.config import generation_policy_summary

    assert generation_policy_summary(RouterConfig().placement) == "least_loaded (kv_aware where requests run colocated)"
    never = RouterConfig.from_dict({"placement": {"disaggregation": "never"}}).placement
    assert generation_policy_summary(never) == "kv_aware (unset: every request runs colocated)"
    chosen = RouterConfig.from_dict({"placement": {"generation_policy": {"name": "round_robin"}, "disaggregation": "never"}}).placement
    assert generation_policy_summary(chosen) == "round_robin"
