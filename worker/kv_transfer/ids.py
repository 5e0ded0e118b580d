"""Transfer ids (unguessable, created by the receiver when it reserves blocks) and id validation."""

from __future__ import annotations

import re
import secrets

TRANSFER_ID_RANDOM_BYTES = 24
MAX_TRANSFER_ID_CHARS = 64
MAX_REQUEST_ID_CHARS = 256

_TRANSFER_ID_PATTERN = re.compile(rf"[A-Za-z0-9_-]{{16,{MAX_TRANSFER_ID_CHARS}}}")
_REQUEST_ID_PATTERN = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")


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


def check_request_id(value: object) -> str:
    if not isinstance(value, str) or _REQUEST_ID_PATTERN.fullmatch(value) is None:
        raise InvalidIdentifier(
            f"request_id must be 1..{MAX_REQUEST_ID_CHARS} printable ASCII characters without spaces, "
            f"got {_preview(value)}"
        )
    return value


def _preview(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
