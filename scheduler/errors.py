"""Typed errors of the scheduler package."""

from __future__ import annotations


class SchedulerError(Exception):
    """Base class of every error raised by the scheduler package."""


class InvalidFieldError(SchedulerError, ValueError):
    """A configuration or request field has an invalid value; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class IllegalStateTransition(SchedulerError):
    """A request was moved between two states that the transition table does not connect."""


class BlockAccountingError(SchedulerError):
    """The block manager was asked for something impossible (unknown sequence, pool exhausted...)."""


class OutOfBlocksError(BlockAccountingError):
    """A fresh block was needed and no free (or evictable cached) block is left."""
