"""What placement and the prefix index see of one instance: its latest load, stamped by the router.

An instance reports an `EngineLoad` (worker/protocol.py) in every poll batch; the router wraps it
with the instance's id and the batch's sequence number. Sequence numbers are per instance
incarnation and increase by one per poll; `reset` marks the first snapshot of a new incarnation (a
restarted instance), meaning "forget everything you know about me". The prefix index
(cluster/router/prefix_index.py) relies on both to stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.protocol import MAX_COUNTER, EngineLoad

MAX_INSTANCE_ID_CHARS = 128


class InvalidSnapshot(ValueError):
    """A snapshot field is of the wrong type or out of range (a bug in the router, which builds them)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.detail = message
        super().__init__(f"snapshot field {field!r}: {message}")


@dataclass(frozen=True)
class InstanceSnapshot:
    instance_id: str
    load: EngineLoad
    sequence: int = 0
    reset: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.instance_id, str) or not self.instance_id:
            raise InvalidSnapshot("instance_id", "expected a non-empty string")
        if len(self.instance_id) > MAX_INSTANCE_ID_CHARS or not self.instance_id.isprintable():
            raise InvalidSnapshot("instance_id", f"must be printable and at most {MAX_INSTANCE_ID_CHARS} characters")
        if not isinstance(self.load, EngineLoad):
            raise InvalidSnapshot("load", f"expected an EngineLoad, got {type(self.load).__name__}")
        if type(self.sequence) is not int or not 0 <= self.sequence <= MAX_COUNTER:
            raise InvalidSnapshot("sequence", f"expected an integer in [0, {MAX_COUNTER}], got {self.sequence!r}")
        if type(self.reset) is not bool:
            raise InvalidSnapshot("reset", f"expected a bool, got {type(self.reset).__name__}")
