"""Transfer ids (unguessable, created by the receiver when it reserves blocks) and id validation.

Request ids follow one rule from the client's API to the KV path: 1..N printable ASCII characters,
0x20-0x7E, spaces included. A client's id is the request's id at the router, and every hop's
engine id and every transfer carries it ("<id>.p1"), so any id a front end accepts must cross the
KV path too. A client names its request in at most MAX_CLIENT_REQUEST_ID_CHARS characters; the
router's hop suffix fits in the KV path's MAX_REQUEST_ID_CHARS.
"""

from __future__ import annotations

import re
import secrets

TRANSFER_ID_RANDOM_BYTES = 24
MAX_TRANSFER_ID_CHARS = 64
MAX_REQUEST_ID_CHARS = 256
MAX_CLIENT_REQUEST_ID_CHARS = 128

_TRANSFER_ID_PATTERN = re.compile(rf"[A-Za-z0-9_-]{{16,{MAX_TRANSFER_ID_CHARS}}}")


class InvalidIdentifier(ValueError):
    """A transfer or request id that is malformed (wrong characters or length)."""


def new_transfer_id() -> str:
    """A fresh id with 192 random bits (URL-safe base64, 32 characters)."""
    return secrets.token_urlsafe(TRANSFER_ID_RANDOM_BYTES)


def check_transfer_id(value: object) -> str:
    if not isinstance(value, str) or _TRANSFER_ID_PATTERN.fullmatch(value) is None:
        raise InvalidIdentifier(
            f"transfer_id must be 16..{MAX_TRANSFER_ID_CHARS} characters of [A-Za-z0-9_-], got {_preview(value)}"
        )
    return value


def request_id_problem(value: object, limit: int = MAX_REQUEST_ID_CHARS) -> str | None:
    """What is wrong with a request id under the one rule (None: nothing), in words a front end
    can put after the field's name."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value:
        return "must not be empty"
    if len(value) > limit:
        return f"must be at most {limit} characters, got {len(value)}"
    if not (value.isascii() and value.isprintable()):  # 0x20-0x7E
        return "must be printable ASCII"
    return None


def check_request_id(value: object) -> str:
    problem = request_id_problem(value)
    if problem is not None:
        raise InvalidIdentifier(f"request_id {problem}: {_preview(value)}")
    assert isinstance(value, str)
    return value


def _preview(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
