"""Fault injection on the KV transfer path, driven by a seeded plan (off by default).

A plan is plain config data (a dict, e.g. a YAML section), so an operator can switch it on for a
deployment's own chaos runs:

    faults:
      enabled: true
      seed: 7
      rules:
        - {kind: corrupt, probability: 0.05}                   # any chunk, 5 % each
        - {kind: stall, scope: transfer, probability: 0.01}    # 1 % of transfers stall
        - {kind: kill, side: receiver, request_ids: [req-42], chunk: 3}
        - {kind: hold, state: DISAGG_GENERATION_INIT, seconds: 2.0, request_ids: [req-7]}

Rule fields: `kind` (below); `side` ("sender", the default, or "receiver"); `scope` ("chunk": every
chunk draws on its own, the default; "transfer": one draw per transfer, and a hit acts on chunk
`chunk`, default 0); `probability` (default 1.0); `request_ids` (only these requests; default all);
`chunk` (only this chunk sequence number); `request_ids` entries may be shell-style patterns
(`chaos-7.*`); `seconds` (delay and hold: how long; stall: how far past
the deadline, default 0.5); `state` (hold: the state name); `max_fires` (stop after this many hits).
Draws are a hash of (seed, rule, request id, attempt, chunk), so a plan gives the same faults in
every run regardless of thread timing, and a retried transfer (the next attempt of a request) draws
afresh.

What each kind does, and the outcome on both sides (sender: `KvSender.push`'s TransferOutcome;
receiver: the calls its TransferTarget gets), the receiver serving on afterwards in every case:

| kind      | side     | action                                               | sender outcome         | receiver target              |
|-----------|----------|------------------------------------------------------|------------------------|------------------------------|
| drop      | sender   | the chunk is not sent                                | INCOMPLETE             | fail(INCOMPLETE) at commit   |
| delay     | sender   | wait `seconds` before sending the chunk              | ok (if within deadline)| commit()                     |
| duplicate | sender   | the chunk is sent twice                              | ok                     | commit() (copy ignored)      |
| reorder   | sender   | the chunk is sent after the next one of its stream   | ok                     | commit()                     |
| corrupt   | sender   | one byte flipped after the checksum was taken        | CHECKSUM_MISMATCH      | fail(CHECKSUM_MISMATCH)      |
| truncate  | sender   | the stream ends (cleanly) before this chunk          | INCOMPLETE             | fail(INCOMPLETE) at commit   |
| stall     | sender   | the stream hangs until past the deadline             | DEADLINE_EXCEEDED      | fail(DEADLINE_EXCEEDED)      |
| close     | sender   | the connection is torn down mid-stream, no Abort     | PEER_UNAVAILABLE       | fail(PEER_UNAVAILABLE)       |
| kill      | sender   | SIGKILL to the sending process                       | (process gone)         | fail(PEER_UNAVAILABLE)       |
| drop      | receiver | the chunk is discarded on arrival                    | INCOMPLETE             | fail(INCOMPLETE) at commit   |
| delay     | receiver | wait `seconds` before handling the chunk             | ok (if within deadline)| commit()                     |
| stall     | receiver | the handler hangs until past the deadline            | DEADLINE_EXCEEDED      | fail(DEADLINE_EXCEEDED)      |
| expire    | receiver | the reservation lapses when the chunk arrives        | RESERVATION_EXPIRED    | fail(RESERVATION_EXPIRED)    |
| refuse    | receiver | Prepare is refused (chunk/scope do not apply)        | RESOURCE_EXHAUSTED     | never opened                 |
| kill      | receiver | SIGKILL to the receiving process                     | PEER_UNAVAILABLE       | (process gone)               |
| hold      | (engine) | `hold_seconds(request_id, state)` returns `seconds`  | engine keeps the request in that state that long |  |

Hold states are the local state names (LlmRequestState), plus CONTEXT_IN_PROGRESS: a request held
there stops after its first context chunk, holding its blocks (a prefill in progress).

A receiver learns of a lost sender (close, kill) from the streams it is serving; if the connection
drops before any stream of the transfer has reached it, it learns at the transfer's deadline instead
(fail(DEADLINE_EXCEEDED)). Acting on a stream's second chunk or later avoids that race in tests.
"""

from __future__ import annotations

import enum
import fnmatch
import hashlib
import logging
import os
import signal
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from msgspec import Meta

from worker.config import (
    ConfigProblem,
    ConfigStruct,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    ProblemKind,
    load_config,
)

logger = logging.getLogger(__name__)

DEFAULT_STALL_EXTRA_S = 0.5
_ATTEMPT_MEMORY = 65536


class FaultPlanError(ValueError):
    """An invalid fault plan (the message names the rule and field)."""


class FaultKind(enum.Enum):
    DROP = "drop"
    DELAY = "delay"
    DUPLICATE = "duplicate"
    REORDER = "reorder"
    CORRUPT = "corrupt"
    TRUNCATE = "truncate"
    STALL = "stall"
    CLOSE = "close"
    KILL = "kill"
    EXPIRE = "expire"
    REFUSE = "refuse"
    HOLD = "hold"


class FaultSide(enum.Enum):
    SENDER = "sender"
    RECEIVER = "receiver"


class FaultScope(enum.Enum):
    CHUNK = "chunk"
    TRANSFER = "transfer"


_KINDS_BY_SIDE: dict[FaultSide, frozenset[FaultKind]] = {
    FaultSide.SENDER: frozenset(
        {
            FaultKind.DROP,
            FaultKind.DELAY,
            FaultKind.DUPLICATE,
            FaultKind.REORDER,
            FaultKind.CORRUPT,
            FaultKind.TRUNCATE,
            FaultKind.STALL,
            FaultKind.CLOSE,
            FaultKind.KILL,
            FaultKind.HOLD,
        }
    ),
    FaultSide.RECEIVER: frozenset(
        {FaultKind.DROP, FaultKind.DELAY, FaultKind.STALL, FaultKind.EXPIRE, FaultKind.REFUSE, FaultKind.KILL}
    ),
}


class _FaultSection(ConfigStruct, frozen=True):
    """A part of the fault plan: its errors are FaultPlanErrors naming the rule and field."""

    @classmethod
    def config_error(cls, problem: ConfigProblem) -> Exception:
        if problem.kind is ProblemKind.UNKNOWN_KEY:
            known = sorted((problem.owner or cls).__struct_fields__)
            return FaultPlanError(f"{problem.parent or 'faults'}: unknown field(s) {[problem.key]}; known: {known}")
        if problem.kind is ProblemKind.MISSING:
            return FaultPlanError(f"{problem.parent}: {problem.key} is required")
        return FaultPlanError(f"{problem.path}: {problem.detail}" if problem.path else problem.detail)


class FaultRule(_FaultSection, frozen=True):
    kind: FaultKind
    """What to do (the table above); required."""
    side: FaultSide = FaultSide.SENDER
    """Which end of the transfer acts."""
    scope: FaultScope = FaultScope.CHUNK
    """chunk: every chunk draws on its own; transfer: one draw per transfer, a hit acts on `chunk` (default 0)."""
    probability: Annotated[float, Meta(ge=0, le=1)] = 1.0
    """Chance of a hit per draw (0..1)."""
    request_ids: frozenset[str] = frozenset()
    """Only these requests (shell-style patterns, "chaos-7.*"); empty: all."""
    chunk: NonNegativeInt | None = None
    """Only this chunk sequence number."""
    seconds: NonNegativeFloat | None = None
    """delay and hold: how long, in seconds; stall: how far past the deadline (default 0.5 s)."""
    state: str | None = None
    """hold: the state name to hold the request in."""
    max_fires: PositiveInt | None = None
    """Stop after this many hits."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in _KINDS_BY_SIDE[self.side]:
            raise FaultPlanError(f"kind {self.kind.value!r} cannot act on the {self.side.value} side")
        if self.kind in (FaultKind.DELAY, FaultKind.HOLD) and self.seconds is None:
            raise FaultPlanError(f"kind {self.kind.value!r} needs seconds")
        if self.kind is FaultKind.HOLD:
            if not self.state:
                raise FaultPlanError("kind 'hold' needs state (the state name to hold the request in)")
        elif self.state is not None:
            raise FaultPlanError(f"state applies only to kind 'hold', not {self.kind.value!r}")

    @property
    def target_chunk(self) -> int | None:
        """The chunk a hit acts on: `chunk`, or chunk 0 for a transfer-scoped rule."""
        if self.chunk is None and self.scope is FaultScope.TRANSFER:
            return 0
        return self.chunk

    def matches_request(self, request_id: str) -> bool:
        # Entries are shell-style patterns ("chaos-7.*" matches every hop of chaos-7); an entry
        # without wildcards matches exactly.
        return not self.request_ids or any(fnmatch.fnmatchcase(request_id, pattern) for pattern in self.request_ids)


class FaultPlan(_FaultSection, frozen=True):
    """The `faults:` section: a plan given is on unless it says `enabled: false`."""

    enabled: bool = True
    """Inject the rules' faults (a plan with no rules injects nothing either way)."""
    seed: int = 0
    """Seed of the draws: the same plan and seed give the same faults in every run."""
    rules: tuple[FaultRule, ...] = ()
    """The rules, each drawn on its own."""

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> FaultPlan:
        """Build from config data; None or {} is the disabled plan."""
        return load_config(cls, data, "faults") if data else NO_FAULTS


NO_FAULTS = FaultPlan(enabled=False)


@dataclass(frozen=True)
class ChunkFaults:
    """What to do to one chunk (all False/0: send or handle it normally)."""

    drop: bool = False
    duplicate: bool = False
    reorder: bool = False
    corrupt: bool = False
    truncate: bool = False
    stall: bool = False
    close: bool = False
    kill: bool = False
    expire: bool = False
    delay_s: float = 0.0
    stall_extra_s: float = DEFAULT_STALL_EXTRA_S

    @property
    def any(self) -> bool:
        return self != NO_CHUNK_FAULTS


NO_CHUNK_FAULTS = ChunkFaults()


def _draw(seed: int, rule_index: int, request_id: str, attempt: int, point: str) -> float:
    """A uniform number in [0, 1) that depends only on its arguments."""
    digest = hashlib.blake2b(f"{seed}|{rule_index}|{request_id}|{attempt}|{point}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def kill_self() -> None:
    """SIGKILL to this process: no cleanup, no goodbye (what a crashed node looks like to its peers)."""
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjector:
    """Answers, per transfer and chunk, which faults to inject. Thread-safe."""

    def __init__(self, plan: FaultPlan, *, kill: Callable[[], None] = kill_self) -> None:
        self.plan = plan
        self._kill = kill
        self._lock = threading.Lock()
        self._fires = [0] * len(plan.rules)
        self._attempts: OrderedDict[tuple[FaultSide, str], int] = OrderedDict()

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> FaultInjector:
        return cls(FaultPlan.from_mapping(data))

    @property
    def enabled(self) -> bool:
        return self.plan.enabled and bool(self.plan.rules)

    def kill(self) -> None:
        logger.warning("fault injection: killing this process (pid %d)", os.getpid())
        self._kill()

    def _take_fire(self, rule_index: int) -> bool:
        rule = self.plan.rules[rule_index]
        with self._lock:
            if rule.max_fires is not None and self._fires[rule_index] >= rule.max_fires:
                return False
            self._fires[rule_index] += 1
            return True

    def fires(self) -> tuple[int, ...]:
        """How often each rule has fired so far."""
        with self._lock:
            return tuple(self._fires)

    def begin_transfer(self, side: FaultSide, transfer_id: str, request_id: str) -> TransferFaults:
        if not self.enabled:
            return _NO_TRANSFER_FAULTS
        rules = [
            (index, rule)
            for index, rule in enumerate(self.plan.rules)
            if rule.side is side and rule.kind is not FaultKind.HOLD and rule.matches_request(request_id)
        ]
        if not rules:
            return _NO_TRANSFER_FAULTS
        with self._lock:
            key = (side, request_id)
            attempt = self._attempts.pop(key, 0)
            self._attempts[key] = attempt + 1
            while len(self._attempts) > _ATTEMPT_MEMORY:
                self._attempts.popitem(last=False)
        armed: list[tuple[int, FaultRule]] = []
        for index, rule in rules:
            if rule.scope is FaultScope.TRANSFER or rule.kind is FaultKind.REFUSE:
                if _draw(self.plan.seed, index, request_id, attempt, "transfer") >= rule.probability:
                    continue
            armed.append((index, rule))
        return TransferFaults(self, transfer_id, request_id, attempt, tuple(armed))

    def hold_seconds(self, request_id: str, state_name: str) -> float:
        """How long the engine should hold `request_id` in `state_name` (0.0: not at all)."""
        if not self.enabled:
            return 0.0
        held = 0.0
        for index, rule in enumerate(self.plan.rules):
            if rule.kind is not FaultKind.HOLD or rule.state != state_name or not rule.matches_request(request_id):
                continue
            if _draw(self.plan.seed, index, request_id, 0, f"hold:{state_name}") >= rule.probability:
                continue
            if self._take_fire(index):
                assert rule.seconds is not None
                held = max(held, float(rule.seconds))
        if held:
            logger.warning("fault injection: holding request %s in %s for %.3f s", request_id, state_name, held)
        return held


class TransferFaults:
    """The faults armed for one transfer on one side."""

    def __init__(
        self,
        injector: FaultInjector | None,
        transfer_id: str,
        request_id: str,
        attempt: int,
        armed: tuple[tuple[int, FaultRule], ...],
    ) -> None:
        self._injector = injector
        self.transfer_id = transfer_id
        self.request_id = request_id
        self.attempt = attempt
        self._armed = armed

    @property
    def active(self) -> bool:
        return bool(self._armed)

    def refuse(self) -> bool:
        """Whether Prepare is to be refused (receiver side)."""
        for index, rule in self._armed:
            if rule.kind is FaultKind.REFUSE and self._fire(index, rule, "prepare"):
                return True
        return False

    def _fire(self, index: int, rule: FaultRule, where: str) -> bool:
        assert self._injector is not None
        if not self._injector._take_fire(index):
            return False
        logger.warning(
            "fault injection: %s (%s side) at %s of transfer %s, request %s",
            rule.kind.value,
            rule.side.value,
            where,
            self.transfer_id,
            self.request_id,
        )
        return True

    def on_chunk(self, sequence: int) -> ChunkFaults:
        if not self._armed:
            return NO_CHUNK_FAULTS
        assert self._injector is not None
        effects: dict[str, Any] = {}
        for index, rule in self._armed:
            if rule.kind is FaultKind.REFUSE:
                continue
            target = rule.target_chunk
            if target is not None and target != sequence:
                continue
            if rule.scope is FaultScope.CHUNK:
                point = f"chunk:{sequence}"
                if _draw(self._injector.plan.seed, index, self.request_id, self.attempt, point) >= rule.probability:
                    continue
            if not self._fire(index, rule, f"chunk {sequence}"):
                continue
            if rule.kind is FaultKind.DELAY:
                effects["delay_s"] = effects.get("delay_s", 0.0) + float(rule.seconds or 0.0)
            elif rule.kind is FaultKind.STALL:
                effects["stall"] = True
                effects["stall_extra_s"] = float(rule.seconds) if rule.seconds is not None else DEFAULT_STALL_EXTRA_S
            else:
                effects[rule.kind.value] = True
        return ChunkFaults(**effects) if effects else NO_CHUNK_FAULTS


_NO_TRANSFER_FAULTS = TransferFaults(None, "", "", 0, ())
