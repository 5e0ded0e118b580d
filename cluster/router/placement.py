"""Placement: which instance runs each hop of a request, as pure functions of the request, the
instances' load snapshots (cluster/router/snapshot.py) and health, and the prefix overlap
(cluster/router/prefix_index.py).

Policies (each a small class with its params from cluster/router/config.py):

* RoundRobin: the next instance id after the last one chosen, in id order, wrapping; stable when
  instances join or leave.
* LeastLoaded: Llumnix freeness = (free blocks - blocks the queued prompts need) / max(1, running
  requests); highest wins, ties to the smallest id.
* KvAware: Dynamo's cost = prefill_weight * max(uncached prompt blocks + active prefill blocks, 0)
  + decode blocks, where
    uncached prompt blocks = ceil(prompt / tokens_per_block) - cached leading blocks on the instance,
    active prefill blocks  = ceil(pending_context_tokens / tokens_per_block) (prompt tokens still to
                             compute there: queued prompts and the rest of contexts in progress; an
                             instance in the middle of a long prefill is not idle),
    decode blocks          = blocks in use on the instance + blocks this request adds there:
                             its prompt and expected decode tokens less the cached leading blocks,
                             which it shares rather than allocates (Dynamo counts the request's
                             blocks that the instance's active sequences hold once). On a PREFILL
                             instance, which frees the blocks once the KV has been sent, only a
                             prompt that does not fit now is charged.
  Lowest cost wins, ties to the smallest id; temperature > 0 samples from softmax(-cost / T) with an
  injected random.Random.
* ConditionalDisagg: whether a request skips the prefill hop and runs colocated on its generation
  instance (short prompt, or mostly cached there), with the reason.

`Placer` runs the two hops: the generation hop first (GENERATION and MIXED instances), then the
disaggregation decision on that instance's overlap (llm-d style: prefill runs remotely only when the
uncached part on the chosen decode instance is worth it), then the prefill hop (PREFILL instances).
Only HEALTHY instances are ever chosen. When no PREFILL instance is healthy the placer uses the
COLOCATE_WHEN_NO_PREFILL fallback only if the config allows it, and says so in the result;
otherwise it raises NoInstanceAvailable. All instances are assumed to share tokens_per_block (the KV
transfer requires it), so the request's block hashes mean the same on each.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Protocol

from cluster.router.config import (
    DEFAULT_COLOCATED_POLICY,
    DEFAULT_GENERATION_POLICY,
    ConditionalDisaggConfig,
    DisaggMode,
    FallbackKind,
    KvAwareParams,
    LeastLoadedParams,
    PlacementConfig,
    PolicyParams,
    RoundRobinParams,
)
from cluster.router.snapshot import InstanceSnapshot
from cluster.router.state import Route
from worker.protocol import MAX_BLOCK_HASH, EngineLoad, InstanceRole

logger = logging.getLogger(__name__)
_NO_OVERLAP: Mapping[str, int] = MappingProxyType({})  # no instance caches any of the prompt


class PlacementError(Exception):
    """Base of placement errors."""


class NoInstanceAvailable(PlacementError):
    """No healthy instance can take this hop, and no allowed fallback applies."""

    def __init__(self, pool: str, reason: str) -> None:
        self.pool = pool
        self.reason = reason
        super().__init__(f"no {pool} instance available: {reason}")


class InvalidPlacementInput(PlacementError, ValueError):
    """A malformed request or candidate list (a bug in the caller, not a load condition)."""


class InstanceHealth(Enum):
    """The router's verdict on an instance; only HEALTHY ones receive new work."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"


def _freeness(load: EngineLoad) -> float:
    """Llumnix freeness (LeastLoaded's score): free blocks net of the queued prompts' per running request."""
    return (load.free_blocks - -(-load.queued_prompt_tokens // load.tokens_per_block)) / max(1, load.running_requests)


@dataclass(frozen=True)
class Candidate:
    """An instance as placement sees it: its latest snapshot and its health."""

    snapshot: InstanceSnapshot
    health: InstanceHealth = InstanceHealth.HEALTHY
    # Copied out of the snapshot once: every decision reads them for every candidate.
    instance_id: str = field(init=False, repr=False, compare=False)
    load: EngineLoad = field(init=False, repr=False, compare=False)
    # Worked out once per snapshot, not once per decision (a snapshot serves many decisions).
    freeness: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "instance_id", self.snapshot.instance_id)
        object.__setattr__(self, "load", self.snapshot.load)
        object.__setattr__(self, "freeness", _freeness(self.snapshot.load))


@dataclass(frozen=True)
class PlacementRequest:
    """What placement needs to know of a request. `block_hashes` is the chain of the prompt's full
    blocks (scheduler/block_hash.py, with the request's LoRA task)."""

    request_id: str
    prompt_tokens: int
    block_hashes: tuple[int, ...]
    expected_decode_tokens: int
    lora_id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidPlacementInput("request_id must be a non-empty string")
        if type(self.prompt_tokens) is not int or self.prompt_tokens < 1:
            raise InvalidPlacementInput(
                f"prompt_tokens must be a positive integer, got {self.prompt_tokens!r}"
            )
        if type(self.expected_decode_tokens) is not int or self.expected_decode_tokens < 0:
            raise InvalidPlacementInput(
                f"expected_decode_tokens must be an integer >= 0, got {self.expected_decode_tokens!r}"
            )
        if not isinstance(self.block_hashes, tuple) or len(self.block_hashes) > self.prompt_tokens:
            raise InvalidPlacementInput("block_hashes must be a tuple with at most one hash per prompt token")
        if not all(type(h) is int and 0 <= h <= MAX_BLOCK_HASH for h in self.block_hashes):
            raise InvalidPlacementInput("block_hashes must be unsigned 64-bit integers")
        if self.lora_id is not None and type(self.lora_id) is not int:
            raise InvalidPlacementInput(f"lora_id must be an integer or None, got {self.lora_id!r}")


@dataclass(frozen=True)
class Fallback:
    kind: FallbackKind
    reason: str


@dataclass(frozen=True)
class Placement:
    """One hop's choice. `scores` holds every eligible instance's score as the policy defines it
    (see the policy's `score_meaning`); `fallback` is set when a configured fallback was used."""

    instance_id: str
    policy: str
    scores: Mapping[str, float]
    fallback: Fallback | None = None


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def score_meaning(self) -> str: ...

    def choose(
        self,
        request: PlacementRequest,
        candidates: Sequence[Candidate],
        overlap_blocks: Mapping[str, int],
    ) -> Placement: ...

    def choose_eligible(
        self, request: PlacementRequest, eligible: list[Candidate], overlap_blocks: Mapping[str, int]
    ) -> Placement:
        """`choose` on candidates already checked, healthy and in instance-id order."""
        ...


def _in_id_order(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates checked (Candidates, each instance once) and in instance-id order, so that
    every tie-break and sample is deterministic."""
    previous = ""
    for candidate in candidates:
        if not isinstance(candidate, Candidate):
            raise InvalidPlacementInput(f"expected Candidate, got {type(candidate).__name__}")
        instance_id = candidate.instance_id
        if instance_id <= previous:
            break
        previous = instance_id
    else:
        # Ids strictly increasing (the fleet's order): each instance once and sorted already; one
        # pass instead of a set and a sort per decision.
        return list(candidates)
    seen: set[str] = set()
    for candidate in candidates:
        if not isinstance(candidate, Candidate):
            raise InvalidPlacementInput(f"expected Candidate, got {type(candidate).__name__}")
        if candidate.instance_id in seen:
            raise InvalidPlacementInput(f"instance {candidate.instance_id!r} appears twice")
        seen.add(candidate.instance_id)
    return sorted(candidates, key=_instance_id)


def _instance_id(candidate: Candidate) -> str:
    return candidate.instance_id


def _healthy(ordered: list[Candidate], pool: str, total: int) -> list[Candidate]:
    eligible = [c for c in ordered if c.health is InstanceHealth.HEALTHY]
    if not eligible:
        raise NoInstanceAvailable(pool, f"none of {total} candidate(s) is healthy")
    return eligible


def _eligible(candidates: Sequence[Candidate], pool: str) -> list[Candidate]:
    """The HEALTHY candidates in instance-id order (so every tie-break and sample is deterministic)."""
    return _healthy(_in_id_order(candidates), pool, len(candidates))


def _check_overlap(overlap_blocks: Mapping[str, int]) -> None:
    for instance_id, overlap in overlap_blocks.items():
        if type(overlap) is not int or overlap < 0:
            raise InvalidPlacementInput(f"overlap for {instance_id!r} must be an integer >= 0, got {overlap!r}")


def _scores(values: dict[str, float]) -> Mapping[str, float]:
    """Scores keyed in instance-id order (the policies build them from candidates in that order)."""
    return MappingProxyType(values)


class _Chooser:
    """`choose` checks and orders the candidates, then `choose_eligible` decides; the Placer,
    which has checked and ordered them once for both hops, calls `choose_eligible` directly."""

    name: str

    def choose(
        self,
        request: PlacementRequest,
        candidates: Sequence[Candidate],
        overlap_blocks: Mapping[str, int],
    ) -> Placement:
        _check_overlap(overlap_blocks)
        return self.choose_eligible(request, _eligible(candidates, self.name.replace("_", "-")), overlap_blocks)

    def choose_eligible(
        self, request: PlacementRequest, eligible: list[Candidate], overlap_blocks: Mapping[str, int]
    ) -> Placement:
        raise NotImplementedError


class RoundRobin(_Chooser):
    name = "round_robin"
    score_meaning = "turns until chosen (lower first)"

    def __init__(self, params: RoundRobinParams | None = None) -> None:
        self._last_instance_id: str | None = None

    def choose_eligible(
        self, request: PlacementRequest, eligible: list[Candidate], overlap_blocks: Mapping[str, int]
    ) -> Placement:
        ids = [c.instance_id for c in eligible]
        start = 0
        if self._last_instance_id is not None:
            # The first id after the last choice, so a joining or leaving instance does not reset
            # the rotation.
            start = next((i for i, iid in enumerate(ids) if iid > self._last_instance_id), 0)
        order = ids[start:] + ids[:start]
        self._last_instance_id = order[0]
        count = len(ids)
        return Placement(order[0], self.name, _scores({iid: float((i - start) % count) for i, iid in enumerate(ids)}))


class LeastLoaded(_Chooser):
    name = "least_loaded"
    score_meaning = "Llumnix freeness (higher wins)"

    def __init__(self, params: LeastLoadedParams | None = None) -> None:
        pass

    @staticmethod
    def freeness(load: EngineLoad) -> float:
        return _freeness(load)

    def choose_eligible(
        self, request: PlacementRequest, eligible: list[Candidate], overlap_blocks: Mapping[str, int]
    ) -> Placement:
        scores = {}
        best, best_score = eligible[0], -math.inf
        for candidate in eligible:  # in id order: the first of equal scores wins
            score = scores[candidate.instance_id] = candidate.freeness
            if score > best_score:
                best, best_score = candidate, score
        return Placement(best.instance_id, self.name, _scores(scores))


@dataclass(frozen=True)
class KvCost:
    """KvAware's cost of one instance, with its two terms (in blocks of that instance)."""

    uncached_prompt_blocks: int
    active_prefill_blocks: int
    decode_blocks: int
    cost: float


def _blocks(tokens: int, tokens_per_block: int) -> int:
    return -(-tokens // tokens_per_block)


def cached_blocks(request: PlacementRequest, instance_id: str, overlap_blocks: Mapping[str, int]) -> int:
    """The instance's overlap, clamped to the request's own chain (an index can never give more)."""
    overlap = overlap_blocks.get(instance_id, 0)
    if type(overlap) is not int or overlap < 0:
        raise InvalidPlacementInput(f"overlap for {instance_id!r} must be an integer >= 0, got {overlap!r}")
    return min(overlap, len(request.block_hashes))


class KvAware(_Chooser):
    name = "kv_aware"
    score_meaning = "Dynamo cost in blocks (lower wins)"

    def __init__(self, params: KvAwareParams | None = None, rng: random.Random | None = None) -> None:
        self._params = params if params is not None else KvAwareParams()
        if self._params.temperature > 0 and rng is None:
            raise InvalidPlacementInput("kv_aware with temperature > 0 needs an injected random.Random")
        self._rng = rng

    def cost(self, request: PlacementRequest, load: EngineLoad, cached: int) -> KvCost:
        return KvCost(*self._terms(request, load, cached))

    def _terms(self, request: PlacementRequest, load: EngineLoad, cached: int) -> tuple[int, int, int, float]:
        """(uncached prompt blocks, active prefill blocks, decode blocks, cost) of one instance."""
        tokens_per_block = load.tokens_per_block
        prompt_blocks = -(-request.prompt_tokens // tokens_per_block)
        uncached = prompt_blocks - cached if prompt_blocks > cached else 0
        # Pending, not queued: queued prompts alone would leave a context admitted in one step (the
        # common case) out of every report while its chunks run; that instance looks idle, and the
        # lowest-id of the idle-looking ones takes every request (bench/sim_scale.py: of 64 PREFILL
        # instances some ran no step at all while one computed 4x the median, TTFT p50 0.54 s at
        # 70 % of capacity). The pending count includes the queue (EngineLoad refuses less).
        active_prefill = -(-load.pending_context_tokens // tokens_per_block)
        if load.role is InstanceRole.PREFILL:
            # A prefill instance decodes nothing: what it holds is KV waiting to be handed over,
            # soon freed. Only charge memory when the prompt would not fit right now.
            decode = 0 if load.free_blocks >= prompt_blocks else prompt_blocks
        else:
            # The blocks in use and those the request adds: its cached leading blocks are shared, not
            # allocated again. Dynamo counts a request's blocks that the instance's active sequences
            # hold once; the router knows which blocks an instance caches (its prefix index), not which
            # of them its running requests hold, so it counts every cached one as shared: taking up a
            # cached block that was free to evict allocates nothing either. Charging them again made an
            # instance holding a prefix, and one request on it, cost more than an idle one without it
            # (duet sim, 8 MIXED, 2,048-token prefixes: prefix hit rate 0.63-0.72 of 0.88 possible, 0.78-0.84
            # without; README, placement).
            # Like the prefill term, this assumes the context runs here; a hand-over's receiver
            # (worker/engine.py _reserve) takes fresh blocks for the whole prompt.
            decode = (load.total_blocks - load.free_blocks) + -(
                -(request.prompt_tokens + request.expected_decode_tokens) // tokens_per_block
            ) - cached
        cost = self._params.prefill_weight * max(uncached + active_prefill, 0) + decode
        return uncached, active_prefill, decode, cost

    def choose_eligible(
        self, request: PlacementRequest, eligible: list[Candidate], overlap_blocks: Mapping[str, int]
    ) -> Placement:
        chain = len(request.block_hashes)
        costs = {}
        for candidate in eligible:
            cached = min(overlap_blocks.get(candidate.instance_id, 0), chain)
            costs[candidate.instance_id] = self._terms(request, candidate.load, cached)[3]
        temperature = self._params.temperature
        if temperature > 0:
            assert self._rng is not None  # checked in __init__
            lowest = min(costs.values())
            # Shifting by the lowest cost keeps exp() in range; it cancels out of the softmax.
            weights = [math.exp(-(costs[c.instance_id] - lowest) / temperature) for c in eligible]
            chosen = self._rng.choices(eligible, weights=weights, k=1)[0]
        else:
            chosen, lowest = eligible[0], math.inf
            for candidate in eligible:  # in id order: the first of equal costs wins
                if costs[candidate.instance_id] < lowest:
                    chosen, lowest = candidate, costs[candidate.instance_id]
        return Placement(chosen.instance_id, self.name, _scores(costs))


def build_policy(params: PolicyParams, rng: random.Random | None = None) -> Policy:
    if isinstance(params, RoundRobinParams):
        return RoundRobin(params)
    if isinstance(params, LeastLoadedParams):
        return LeastLoaded(params)
    if isinstance(params, KvAwareParams):
        return KvAware(params, rng)
    raise InvalidPlacementInput(f"unknown policy params {params!r}")


# --- Conditional disaggregation -----------------------------------------------------------------


class DisaggReason(Enum):
    ALWAYS = "always"  # mode ALWAYS
    NEVER = "never"  # mode NEVER
    SHORT_PROMPT = "short_prompt"
    MOSTLY_CACHED = "mostly_cached"
    LONG_UNCACHED_PROMPT = "long_uncached_prompt"


@dataclass(frozen=True)
class DisaggDecision:
    disaggregate: bool
    reason: DisaggReason
    # Of the prompt, the fraction the generation instance would have to compute itself.
    uncached_fraction: float
    detail: str


class ConditionalDisagg:
    def __init__(self, mode: DisaggMode, thresholds: ConditionalDisaggConfig | None = None) -> None:
        self._mode = mode
        self._thresholds = thresholds if thresholds is not None else ConditionalDisaggConfig()

    @staticmethod
    def uncached_fraction(request: PlacementRequest, tokens_per_block: int, cached: int) -> float:
        # An engine always computes at least the last prompt token, even on a full cache hit.
        reused_tokens = min(cached * tokens_per_block, request.prompt_tokens - 1)
        return (request.prompt_tokens - reused_tokens) / request.prompt_tokens

    def decide(self, request: PlacementRequest, generation: InstanceSnapshot, cached: int) -> DisaggDecision:
        """Whether `request`, whose generation hop goes to `generation` (holding `cached` of its
        leading blocks), also takes a prefill hop."""
        fraction = self.uncached_fraction(request, generation.load.tokens_per_block, cached)
        if self._mode is DisaggMode.ALWAYS:
            return DisaggDecision(True, DisaggReason.ALWAYS, fraction, "disaggregation mode is 'always'")
        if self._mode is DisaggMode.NEVER:
            return DisaggDecision(False, DisaggReason.NEVER, fraction, "disaggregation mode is 'never'")
        min_tokens = self._thresholds.colocate_below_prompt_tokens
        if request.prompt_tokens < min_tokens:
            return DisaggDecision(
                False,
                DisaggReason.SHORT_PROMPT,
                fraction,
                f"prompt of {request.prompt_tokens} tokens is below {min_tokens}",
            )
        max_fraction = self._thresholds.colocate_below_uncached_fraction
        if fraction < max_fraction:
            return DisaggDecision(
                False,
                DisaggReason.MOSTLY_CACHED,
                fraction,
                f"uncached fraction {fraction:.3f} on {generation.instance_id} is below {max_fraction}",
            )
        return DisaggDecision(
            True,
            DisaggReason.LONG_UNCACHED_PROMPT,
            fraction,
            f"{request.prompt_tokens} tokens, uncached fraction {fraction:.3f} on {generation.instance_id}",
        )


# --- Both hops ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacementPlan:
    """Where a request runs. On the COLOCATED route `context` and `generation` name the same
    instance; `context.fallback` is set when that happened because no PREFILL instance was healthy.
    `decision` is what the disaggregation rule wanted, so on a fallback it still says disaggregate:
    the router should record both in the request's timeline."""

    request_id: str
    route: Route
    context: Placement
    generation: Placement
    decision: DisaggDecision

    @property
    def fallback(self) -> Fallback | None:
        return self.context.fallback


def _able_to_hold(candidates: Sequence[Candidate], tokens: int, holds_tokens: int = 0) -> Sequence[Candidate]:
    """The candidates whose whole KV pool can hold a sequence of `tokens` (an instance refuses a
    request it never could, worker/engine_types.py kv_pool_refusal), so that with pools of different
    sizes a long request goes where it fits instead of being refused by the least loaded instance;
    all of them when none can (the chosen one then refuses it, naming its pool's size), and without
    a pass over them when `tokens` is within `holds_tokens`, what every one of them holds (Pools)."""
    if tokens <= holds_tokens:
        return candidates
    able = [c for c in candidates if c.load.total_blocks * c.load.tokens_per_block >= tokens]
    return able if able and len(able) < len(candidates) else candidates


# The roles that run generation hops (and colocated requests).
GENERATION_ROLES = frozenset({InstanceRole.GENERATION, InstanceRole.MIXED})
_GENERATION, _MIXED, _PREFILL = InstanceRole.GENERATION, InstanceRole.MIXED, InstanceRole.PREFILL


@dataclass(frozen=True)
class Pools:
    """The two hops' pools (Placer.place_pools): the HEALTHY candidates of each, in instance-id order
    (GENERATION and MIXED instances for the generation hop, PREFILL ones for the prefill hop), and
    how many of each are registered, healthy or not (for the error when none is healthy). A caller
    that keeps them vouches for the order and that each instance appears once."""

    healthy_generation: Sequence[Candidate]
    healthy_prefill: Sequence[Candidate]
    registered_generation: int
    registered_prefill: int
    # Tokens that every candidate of the pool's KV pool can hold (a lower bound; 0: not known): a
    # request within it skips the pass of _able_to_hold over the pool.
    generation_holds_tokens: int = 0
    prefill_holds_tokens: int = 0


def _pools_of(ordered: Sequence[Candidate]) -> Pools:
    """The pools of candidates in instance-id order, partitioned afresh (one decision's worth)."""
    # Roles by identity, not `in GENERATION_ROLES`: an Enum hashes in Python, and this runs over
    # every instance per decision.
    generation = [c for c in ordered if (role := c.load.role) is _GENERATION or role is _MIXED]
    prefill = [c for c in ordered if c.load.role is _PREFILL]
    return Pools(
        [c for c in generation if c.health is InstanceHealth.HEALTHY],
        [c for c in prefill if c.health is InstanceHealth.HEALTHY],
        len(generation),
        len(prefill),
    )


class Placer:
    """Places both hops of a request with the configured policies (round robin keeps its cursor here,
    so keep one Placer per router)."""

    def __init__(self, config: PlacementConfig, rng: random.Random | None = None) -> None:
        self._config = config
        self._prefill_policy = build_policy(config.prefill_policy, rng)
        chosen = config.generation_policy
        self._generation_policy = build_policy(chosen if chosen is not None else DEFAULT_GENERATION_POLICY, rng)
        # The instance of a request that runs colocated by configuration computes its prompt too:
        # least_loaded (Llumnix freeness: free blocks per running request) sees neither the prefix
        # it may reuse there nor the prefill work waiting there. `duet sim`, 8 MIXED, roofline H100 /
        # Llama 3 8B: TTFT p99 least_loaded 291-450 ms, kv_aware 136-154 on log-normal 2,048-token
        # prompts at 40-60 req/s; multi-turn 348 against 120 ms, prefix hit rate 0.15 against 0.37
        # (README, placement). The same instance when a policy is configured (one round-robin cursor).
        self._colocated_policy = (
            self._generation_policy if chosen is not None else build_policy(DEFAULT_COLOCATED_POLICY, rng)
        )
        self._always_colocated = config.disaggregation is DisaggMode.NEVER
        self._always_disaggregated = config.disaggregation is DisaggMode.ALWAYS
        self._disagg = ConditionalDisagg(config.disaggregation, config.conditional)

    def choose_generation(
        self,
        request: PlacementRequest,
        candidates: Sequence[Candidate],
        overlap_blocks: Mapping[str, int],
        *,
        in_id_order: bool = False,
        receives_kv: bool = False,
    ) -> Placement:
        """The generation hop alone: a hand-over's target (`receives_kv`: the prompt's KV comes from
        a prefill instance) or a local recompute (it computes the prompt). `in_id_order`: as for
        `place`."""
        _check_overlap(overlap_blocks)
        pools = _pools_of(candidates if in_id_order else _in_id_order(candidates))
        return self._choose_generation(request, pools, overlap_blocks, receives_kv)

    def _choose_generation(
        self, request: PlacementRequest, pools: Pools, overlap_blocks: Mapping[str, int], receives_kv: bool
    ) -> Placement:
        healthy = pools.healthy_generation
        if not healthy:
            raise NoInstanceAvailable("generation", f"{pools.registered_generation} GENERATION/MIXED instance(s) registered, none healthy")
        eligible = _able_to_hold(healthy, request.prompt_tokens + request.expected_decode_tokens, pools.generation_holds_tokens)
        colocated = not receives_kv and (self._always_colocated or not pools.registered_prefill)
        policy = self._colocated_policy if colocated else self._generation_policy
        if receives_kv:
            # The receiver of a hand-over takes fresh blocks for the whole prompt (worker/engine.py
            # _reserve) and computes none of it: a prefix it caches saves it nothing, so kv_aware
            # must not count one. Counted, it favoured the instances that had received the prefix
            # before, for nothing (README, placement: an effect the simulation did not resolve, as
            # receivers soon cache every hot prefix).
            overlap_blocks = _NO_OVERLAP
        return policy.choose_eligible(request, eligible, overlap_blocks)

    def place(
        self,
        request: PlacementRequest,
        candidates: Sequence[Candidate],
        overlap_blocks: Mapping[str, int],
        *,
        in_id_order: bool = False,
    ) -> PlacementPlan:
        """Both hops. `in_id_order`: the caller vouches that the candidates are Candidates, each
        instance once, in instance-id order (the fleet keeps its members so), and they are not
        checked again (a pass over every instance per request)."""
        # Checked and ordered once for both hops; the policies take the healthy ones from here.
        return self.place_pools(request, _pools_of(candidates if in_id_order else _in_id_order(candidates)), overlap_blocks)

    def place_pools(self, request: PlacementRequest, pools: Pools, overlap_blocks: Mapping[str, int]) -> PlacementPlan:
        """Both hops, from pools the caller keeps (the fleet patches them as reports arrive rather
        than partitioning every instance per request: at 256 instances that was half a decision's
        time); the same decision as `place` on the candidates they were taken from."""
        _check_overlap(overlap_blocks)
        # Under `always` with a prefill instance to take the context, the generation instance is a
        # hand-over's target. Under `conditional` its cached prefix decides whether the request runs
        # colocated there (ConditionalDisagg), so its choice counts the prefix as for a colocated one.
        receives_kv = self._always_disaggregated and bool(pools.healthy_prefill)
        generation = self._choose_generation(request, pools, overlap_blocks, receives_kv)
        # The chosen one's snapshot, found by bisection: the pool is in instance-id order.
        healthy_generation = pools.healthy_generation
        index = bisect.bisect_left(healthy_generation, generation.instance_id, key=_instance_id)
        generation_snapshot = healthy_generation[index].snapshot
        decision = self._disagg.decide(
            request, generation_snapshot, cached_blocks(request, generation.instance_id, overlap_blocks)
        )
        if not decision.disaggregate:
            return PlacementPlan(request.request_id, Route.COLOCATED, generation, generation, decision)

        healthy_prefill = pools.healthy_prefill
        if healthy_prefill:
            # A prefill hop holds the prompt and its first token (worker/engine_types.py hop_max_new_tokens).
            eligible = _able_to_hold(healthy_prefill, request.prompt_tokens + 1, pools.prefill_holds_tokens)
            context = self._prefill_policy.choose_eligible(request, eligible, overlap_blocks)
            return PlacementPlan(request.request_id, Route.DISAGGREGATED, context, generation, decision)

        reason = f"{pools.registered_prefill} PREFILL instance(s) registered, none healthy"
        if FallbackKind.COLOCATE_WHEN_NO_PREFILL not in self._config.allowed_fallbacks:
            raise NoInstanceAvailable("prefill", reason)
        logger.warning(
            "request %s: %s; running it colocated on %s (fallback %s)",
            request.request_id,
            reason,
            generation.instance_id,
            FallbackKind.COLOCATE_WHEN_NO_PREFILL.value,
        )
        context = dataclasses.replace(
            generation, fallback=Fallback(FallbackKind.COLOCATE_WHEN_NO_PREFILL, reason)
        )
        return PlacementPlan(request.request_id, Route.COLOCATED, context, generation, decision)
