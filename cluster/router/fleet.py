"""The router's registry of instances: who they are, their health, their load and prefix caches,
and the placement decisions that read them (the FleetView of cluster/router/flow.py).

Health: a poll that answers makes an instance HEALTHY; a failed or late poll makes it DEGRADED
(no new work); silence for `health.dead_after_s` makes it dead (UNHEALTHY: the driver recovers
every hop it held). A dead instance that answers again (SIGCONT, a restart under the same name)
comes back HEALTHY; a new incarnation means a new process whose predecessor's state is gone.
Client errors never count against an instance's health: only failed or late polls do.

Placement reads one snapshot per instance; snapshots are rebuilt when a load report or a health
change arrives, not per decision. The candidates are kept in two pools (GENERATION/MIXED and
PREFILL, in instance-id order) across decisions: a decision patches in those of the members whose
load or health changed since the last one (`invalidate`) rather than partitioning every instance,
so whoever changes a member's load or health outside this class's methods calls `invalidate`.

Placement also counts its own decisions that an instance has not reported yet. An instance reports
its load when it answers a poll, and between two of its reports the router used to place on the
older one alone: at 256 instances 90 % of generation placements and 68 % of prefill placements went
to an instance whose report had not changed since the router's previous placement there, and a
least-loaded policy sent a burst of arrivals to whichever instance looked freest. So each placement
is added to its instances' last reports as the instance itself will report it (a hop that runs the
context: a queued request and its prompt, also pending; a generation-only hop: a running request and
its prompt in flight; `_with_unreported`) until a report of that instance mentions the request
(`reported`: the report that carries its "submitted" event counts it already), the request ends
(`forget`), or the instance is taken for dead.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from cluster.router.api import InstanceHealthView
from cluster.router.config import PlacementConfig
from cluster.router.instance_client import InstanceClient
from cluster.router.placement import Candidate, InstanceHealth, PlacementPlan, PlacementRequest, Placer, Pools
from cluster.router.prefix_index import PrefixIndex
from cluster.router.snapshot import InstanceSnapshot
from worker.protocol import EngineLoad, InstanceInfo, InstanceRole, PollBatch

logger = logging.getLogger(__name__)


# Polls in a row that must fail with an error (not a timeout) before an instance is taken for dead.
FAILED_POLLS_CONFIRM = 2


class _Pool:
    """One of placement's two pools as the fleet keeps it: its candidates in instance-id order, how
    many of them are not HEALTHY, and the smallest KV pool among them in tokens (Pools.*_holds_tokens)."""

    def __init__(self) -> None:
        self.candidates: list[Candidate] = []
        self.unhealthy = 0
        self.holds_tokens = 0

    def rebuild_holds_tokens(self) -> None:
        self.holds_tokens = min((c.load.total_blocks * c.load.tokens_per_block for c in self.candidates), default=0)

    def healthy(self) -> list[Candidate]:
        """The HEALTHY candidates: the list itself when all are (the common case), without a pass."""
        if not self.unhealthy:
            return self.candidates
        return [c for c in self.candidates if c.health is InstanceHealth.HEALTHY]


@dataclass
class Member:
    """One registered instance."""

    client: InstanceClient
    info: InstanceInfo
    health: InstanceHealthView = InstanceHealthView.HEALTHY
    last_ok_s: float = 0.0
    last_report_wall_s: float = 0.0
    load: EngineLoad | None = None
    poll_sequence: int = 0
    task: object = None  # the driver's poll task (an asyncio.Task)
    dead: bool = False
    attempts: set[str] = field(default_factory=set)  # engine ids of hops believed live there
    candidate: Candidate | None = None  # what placement reads of it; None: rebuild (load or health changed)
    # Where its candidate sits in the fleet's pools (Fleet._pools): which pool, and its index there.
    pool: _Pool | None = None
    pool_index: int = -1
    # Hops to abort when it answers again: those it held when it was declared dead, those whose
    # stop could not reach it, and those whose submit did not answer (it may have landed).
    to_abort: set[str] = field(default_factory=set)
    failed_polls: int = 0  # polls in a row that failed with an error (not merely late)
    # Placed here, not reported yet (the module docstring): request id -> (whether the hop runs its
    # context here, its prompt tokens).
    unreported: dict[str, tuple[bool, int]] = field(default_factory=dict)

    @property
    def instance_id(self) -> str:
        return self.info.instance_id


class Fleet:
    """Instances by id, their health and load, the prefix index, and placement over them."""

    def __init__(self, placement: PlacementConfig, rng: random.Random, dead_after_s: float) -> None:
        self.members: dict[str, Member] = {}
        # The members in instance-id order, the order placement decides in (kept here so that a
        # decision checks it in one pass instead of sorting every instance).
        self._in_id_order: list[Member] = []
        self.prefix = PrefixIndex()
        self._placer = Placer(placement, rng)
        self._dead_after_s = dead_after_s
        # Placement's two pools of candidates (GENERATION/MIXED, PREFILL), in instance-id order and
        # kept across decisions: a decision patches in the candidates of the members whose load or
        # health changed since the last one (`_stale`; a handful, where a pass over 256 instances
        # was half of what a decision cost), and rebuilds them when membership or a role changes.
        self._generation_pool = _Pool()
        self._prefill_pool = _Pool()
        self._stale: list[Member] = []
        self._pools_valid = False
        self._unreported_on: dict[str, list[Member]] = {}  # request id -> the members it was noted on

    # --- registry -----------------------------------------------------------------------------------
    def register(self, client: InstanceClient, info: InstanceInfo, now_s: float, wall_s: float) -> Member:
        """Add an instance, or replace a registration under the same id (a restarted instance)."""
        member = Member(client, info, last_ok_s=now_s, last_report_wall_s=wall_s)
        self.members[info.instance_id] = member
        self._in_id_order = sorted(self.members.values(), key=lambda m: m.instance_id)
        self._pools_valid = False
        self.prefix.remove_instance(info.instance_id)
        return member

    def get(self, instance_id: str) -> Member | None:
        return self.members.get(instance_id)

    # --- health -------------------------------------------------------------------------------------
    def answered(self, member: Member, now_s: float) -> None:
        """A poll came back: the instance is reachable."""
        if member.health is not InstanceHealthView.HEALTHY:
            self.invalidate(member)
        member.health = InstanceHealthView.HEALTHY
        member.last_ok_s = now_s
        member.failed_polls = 0

    def silent(self, member: Member, now_s: float, reason: str, *, late: bool = True) -> bool:
        """A poll failed or was late. True when the instance is now to be declared dead: silent for
        dead_after_s, or a second poll in a row failed with an error (`late` False: the instance or
        Ray answered that it cannot serve, which a loaded machine does not do; the first such
        failure is a suspicion, the second confirms it)."""
        if member.dead:
            return False
        if not late:
            member.failed_polls += 1
            if member.failed_polls >= FAILED_POLLS_CONFIRM:
                return True
        silent_s = now_s - member.last_ok_s
        if silent_s >= self._dead_after_s:
            return True
        if member.health is InstanceHealthView.HEALTHY:
            member.health = InstanceHealthView.DEGRADED
            self.invalidate(member)
            logger.warning("instance %s degraded: %s", member.instance_id, reason)
        return False

    def silent_for_s(self, member: Member, now_s: float) -> float:
        return now_s - member.last_ok_s

    def mark_dead(self, member: Member, reason: str) -> list[str]:
        """Take an instance for dead; returns the engine ids of the hops it held (to recover, and
        to abort should it answer again)."""
        member.dead = True
        member.health = InstanceHealthView.UNHEALTHY
        self.invalidate(member)
        self.prefix.remove_instance(member.instance_id)
        logger.error("instance %s declared dead: %s", member.instance_id, reason)
        held = sorted(member.attempts)
        member.attempts.clear()
        member.unreported.clear()  # what it held is gone; the flows place it again
        member.to_abort.update(held)
        return held

    def revive(self, member: Member) -> None:
        """A dead instance answers again: it starts from an empty prefix view."""
        member.dead = False
        self.invalidate(member)
        self.prefix.remove_instance(member.instance_id)
        logger.info("instance %s re-registered", member.instance_id)

    @staticmethod
    def take_aborts(member: Member) -> list[str]:
        """The hops it may still hold that the router gave up while it could not be told (to abort
        there, now that it answers)."""
        stale = sorted(member.to_abort)
        member.to_abort.clear()
        return stale

    # --- load -----------------------------------------------------------------------------------------
    def apply_load(self, member: Member, batch: PollBatch, wall_s: float, reset: bool) -> None:
        """A load report: the instance's load, and its prefix cache events for the prefix index."""
        load = batch.load
        assert load is not None
        member.load = load
        member.last_report_wall_s = wall_s
        member.poll_sequence = batch.sequence
        self.invalidate(member)
        self.prefix.apply(InstanceSnapshot(member.instance_id, load, sequence=batch.sequence, reset=reset))

    def load_snapshot(self, member: Member) -> InstanceSnapshot:
        """What placement reads of an instance: its last load (before any, an idle one)."""
        info = member.info
        load = member.load or EngineLoad(info.role, info.num_blocks, info.num_blocks, info.layout.tokens_per_block)
        if member.unreported:
            load = _with_unreported(load, member.unreported.values())
        return InstanceSnapshot(info.instance_id, load, sequence=max(member.poll_sequence, 0))

    def reported(self, member: Member, request_id: str) -> None:
        """A report of `member` mentions the request: its load counts the request from now on."""
        self._unnote(member, request_id)

    def submit_failed(self, instance_id: str, request_id: str) -> None:
        """A submit of the request to the instance failed: the instance will not report it (a refused
        submit never landed; one that could not be sent is aborted once the instance answers), so it
        is counted there no more. Wherever the request goes next is noted by that placement."""
        member = self.members.get(instance_id)
        if member is not None:
            self._unnote(member, request_id)

    def forget(self, request_id: str) -> None:
        """The request ended: no instance is to count it as placed any more."""
        for member in self._unreported_on.pop(request_id, ()):
            self._unnote(member, request_id)

    def _unnote(self, member: Member, request_id: str) -> None:
        if member.unreported.pop(request_id, None) is not None:
            self.invalidate(member)

    def _note(self, instance_id: str, request: PlacementRequest, *, runs_context: bool) -> None:
        member = self.members[instance_id]  # placement picks among the members only
        member.unreported[request.request_id] = (runs_context, request.prompt_tokens)
        self._unreported_on.setdefault(request.request_id, []).append(member)
        self.invalidate(member)

    # --- placement (FleetView) ------------------------------------------------------------------------
    def place(self, request: PlacementRequest, exclude: frozenset[str]) -> PlacementPlan:
        if exclude:  # a retry that must avoid some instances (rare): from every candidate
            candidates = self._candidates_excluding(exclude)  # in instance-id order, each member once
            plan = self._placer.place(request, candidates, self.prefix.overlap(request.block_hashes), in_id_order=True)
        else:
            plan = self._placer.place_pools(request, self._pools(), self.prefix.overlap(request.block_hashes))
        context, generation = plan.context.instance_id, plan.generation.instance_id
        self._note(context, request, runs_context=True)
        if generation != context:
            self._note(generation, request, runs_context=False)
        return plan

    def invalidate(self, member: Member) -> None:
        """Its load or health changed: placement rebuilds its candidate, and patches it into the pools."""
        if member.candidate is not None:
            member.candidate = None
            self._stale.append(member)
            if len(self._stale) > 4 * len(self._in_id_order):  # no decision for a long while: rebuild then
                self._stale.clear()
                self._pools_valid = False

    def _pools(self) -> Pools:
        """The pools of the members' current candidates (what `_candidates_excluding(frozenset())`
        gives, split by role, and the healthy ones of each)."""
        stale, self._stale = self._stale, []
        if self._pools_valid:
            resized: list[_Pool] = []
            for member in stale:
                candidate = member.candidate or self._refresh(member)
                pool = member.pool
                if pool is not self._pool_for(candidate):
                    # A role changed (a restart under another role), or a member no longer registered
                    # (replaced under its id; its pool is an earlier one): rebuild.
                    self._pools_valid = False
                    break
                old = pool.candidates[member.pool_index]
                if old.health is not candidate.health:
                    pool.unhealthy += 1 if old.health is InstanceHealth.HEALTHY else -1
                if (old.load.total_blocks, old.load.tokens_per_block) != (candidate.load.total_blocks, candidate.load.tokens_per_block):
                    resized.append(pool)  # a KV pool of another size (a restart): its smallest again
                pool.candidates[member.pool_index] = candidate
            for pool in set(resized):
                pool.rebuild_holds_tokens()
        if not self._pools_valid:
            self._rebuild_pools()
        generation, prefill = self._generation_pool, self._prefill_pool
        return Pools(
            generation.healthy(), prefill.healthy(), len(generation.candidates), len(prefill.candidates),
            generation.holds_tokens, prefill.holds_tokens,
        )

    def _pool_for(self, candidate: Candidate) -> _Pool:
        """The pool a candidate belongs in by its role: PREFILL, or GENERATION/MIXED."""
        return self._prefill_pool if candidate.load.role is InstanceRole.PREFILL else self._generation_pool

    def _rebuild_pools(self) -> None:
        self._generation_pool, self._prefill_pool = _Pool(), _Pool()
        for member in self._in_id_order:
            candidate = member.candidate or self._refresh(member)
            pool = self._pool_for(candidate)
            member.pool, member.pool_index = pool, len(pool.candidates)
            pool.candidates.append(candidate)
            pool.unhealthy += candidate.health is not InstanceHealth.HEALTHY
        self._generation_pool.rebuild_holds_tokens()
        self._prefill_pool.rebuild_holds_tokens()
        self._stale.clear()
        self._pools_valid = True

    def choose_generation(self, request: PlacementRequest, exclude: frozenset[str], *, receives_kv: bool) -> str:
        """A generation instance for the request's generation hop alone (`receives_kv`: a hand-over's
        target, else a local recompute); raises NoInstanceAvailable."""
        candidates = self._candidates_excluding(exclude)  # in instance-id order, each member once
        overlap = {} if receives_kv else self.prefix.overlap(request.block_hashes)  # the placer ignores it then
        placer = self._placer
        instance_id = placer.choose_generation(request, candidates, overlap, in_id_order=True, receives_kv=receives_kv).instance_id
        self._note(instance_id, request, runs_context=False)
        return instance_id

    def _candidates_excluding(self, exclude: frozenset[str]) -> Sequence[Candidate]:
        candidates = [m.candidate or self._refresh(m) for m in self._in_id_order]
        if not exclude:
            return candidates
        return [Candidate(c.snapshot, InstanceHealth.UNHEALTHY) if c.instance_id in exclude else c for c in candidates]

    def _refresh(self, member: Member) -> Candidate:
        healthy = member.health is InstanceHealthView.HEALTHY
        member.candidate = Candidate(self.load_snapshot(member), InstanceHealth.HEALTHY if healthy else InstanceHealth.UNHEALTHY)
        return member.candidate

    def is_healthy(self, instance_id: str) -> bool:
        member = self.members.get(instance_id)
        return member is not None and member.health is InstanceHealthView.HEALTHY

    def has_healthy(self, roles: frozenset[InstanceRole], exclude: frozenset[str]) -> bool:
        return any(
            m.health is InstanceHealthView.HEALTHY and m.info.role in roles and m.instance_id not in exclude
            for m in self.members.values()
        )

    def kv_bytes(self, instance_id: str, num_blocks: int) -> int:
        """The bytes of `num_blocks` KV blocks (every layer, K and V) on that instance."""
        layout = self.members[instance_id].info.layout
        return layout.run_bytes(layout.num_layers, num_blocks)

    def has_members(self, roles: frozenset[InstanceRole]) -> bool:
        """Whether an instance of these roles was ever registered, healthy or not (one that died may
        come back: Ray restarts it, or it answers again)."""
        return any(m.info.role in roles for m in self.members.values())

    def role(self, instance_id: str) -> InstanceRole:
        return self.members[instance_id].info.role


def _with_unreported(load: EngineLoad, placed: Iterable[tuple[bool, int]]) -> EngineLoad:
    """`load` with the placements an instance has not reported yet, as it will report them once it
    has them (worker/engine.py Engine.load): a hop that runs its context is a queued request whose
    prompt is queued and pending; a generation-only hop is a running request whose prompt is in
    flight. Without the prefix events, which the prefix index has taken already."""
    queued = queued_tokens = running = in_flight = 0
    for runs_context, tokens in placed:
        if runs_context:
            queued += 1
            queued_tokens += tokens
        else:
            running += 1
            in_flight += tokens
    return msgspec.structs.replace(
        load,
        prefix_events=(),
        queued_requests=load.queued_requests + queued,
        queued_prompt_tokens=load.queued_prompt_tokens + queued_tokens,
        pending_context_tokens=load.pending_context_tokens + queued_tokens,
        running_requests=load.running_requests + running,
        tokens_in_flight=load.tokens_in_flight + in_flight,
    )
