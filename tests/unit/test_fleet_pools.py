"""The fleet's placement pools (cluster/router/fleet.py `_pools`): kept across decisions and patched
with the candidates of the members whose load or health changed, they must give every decision
exactly what placing over all the candidates afresh gives (Placer.place), whatever happened in
between: load reports, degraded and dead instances, revivals, a restart under another role, a new
registration, instances whose KV pools cannot hold a long request (and pools that change size), and
no healthy prefill instance."""

from __future__ import annotations

import random

from cluster.router.config import RouterConfig
from cluster.router.fleet import Fleet
from cluster.router.placement import NoInstanceAvailable, PlacementRequest
from worker.kv_layout import KvLayout
from worker.protocol import EngineLoad, InstanceInfo, InstanceRole, PollBatch

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=16, dtype="float32", model_fingerprint="pools")
ROLES = (InstanceRole.PREFILL, InstanceRole.GENERATION, InstanceRole.MIXED)


def _config(disaggregation: str, fallback: bool = False) -> RouterConfig:
    return RouterConfig.from_dict({
        "placement": {
            "prefill_policy": {"name": "kv_aware"},
            "generation_policy": {"name": "least_loaded"},
            "disaggregation": disaggregation,
            "allowed_fallbacks": ["colocate_when_no_prefill"] if fallback else [],
        },
    })


def _info(name: str, role: InstanceRole, num_blocks: int, incarnation: str = "inc") -> InstanceInfo:
    return InstanceInfo(name, role, incarnation, "127.0.0.1:1", LAYOUT, num_blocks, 264, 4096, 0, "cpu")


def _fresh_plan(fleet: Fleet, request: PlacementRequest):
    """The decision over every candidate, partitioned afresh (what the pools stand in for)."""
    candidates = fleet._candidates_excluding(frozenset())
    return fleet._placer.place(request, candidates, fleet.prefix.overlap(request.block_hashes), in_id_order=True)


def _decide(fleet: Fleet, request: PlacementRequest):
    try:
        return fleet.place(request, frozenset())
    except NoInstanceAvailable as error:
        return ("refused", str(error))


def _decide_fresh(fleet: Fleet, request: PlacementRequest):
    try:
        return _fresh_plan(fleet, request)
    except NoInstanceAvailable as error:
        return ("refused", str(error))


def test_pooled_decisions_are_the_fresh_ones_through_any_history() -> None:
    outcomes = {"refused": 0, "colocated fallback": 0, "placed": 0}
    for seed in range(8):
        _history(seed, outcomes)
    # The histories reach every outcome, so the comparison covered each.
    assert outcomes["placed"] > 800 and outcomes["refused"] > 0 and outcomes["colocated fallback"] > 0, outcomes


def _history(seed: int, outcomes: dict[str, int]) -> None:
    rng = random.Random(seed)
    config = _config(rng.choice(["always", "conditional"]), fallback=seed % 2 == 1)
    fleet = Fleet(config.placement, random.Random(seed), dead_after_s=5.0)
    names = [f"i{k:02d}" for k in range(6)]
    for name in names:
        fleet.register(None, _info(name, rng.choice(ROLES), rng.choice([64, 64, 64, 8])), 0.0, 0.0)  # type: ignore[arg-type]
    sequence = 0
    placed: list[str] = []  # requests placed and not ended
    for step in range(400):
        member = fleet.members[rng.choice(names)]
        op = rng.random()
        now = float(step)
        if op < 0.55:  # a load report
            sequence += 1
            total = member.info.num_blocks
            load = EngineLoad(
                member.info.role, total, rng.randint(0, total), LAYOUT.tokens_per_block,
                queued_requests=rng.randint(0, 3), running_requests=rng.randint(0, 8),
                pending_context_tokens=rng.randint(0, 400),
            )
            fleet.answered(member, now)
            fleet.apply_load(member, PollBatch("inc", sequence, load=load), now, reset=False)
        elif op < 0.65:  # a late poll: degraded
            fleet.silent(member, now, "late")
        elif op < 0.72:
            fleet.mark_dead(member, "killed")
        elif op < 0.80:  # it answers again
            if member.dead:
                fleet.revive(member)
            fleet.answered(member, now)
        elif op < 0.82:  # restarted under another role, registered anew
            fleet.register(None, _info(member.instance_id, rng.choice(ROLES), member.info.num_blocks, f"inc{step}"), now, now)  # type: ignore[arg-type]
        elif op < 0.84:  # restarted under another role as the driver takes it up (Router._on_batch): same member, new info
            if not member.dead:
                fleet.mark_dead(member, "restarted")
            # ... and at times a KV pool of another size
            member.info = _info(member.instance_id, rng.choice(ROLES), rng.choice([8, 64]), f"inc{step}")
            fleet.revive(member)
            fleet.answered(member, now)
        elif op < 0.86:  # a new instance joins
            name = f"j{step:03d}"
            names.append(name)
            fleet.register(None, _info(name, rng.choice(ROLES), 64), now, now)  # type: ignore[arg-type]
        elif op < 0.90 and placed:  # a report mentions a placed request: its load counts it now
            fleet.reported(member, rng.choice(placed))
        elif op < 0.93 and placed:  # a placed request ends
            fleet.forget(placed.pop(rng.randrange(len(placed))))
        if rng.random() < 0.5:
            continue  # several changes between two decisions
        prompt = rng.choice([16, 100, 700, 3000])  # 3000 + decode fits only the 64-block pools
        request = PlacementRequest(f"r{step}", prompt, tuple(range(1, prompt // 16 + 1)), rng.choice([0, 64]))
        # Fresh first: a decision of the fleet's counts its placement on the instances it picked
        # (Fleet._note), which the next decision sees.
        fresh = _decide_fresh(fleet, request)
        pooled = _decide(fleet, request)
        assert pooled == fresh, f"seed {seed}, step {step}"
        if isinstance(pooled, tuple):
            outcomes["refused"] += 1
        else:
            placed.append(request.request_id)
            outcomes["colocated fallback" if pooled.context.fallback is not None else "placed"] += 1


def test_a_poked_member_is_taken_up_once_the_fleet_is_told() -> None:
    # Whoever changes a member's health outside the fleet's methods tells it (Fleet.invalidate), as
    # the flow tests' set_health does; the next decision sees the change.
    fleet = Fleet(_config("always").placement, random.Random(0), dead_after_s=5.0)
    for name, role in (("p0", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION), ("g1", InstanceRole.GENERATION)):
        fleet.register(None, _info(name, role, 64), 0.0, 0.0)  # type: ignore[arg-type]
    request = PlacementRequest("r", 32, (1, 2), 8)
    assert fleet.place(request, frozenset()).generation.instance_id == "g0"
    member = fleet.members["g0"]
    member.health = type(member.health).UNHEALTHY
    fleet.invalidate(member)
    assert fleet.place(request, frozenset()).generation.instance_id == "g1"
