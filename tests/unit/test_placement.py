"""Placement policies and the two-hop placer on synthetic snapshots."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.router.config import (
    ConditionalDisaggConfig,
    DisaggMode,
    FallbackKind,
    KvAwareParams,
    LeastLoadedParams,
    PlacementConfig,
    RoundRobinParams,
)
from cluster.router.placement import (
    Candidate,
    ConditionalDisagg,
    DisaggReason,
    InstanceHealth,
    InvalidPlacementInput,
    KvAware,
    LeastLoaded,
    NoInstanceAvailable,
    PlacementRequest,
    Placer,
    RoundRobin,
    build_policy,
)
from cluster.router.prefix_index import PrefixIndex
from cluster.router.snapshot import InstanceSnapshot
from cluster.router.state import Route
from scheduler.block_hash import PrefixEvent, PrefixEventKind, block_hash_chain
from worker.protocol import EngineLoad, InstanceRole

TPB = 16
HEALTHY = InstanceHealth.HEALTHY


def snap(
    instance_id: str,
    role: InstanceRole = InstanceRole.GENERATION,
    *,
    total: int = 1000,
    free: int = 1000,
    running: int = 0,
    queued_tokens: int = 0,
    pending_tokens: int | None = None,  # None: the queue alone is pending
    stored: tuple[int, ...] = (),
) -> InstanceSnapshot:
    load = EngineLoad(
        role=role,
        total_blocks=total,
        free_blocks=free,
        tokens_per_block=TPB,
        queued_requests=1 if queued_tokens else 0,
        running_requests=running,
        queued_prompt_tokens=queued_tokens,
        tokens_in_flight=0,
        num_paused=0,
        prefix_events=tuple(PrefixEvent(PrefixEventKind.STORED, block_hash) for block_hash in stored),
        pending_context_tokens=queued_tokens if pending_tokens is None else pending_tokens,
    )
    return InstanceSnapshot(instance_id, load)


def cand(*args, health: InstanceHealth = HEALTHY, **kwargs) -> Candidate:
    return Candidate(snap(*args, **kwargs), health)


def request(prompt_tokens: int = 160, decode_tokens: int = 32, hashes: tuple[int, ...] | None = None):
    if hashes is None:
        hashes = tuple(range(1000, 1000 + prompt_tokens // TPB))
    return PlacementRequest("r", prompt_tokens, hashes, decode_tokens)


# --- round robin -----------------------------------------------------------------------------------


def test_round_robin_cycles_in_id_order():
    policy = RoundRobin(RoundRobinParams())
    pool = [cand("c"), cand("a"), cand("b")]
    picks = [policy.choose(request(), pool, {}).instance_id for _ in range(7)]
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_skips_unhealthy_and_survives_membership_changes():
    policy = RoundRobin()
    pool = [cand("a"), cand("b", health=InstanceHealth.DRAINING), cand("c")]
    assert [policy.choose(request(), pool, {}).instance_id for _ in range(3)] == ["a", "c", "a"]
    # "b" recovers: the rotation continues after the last choice, it does not restart.
    pool = [cand("a"), cand("b"), cand("c")]
    assert [policy.choose(request(), pool, {}).instance_id for _ in range(3)] == ["b", "c", "a"]
    # "b" leaves while it is next.
    pool = [cand("a"), cand("c")]
    assert policy.choose(request(), pool, {}).instance_id == "c"


def test_round_robin_scores_are_turns():
    placement = RoundRobin().choose(request(), [cand("a"), cand("b")], {})
    assert dict(placement.scores) == {"a": 0.0, "b": 1.0}
    assert placement.policy == "round_robin"


# --- least loaded ----------------------------------------------------------------------------------


def test_least_loaded_picks_the_freest_by_llumnix_freeness():
    pool = [
        cand("a", free=500, running=4),  # 125
        cand("b", free=300, running=1),  # 300
        cand("c", free=900, running=2, queued_tokens=16 * 400),  # (900-400)/2 = 250
        cand("d", free=200, running=0),  # 200 / max(1, 0)
    ]
    placement = LeastLoaded(LeastLoadedParams()).choose(request(), pool, {})
    assert placement.instance_id == "b"
    assert dict(placement.scores) == {"a": 125.0, "b": 300.0, "c": 250.0, "d": 200.0}


def test_least_loaded_counts_partial_queued_blocks_and_can_go_negative():
    assert LeastLoaded.freeness(snap("a", free=10, running=1, queued_tokens=17 * TPB + 1).load) == -8.0


def test_least_loaded_breaks_ties_by_instance_id():
    pool = [cand("z", free=100), cand("m", free=100, running=1), cand("q", free=50)]
    assert LeastLoaded().choose(request(), pool, {}).instance_id == "m"


# --- kv aware --------------------------------------------------------------------------------------


def test_kv_aware_cost_terms():
    policy = KvAware(KvAwareParams(prefill_weight=2.0))
    # 150 prompt tokens = 10 blocks (rounded up), 8 cached; 40 queued prompt tokens = 3 blocks;
    # 300 used blocks + (150 + 50) tokens held = 13 blocks, of which the 8 cached are shared: 5 added.
    cost = policy.cost(
        PlacementRequest("r", 150, tuple(range(9)), 50), snap("a", free=700, queued_tokens=40).load, cached=8
    )
    assert (cost.uncached_prompt_blocks, cost.active_prefill_blocks, cost.decode_blocks) == (2, 3, 305)
    assert cost.cost == 2.0 * (2 + 3) + 305


def test_kv_aware_counts_the_contexts_in_progress_not_only_the_queued_ones():
    # Two PREFILL instances with nothing queued: "a" computes a 2,048-token context admitted in one
    # step (512 tokens done: 1,536 pending = 96 blocks), "b" nothing. Counting the queue alone, both
    # cost the request's 10 uncached blocks and the tie goes to "a", the busy one.
    req = request(prompt_tokens=160)
    busy = cand("a", InstanceRole.PREFILL, running=1, pending_tokens=1536)
    placement = KvAware().choose(req, [busy, cand("b", InstanceRole.PREFILL)], {})
    assert placement.instance_id == "b"
    assert dict(placement.scores) == {"a": 10 + 96, "b": 10}
    # The pending count includes the queue: a queue alone is charged as pending.
    assert KvAware().cost(req, snap("c", queued_tokens=40).load, 0).active_prefill_blocks == 3
    assert KvAware().cost(req, snap("c", queued_tokens=40, pending_tokens=200).load, 0).active_prefill_blocks == 13


def test_kv_aware_prefill_instance_is_charged_compute_not_memory():
    # A prefill instance decodes nothing and hands its KV over: its cost is the prefill work
    # (uncached + queued prompt blocks); memory counts only when the prompt does not fit now.
    policy = KvAware()
    req = request(prompt_tokens=160, decode_tokens=480)
    assert policy.cost(req, snap("p", InstanceRole.PREFILL).load, 0).decode_blocks == 0
    assert policy.cost(req, snap("p", InstanceRole.PREFILL, free=5).load, 0).decode_blocks == 10
    assert policy.cost(req, snap("g", InstanceRole.GENERATION).load, 0).decode_blocks == 40


@pytest.mark.parametrize(
    ("cached_used_blocks", "winner"),
    [
        # prompt 160 tokens = 10 blocks, decode 32 tokens -> the request holds 12 blocks.
        # A caches 8 blocks, shared: cost = 2 + used_A + (12 - 8); B caches nothing: 10 + 40 + 12 = 62.
        (45, "a"),  # 51 < 62: the cached prefix wins
        (56, "a"),  # 62 == 62: tie to the smaller id
        (57, "b"),  # 63 > 62: A's load outweighs its cache
    ],
)
def test_kv_aware_prefers_the_cached_prefix_unless_load_outweighs_it(cached_used_blocks, winner):
    req = request(prompt_tokens=160, decode_tokens=32)
    pool = [cand("a", free=1000 - cached_used_blocks), cand("b", free=960)]
    placement = KvAware().choose(req, pool, {"a": 8})
    assert placement.instance_id == winner
    assert dict(placement.scores) == {"a": 2 + cached_used_blocks + 12 - 8, "b": 62.0}


def test_kv_aware_keeps_a_shared_prefix_on_the_instance_whose_request_already_holds_it():
    # Two MIXED instances; a 2,048-token prefix (128 blocks) + 128-token suffix, 64 tokens out: the
    # request holds 140 blocks. "warm" caches the prefix and runs one request on it (140 blocks in
    # use, the prefix among them); "cold" is idle. Charging the shared prefix again made warm cost
    # 8 + 140 + 140 = 288 against cold's 136 + 140 = 276, and the prefix was computed a second time.
    req = request(prompt_tokens=2176, decode_tokens=64)
    warm = cand("warm", InstanceRole.MIXED, free=1000 - 140, running=1)
    cold = cand("cold", InstanceRole.MIXED)
    placement = KvAware().choose(req, [cold, warm], {"warm": 128})
    assert dict(placement.scores) == {"cold": 136 + 140, "warm": 8 + 140 + (140 - 128)}
    assert placement.instance_id == "warm"
    # The load still counts: with enough other requests on warm, cold wins.
    busy = cand("warm", InstanceRole.MIXED, free=1000 - 140 * 2, running=2)
    assert KvAware().choose(req, [cold, busy], {"warm": 128}).instance_id == "cold"


def test_kv_aware_with_a_real_prefix_index():
    tokens = list(range(7, 7 + 160))
    hashes = tuple(block_hash_chain(tokens, TPB))
    index = PrefixIndex()
    warm = snap("warm", free=900, stored=hashes[:6])
    cold = snap("cold", free=900)
    for instance in (warm, cold):
        index.apply(instance)
    req = PlacementRequest("r", len(tokens), hashes, 16)
    placement = KvAware().choose(req, [Candidate(cold), Candidate(warm)], index.overlap(hashes))
    assert placement.instance_id == "warm"
    assert placement.scores["cold"] - placement.scores["warm"] == 6 + 6  # 6 blocks fewer to compute, and to allocate


def test_kv_aware_clamps_an_overlap_longer_than_the_chain():
    req = request(prompt_tokens=32)  # 2 hashes
    # 2 cached blocks, not 50: nothing to compute, and 2 of the 4 blocks it holds shared.
    assert KvAware().choose(req, [cand("a")], {"a": 50}).scores["a"] == 0 + 0 + (4 - 2)


def test_kv_aware_temperature_sampling_is_deterministic_with_a_seed():
    req = request()
    pool = [cand("a", free=990), cand("b", free=985), cand("c", free=960)]  # costs 22, 27, 52

    def picks(seed: int) -> list[str]:
        policy = KvAware(KvAwareParams(temperature=5.0), random.Random(seed))
        return [policy.choose(req, pool, {}).instance_id for _ in range(300)]

    assert picks(7) == picks(7)
    assert picks(7) != picks(8)
    counts = Counter(picks(7))
    # softmax(-cost/5): a 0.731, b 0.269, c 0.0000
    assert counts["a"] > counts["b"] > counts["c"]
    assert 180 <= counts["a"] <= 260


def test_kv_aware_zero_temperature_is_argmin_and_needs_no_rng():
    pool = [cand("a", free=990), cand("b", free=985)]
    assert {KvAware().choose(request(), pool, {}).instance_id for _ in range(20)} == {"a"}


def test_kv_aware_temperature_without_rng_is_rejected():
    with pytest.raises(InvalidPlacementInput):
        KvAware(KvAwareParams(temperature=1.0))
    with pytest.raises(InvalidPlacementInput):
        build_policy(KvAwareParams(temperature=1.0), None)


# --- shared policy behaviour -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [RoundRobin(), LeastLoaded(), KvAware(), KvAware(KvAwareParams(temperature=10.0), random.Random(1))],
)
def test_policies_reject_empty_or_all_unhealthy_pools(policy):
    with pytest.raises(NoInstanceAvailable):
        policy.choose(request(), [], {})
    pool = [cand("a", health=InstanceHealth.UNHEALTHY), cand("b", health=InstanceHealth.DRAINING)]
    with pytest.raises(NoInstanceAvailable):
        policy.choose(request(), pool, {})


def test_duplicate_instances_are_rejected():
    with pytest.raises(InvalidPlacementInput):
        LeastLoaded().choose(request(), [cand("a"), cand("a")], {})


def test_negative_overlap_is_rejected():
    with pytest.raises(InvalidPlacementInput):
        KvAware().choose(request(), [cand("a")], {"a": -1})


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(request_id="", prompt_tokens=10, block_hashes=(), expected_decode_tokens=1),
        dict(request_id="r", prompt_tokens=0, block_hashes=(), expected_decode_tokens=1),
        dict(request_id="r", prompt_tokens=True, block_hashes=(), expected_decode_tokens=1),
        dict(request_id="r", prompt_tokens=10, block_hashes=(), expected_decode_tokens=-1),
        dict(request_id="r", prompt_tokens=1, block_hashes=(1, 2), expected_decode_tokens=1),
        dict(request_id="r", prompt_tokens=10, block_hashes=[1], expected_decode_tokens=1),
        dict(request_id="r", prompt_tokens=10, block_hashes=(-1,), expected_decode_tokens=1),
        dict(request_id="r", prompt_tokens=10, block_hashes=(), expected_decode_tokens=1, lora_id="x"),
    ],
)
def test_placement_request_is_validated(kwargs):
    with pytest.raises(InvalidPlacementInput):
        PlacementRequest(**kwargs)


# --- conditional disaggregation --------------------------------------------------------------------


def test_conditional_disagg_short_prompt_skips_the_prefill_hop():
    decider = ConditionalDisagg(DisaggMode.CONDITIONAL, ConditionalDisaggConfig(256, 0.0))
    short = decider.decide(request(prompt_tokens=255), snap("g"), cached=0)
    assert (short.disaggregate, short.reason) == (False, DisaggReason.SHORT_PROMPT)
    boundary = decider.decide(request(prompt_tokens=256), snap("g"), cached=0)
    assert (boundary.disaggregate, boundary.reason) == (True, DisaggReason.LONG_UNCACHED_PROMPT)


def test_conditional_disagg_mostly_cached_prompt_skips_the_prefill_hop():
    decider = ConditionalDisagg(DisaggMode.CONDITIONAL, ConditionalDisaggConfig(0, 0.25))
    req = request(prompt_tokens=320)  # 20 blocks
    cached = decider.decide(req, snap("g"), cached=16)  # 64 of 320 tokens uncached = 0.2
    assert (cached.disaggregate, cached.reason) == (False, DisaggReason.MOSTLY_CACHED)
    assert cached.uncached_fraction == pytest.approx(0.2)
    cold = decider.decide(req, snap("g"), cached=15)  # 0.25 is not below 0.25
    assert (cold.disaggregate, cold.reason) == (True, DisaggReason.LONG_UNCACHED_PROMPT)


def test_fully_cached_prompt_still_computes_its_last_token():
    req = request(prompt_tokens=32)
    assert ConditionalDisagg.uncached_fraction(req, TPB, cached=2) == pytest.approx(1 / 32)


@pytest.mark.parametrize(
    ("mode", "disaggregate", "reason"),
    [(DisaggMode.ALWAYS, True, DisaggReason.ALWAYS), (DisaggMode.NEVER, False, DisaggReason.NEVER)],
)
def test_disagg_modes_ignore_thresholds(mode, disaggregate, reason):
    decider = ConditionalDisagg(mode, ConditionalDisaggConfig(10_000, 1.0))
    decision = decider.decide(request(prompt_tokens=16), snap("g"), cached=1)
    assert (decision.disaggregate, decision.reason) == (disaggregate, reason)


# --- the two-hop placer ----------------------------------------------------------------------------


def cluster(prefill_health=HEALTHY) -> list[Candidate]:
    return [
        cand("p0", InstanceRole.PREFILL, free=945, health=prefill_health),
        cand("p1", InstanceRole.PREFILL, free=950, health=prefill_health),
        cand("g0", InstanceRole.GENERATION, free=500, running=5),
        cand("g1", InstanceRole.GENERATION, free=800, running=2),
        cand("m0", InstanceRole.MIXED, free=100, running=8),
    ]


def test_placer_disaggregated_plan_uses_each_hop_policy():
    config = PlacementConfig(prefill_policy=KvAwareParams(), generation_policy=LeastLoadedParams())
    plan = Placer(config).place(request(), cluster(), {"p0": 10})
    assert plan.route is Route.DISAGGREGATED
    assert plan.generation.instance_id == "g1"  # freeness 400
    assert plan.generation.policy == "least_loaded"
    assert set(plan.generation.scores) == {"g0", "g1", "m0"}
    assert plan.context.instance_id == "p0"  # 0 uncached blocks beat p1's 10 (memory is no issue)
    assert plan.context.policy == "kv_aware"
    assert dict(plan.context.scores) == {"p0": 0.0, "p1": 10.0}
    assert plan.fallback is None
    assert plan.decision.reason is DisaggReason.ALWAYS


def test_placer_conditional_colocates_on_the_generation_instance():
    config = PlacementConfig(
        disaggregation=DisaggMode.CONDITIONAL, conditional=ConditionalDisaggConfig(0, 0.5)
    )
    plan = Placer(config).place(request(prompt_tokens=160), cluster(), {"g1": 9})
    assert plan.route is Route.COLOCATED
    assert plan.context == plan.generation
    assert plan.generation.instance_id == "g1"
    assert plan.decision.reason is DisaggReason.MOSTLY_CACHED
    assert plan.fallback is None


def test_placer_never_mode_is_colocated_without_prefill_instances():
    config = PlacementConfig(disaggregation=DisaggMode.NEVER)
    plan = Placer(config).place(
        request(), [c for c in cluster() if c.load.role is not InstanceRole.PREFILL], {}
    )
    assert plan.route is Route.COLOCATED and plan.fallback is None


@pytest.mark.parametrize("prefill_health", [InstanceHealth.UNHEALTHY, InstanceHealth.DRAINING])
def test_placer_without_healthy_prefill_fails_unless_fallback_allowed(prefill_health):
    with pytest.raises(NoInstanceAvailable) as info:
        Placer(PlacementConfig()).place(request(), cluster(prefill_health), {})
    assert info.value.pool == "prefill"

    config = PlacementConfig(allowed_fallbacks=frozenset({FallbackKind.COLOCATE_WHEN_NO_PREFILL}))
    plan = Placer(config).place(request(), cluster(prefill_health), {})
    assert plan.route is Route.COLOCATED
    assert plan.context.instance_id == plan.generation.instance_id == "g1"
    assert plan.fallback is not None
    assert plan.fallback.kind is FallbackKind.COLOCATE_WHEN_NO_PREFILL
    assert "2 PREFILL instance(s) registered, none healthy" in plan.fallback.reason
    assert plan.decision.disaggregate  # what was wanted; the fallback says why it did not happen


def test_placer_without_generation_instances_fails():
    only_prefill = [c for c in cluster() if c.load.role is InstanceRole.PREFILL]
    with pytest.raises(NoInstanceAvailable) as info:
        Placer(PlacementConfig()).place(request(), only_prefill, {})
    assert info.value.pool == "generation"


def test_placer_never_puts_the_generation_hop_on_a_prefill_instance():
    pool = [cand("p0", InstanceRole.PREFILL, free=1000), cand("g0", free=1)]
    plan = Placer(PlacementConfig(generation_policy=LeastLoadedParams())).place(request(), pool, {})
    assert plan.generation.instance_id == "g0"
    assert plan.context.instance_id == "p0"


ROLES = st.sampled_from(InstanceRole)
HEALTHS = st.sampled_from(InstanceHealth)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(ROLES, HEALTHS, st.integers(0, 1000), st.integers(0, 20), st.integers(0, 10)),
        min_size=1,
        max_size=8,
    ),
    st.sampled_from(
        [RoundRobinParams(), LeastLoadedParams(), KvAwareParams(), KvAwareParams(temperature=50.0)]
    ),
    st.booleans(),
)
def test_placer_only_ever_chooses_healthy_instances_of_the_right_role(specs, policy, fallback):
    pool = [
        cand(f"i{n}", role, free=free, running=running, health=health)
        for n, (role, health, free, running, _) in enumerate(specs)
    ]
    overlap = {f"i{n}": cached for n, (*_, cached) in enumerate(specs) if cached}
    fallbacks = frozenset({FallbackKind.COLOCATE_WHEN_NO_PREFILL}) if fallback else frozenset()
    config = PlacementConfig(prefill_policy=policy, generation_policy=policy, allowed_fallbacks=fallbacks)
    healthy = {c.instance_id: c.load.role for c in pool if c.health is HEALTHY}
    try:
        plan = Placer(config, random.Random(0)).place(request(), pool, overlap)
    except NoInstanceAvailable as err:
        has_generation = any(role is not InstanceRole.PREFILL for role in healthy.values())
        has_prefill = InstanceRole.PREFILL in healthy.values()
        assert (err.pool == "generation" and not has_generation) or (
            err.pool == "prefill" and has_generation and not has_prefill and not fallback
        )
        return
    assert healthy[plan.generation.instance_id] is not InstanceRole.PREFILL
    if plan.route is Route.DISAGGREGATED:
        assert healthy[plan.context.instance_id] is InstanceRole.PREFILL
    else:
        assert plan.context.instance_id == plan.generation.instance_id
        assert plan.fallback is not None and fallback
    assert set(plan.generation.scores) == {
        i for i, role in healthy.items() if role is not InstanceRole.PREFILL
    }


def test_candidates_vouched_in_id_order_place_as_checked_ones():
    """The fleet passes its members in id order and placement skips its check: same plans, same scores."""
    config = PlacementConfig(prefill_policy=KvAwareParams(), generation_policy=LeastLoadedParams())
    ordered = sorted(cluster() + [cand("g2", free=800, running=2, queued_tokens=TPB + 1)], key=lambda c: c.instance_id)
    for overlap in ({}, {"p0": 10}, {"p1": 3, "g1": 9}):
        checked = Placer(config).place(request(), ordered, overlap)
        vouched = Placer(config).place(request(), ordered, overlap, in_id_order=True)
        assert vouched == checked
        assert dict(vouched.generation.scores) == dict(checked.generation.scores)
        assert Placer(config).choose_generation(request(), ordered, overlap, in_id_order=True) == checked.generation


def test_candidate_freeness_is_least_loaded_freeness_of_its_load():
    for candidate in cluster() + [cand("q", free=10, running=1, queued_tokens=17 * TPB + 1)]:
        assert candidate.freeness == LeastLoaded.freeness(candidate.load)
        assert candidate.freeness == (candidate.load.free_blocks - candidate.load.queued_prompt_blocks) / max(1, candidate.load.running_requests)


def test_a_request_goes_to_an_instance_whose_kv_pool_can_hold_it_when_pools_differ():
    """With pools of different sizes, the least loaded instance may be one that could never hold a long
    request (it would refuse it at submission): placement passes over it. When no pool can hold it,
    the policy chooses as before, and that instance's refusal names its pool."""
    small = dict(total=64, free=64)  # 1,024 tokens
    config = PlacementConfig(prefill_policy=LeastLoadedParams(), generation_policy=LeastLoadedParams())
    pool = [
        cand("g-big", total=256, free=40),
        cand("g-small", **small),
        cand("p-big", InstanceRole.PREFILL, total=256, free=40),
        cand("p-small", InstanceRole.PREFILL, **small),
    ]
    placer = Placer(config)
    short = placer.place(request(prompt_tokens=320, decode_tokens=64), pool, {})
    assert (short.context.instance_id, short.generation.instance_id) == ("p-small", "g-small")  # freer: chosen
    long = placer.place(request(prompt_tokens=1000, decode_tokens=200), pool, {})
    assert long.generation.instance_id == "g-big"  # 1,200 tokens: only the big pool holds them
    assert long.context.instance_id == "p-small"  # a prefill hop holds 1,001 tokens: the small pool does
    longer = placer.place(request(prompt_tokens=1100, decode_tokens=8), pool, {})
    assert (longer.context.instance_id, longer.generation.instance_id) == ("p-big", "g-big")
    assert placer.choose_generation(request(prompt_tokens=1000, decode_tokens=200), pool, {}).instance_id == "g-big"
    beyond = placer.place(request(prompt_tokens=5000, decode_tokens=1), pool, {})  # no pool holds it
    assert beyond.generation.instance_id == "g-small" and set(beyond.generation.scores) == {"g-big", "g-small"}


# --- the generation policy when unset: by whether requests run colocated -------------------------------


def _busy_and_idle_looking(role: InstanceRole) -> list[Candidate]:
    """m0: one running request and a long prompt pending (least_loaded's pick: the freest per running
    request); m1: four running requests, nothing pending, the request's prefix cached (kv_aware's)."""
    return [
        cand("m0", role, free=900, running=1, pending_tokens=3200),
        cand("m1", role, free=800, running=4, stored=tuple(range(1000, 1010))),
    ]


def _overlap(candidates: list[Candidate]) -> dict[str, int]:
    index = PrefixIndex()
    for candidate in candidates:
        index.apply(candidate.snapshot)
    return index.overlap(request().block_hashes)


def test_unset_generation_policy_places_colocated_requests_by_prefix_and_pending_prefill() -> None:
    pool = _busy_and_idle_looking(InstanceRole.MIXED)
    assert LeastLoaded().choose(request(), pool, _overlap(pool)).instance_id == "m0"
    assert KvAware().choose(request(), pool, _overlap(pool)).instance_id == "m1"
    never = PlacementConfig(disaggregation=DisaggMode.NEVER)
    plan = Placer(never).place(request(), pool, _overlap(pool))
    assert (plan.route, plan.generation.instance_id, plan.generation.policy) == (Route.COLOCATED, "m1", "kv_aware")
    # No PREFILL instance registered (whatever the mode says): every request runs where it is placed.
    fallback = PlacementConfig(allowed_fallbacks=frozenset({FallbackKind.COLOCATE_WHEN_NO_PREFILL}))
    assert Placer(fallback).place(request(), pool, _overlap(pool)).generation.instance_id == "m1"


def test_unset_generation_policy_places_a_decode_hop_on_load_and_a_set_one_places_every_request() -> None:
    pool = [cand("p0", InstanceRole.PREFILL), *_busy_and_idle_looking(InstanceRole.GENERATION)]
    plan = Placer(PlacementConfig()).place(request(), pool, _overlap(pool))
    assert (plan.route, plan.generation.instance_id, plan.generation.policy) == (Route.DISAGGREGATED, "m0", "least_loaded")
    mixed = _busy_and_idle_looking(InstanceRole.MIXED)
    chosen = PlacementConfig(generation_policy=LeastLoadedParams(), disaggregation=DisaggMode.NEVER)
    plan = Placer(chosen).place(request(), mixed, _overlap(mixed))
    assert (plan.generation.instance_id, plan.generation.policy) == ("m0", "least_loaded")


# --- kv_aware as the policy of a hand-over's target: a cached prefix saves the receiver nothing ---------


def _prefix_holder_and_idle() -> list[Candidate]:
    """g0 caches the request's whole prompt and holds 15 blocks; g1 holds nothing and caches none of it.
    Counted as if the prompt ran there, g0 costs 0 + 15 + 12 - 10 = 17 blocks against g1's 10 + 12 = 22;
    as the receiver of the prompt's KV (fresh blocks for all of it), 15 + 12 = 27 against 12."""
    return [
        cand("p0", InstanceRole.PREFILL),
        cand("g0", free=985, running=1, stored=tuple(range(1000, 1010))),
        cand("g1"),
    ]


def test_kv_aware_places_a_hand_overs_target_on_load_not_on_a_prefix_it_cannot_use() -> None:
    pool = _prefix_holder_and_idle()
    overlap = _overlap(pool)
    assert overlap == {"g0": 10}
    kv_aware = KvAwareParams()
    always = Placer(PlacementConfig(generation_policy=kv_aware, disaggregation=DisaggMode.ALWAYS))
    plan = always.place(request(), pool, overlap)
    assert (plan.route, plan.generation.instance_id) == (Route.DISAGGREGATED, "g1")
    assert dict(plan.generation.scores) == {"g0": 37.0, "g1": 22.0}  # the prompt's 10 uncached blocks on both alike
    # A hop placed alone: a hand-over's target ignores the prefix, a local recompute (which computes
    # the prompt there) counts it.
    assert always.choose_generation(request(), pool, overlap, receives_kv=True).instance_id == "g1"
    assert always.choose_generation(request(), pool, overlap).instance_id == "g0"
    # `conditional` counts it: the prefix there may run the request colocated (mostly cached).
    conditional = Placer(PlacementConfig(
        generation_policy=kv_aware, disaggregation=DisaggMode.CONDITIONAL, conditional=ConditionalDisaggConfig(0, 0.5)
    ))
    plan = conditional.place(request(), pool, overlap)
    assert (plan.route, plan.generation.instance_id, plan.decision.reason) == (Route.COLOCATED, "g0", DisaggReason.MOSTLY_CACHED)
    # No healthy PREFILL instance, and the fallback allowed: the request runs where it is placed.
    fallback = PlacementConfig(
        generation_policy=kv_aware, disaggregation=DisaggMode.ALWAYS,
        allowed_fallbacks=frozenset({FallbackKind.COLOCATE_WHEN_NO_PREFILL}),
    )
    without_prefill = [cand("p0", InstanceRole.PREFILL, health=InstanceHealth.UNHEALTHY), *pool[1:]]
    plan = Placer(fallback).place(request(), without_prefill, overlap)
    assert (plan.route, plan.generation.instance_id) == (Route.COLOCATED, "g0")
