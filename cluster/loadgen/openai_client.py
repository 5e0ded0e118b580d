"""The load generator's client of the OpenAI HTTP API (`duet bench --backend openai`): the same
`generate(prompt, **sampling) -> Delta..., Result` as AsyncDuetClient, so one runner drives both
front ends and the records line up.

A small HTTP/1.1 client on asyncio streams, not the openai SDK (a test dependency only) nor an
HTTP library: a keep-alive connection per concurrent request, POST /v1/completions with
`stream: true`, `stream_options.include_usage` (the counts) and vLLM's `return_token_ids` (each
chunk's token ids, which the multi-turn workload feeds back). Errors become DuetError with the
gRPC code of the same meaning, so the runner records them alike.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import grpc

from cluster.client import DuetError
from cluster.client.sdk import Delta, Result, Usage

# HTTP status -> the gRPC code of the same meaning (cluster/frontend/openai_render.py's inverse).
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
MAX_HEADER_BYTES = 64 * 1024


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def head(self) -> tuple[int, dict[str, str]]:
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        parts = status_line.decode("latin-1").split(" ", 2)
        status = int(parts[1])
        headers: dict[str, str] = {}
        size = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            size += len(line)
            if size > MAX_HEADER_BYTES:
                raise ConnectionError("response headers too large")
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def body_chunks(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readline()  # the CRLF after the last chunk (no trailers)
                    return
                data = await self.reader.readexactly(size)
                await self.reader.readexactly(2)
                yield data
        else:
            length = int(headers.get("content-length", "0"))
            if length:
                yield await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


class OpenAIClient:
    """`async with OpenAIClient("http://127.0.0.1:8000") as client: async for event in client.generate(...)`."""

    def __init__(self, base_url: str, *, token: str | None = None, model: str | None = None) -> None:
        url = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"target: expected http://HOST:PORT, got {base_url!r}")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        prefix = url.path.rstrip("/")
        self._prefix = prefix if prefix.endswith("/v1") else f"{prefix}/v1"
        self._root = self._prefix.removesuffix("/v1")
        self._token = token
        self.model = model
        self._idle: list[_Connection] = []

    async def __aenter__(self) -> OpenAIClient:
        if self.model is None:
            try:
                status, body = await self._request("GET", f"{self._prefix}/models")
            except OSError as error:
                raise DuetError(grpc.StatusCode.UNAVAILABLE, f"cannot reach {self._host}:{self._port}: {error}") from None
            if status != 200:
                raise _error(status, body)
            self.model = json.loads(body)["data"][0]["id"]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()

    async def health(self) -> bool:
        status, _ = await self._request("GET", f"{self._root}/health")
        return status == 200

    # --- requests -----------------------------------------------------------------------------------
    async def _connect(self) -> _Connection:
        if self._idle:
            return self._idle.pop()
        reader, writer = await asyncio.open_connection(self._host, self._port, ssl=self._ssl, limit=1 << 20)
        return _Connection(reader, writer)

    def _message(self, method: str, path: str, body: bytes | None) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self._host}:{self._port}"]
        if self._token:
            lines.append(f"Authorization: Bearer {self._token}")
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")

    async def _request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        connection = await self._connect()
        try:
            connection.writer.write(self._message(method, path, body))
            status, headers = await connection.head()
            data = b"".join([chunk async for chunk in connection.body_chunks(headers)])
        except BaseException:
            connection.close()
            raise
        self._release(connection, headers)
        return status, data

    def _release(self, connection: _Connection, headers: dict[str, str]) -> None:
        if headers.get("connection", "").lower() == "close":
            connection.close()
        else:
            self._idle.append(connection)

    async def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> AsyncIterator[Delta | Result]:
        """One streamed completion: a Delta per chunk with tokens, then one Result (DuetError on failure).
        Takes AsyncDuetClient.generate's sampling keywords; `timeout_s` bounds the whole request."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop", "min_tokens"):
            value = kwargs.get(name)
            if value is not None:
                body[name] = list(value) if name == "stop" and not isinstance(value, str) else value
        timeout_s = kwargs.get("timeout_s")
        connection = await self._connect()
        reusable = False
        try:
            connection.writer.write(self._message("POST", f"{self._prefix}/completions", json.dumps(body).encode()))
            async with asyncio.timeout(timeout_s) if hasattr(asyncio, "timeout") else _nothing():
                status, headers = await connection.head()
                if status != 200:
                    data = b"".join([chunk async for chunk in connection.body_chunks(headers)])
                    reusable = True
                    raise _error(status, data)
                request_id = headers.get("x-request-id", "")
                finish_reason = stop_reason = None
                usage = Usage(0, 0)
                pending = b""
                async for data in connection.body_chunks(headers):
                    pending += data
                    while b"\n\n" in pending:
                        event, pending = pending.split(b"\n\n", 1)
                        if not event.startswith(b"data: "):
                            continue
                        payload = event[6:]
                        if payload == b"[DONE]":
                            continue
                        chunk = json.loads(payload)
                        if "error" in chunk:
                            error = chunk["error"]
                            raise DuetError(_CODES.get(_status_of(error), grpc.StatusCode.INTERNAL), error.get("message", ""))
                        if chunk.get("usage"):
                            u = chunk["usage"]
                            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                            usage = Usage(u["prompt_tokens"], u["completion_tokens"], cached)
                        for choice in chunk.get("choices", ()):
                            ids = tuple(choice.get("token_ids") or ())
                            if ids or choice.get("text"):
                                yield Delta(request_id, ids, choice.get("text", ""))
                            if choice.get("finish_reason") is not None:
                                finish_reason, stop_reason = choice["finish_reason"], choice.get("stop_reason")
                reusable = True
            yield Result(request_id, finish_reason, stop_reason, usage, (), ())
        except (TimeoutError, asyncio.TimeoutError):
            raise DuetError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no complete answer within {timeout_s:g} s") from None
        except (ConnectionError, asyncio.IncompleteReadError, OSError) as error:
            raise DuetError(grpc.StatusCode.UNAVAILABLE, f"connection to {self._host}:{self._port} failed: {error}") from None
        finally:
            if reusable:
                self._release(connection, {})
            else:
                connection.close()


class _nothing:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc_info: object) -> None:
        return None


def _status_of(error: dict[str, Any]) -> int:
    kinds = {"invalid_request_error": 400, "authentication_error": 401, "not_found_error": 404, "rate_limit_error": 429}
    return kinds.get(error.get("type", ""), 503 if error.get("code") == "UNAVAILABLE" else 500)


def _error(status: int, body: bytes) -> DuetError:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")[:200]
    return DuetError(_CODES.get(status, grpc.StatusCode.INTERNAL), f"HTTP {status}: {message}")
