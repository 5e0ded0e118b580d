"""The OpenAI-compatible HTTP front end: a Starlette app served by uvicorn on the router's event
loop, beside the gRPC front end, on the same `RouterAPI`.

    server = OpenAIServer(router, tokenizer, served_model_name="duet-default", port=8000)
    port = await server.start()          # logs "OpenAI API on http://HOST:PORT/v1"
    ...
    server.set_serving(False)            # draining: /health answers 503
    await server.stop(grace_s=2.0)

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id},
GET /health, GET /metrics, POST /tokenize, POST /detokenize (vLLM's shapes), GET /version.

Edge rules, as the gRPC front end's (cluster/frontend/service.py): a body is parsed
(cluster/frontend/openai_schema.py) and validated (cluster/frontend/openai_convert.py) here, once,
and reaches the router as token ids (`ClientRequest(validated=True)`); bad input is a 400 in
OpenAI's error shape naming the field, and never reaches the router. Every router error maps to
one status (cluster/frontend/openai_render.py): 404 unknown model or route, 409 request id in use,
429 admission queue full (a batch is admitted whole or not at all: `RouterAPI.submit_all`), 503
draining or nothing healthy. A body never causes a 500: only a bug does.

Streaming is Server-Sent Events, `data: {...}` per token delta and `data: [DONE]`, written by an
ASGI response of our own (`_EventStream`) that watches the connection while it waits for tokens:
a client that disconnects mid-stream (or while a non-streamed request runs) has every request of
its body aborted at the router, which frees their blocks on every instance.

Authentication: `Authorization: Bearer <token>` checked against the same tokens as gRPC, in
constant time (the gRPC front end's check); /health is exempt, as gRPC's health service is. TLS:
the same certificate, key and client CA files.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cluster.frontend.convert import ModelLimits, RequestValidationError
from cluster.frontend.openai_convert import (
    ChatFormatter,
    ModelNotFound,
    Plan,
    chat_messages,
    chat_plan,
    check_model,
    completion_plan,
)
from cluster.frontend.openai_render import (
    CompletionLogprobs,
    TokenTexts,
    chat_logprobs,
    error_body,
    final_error,
    router_error_body,
    timeline,
    usage,
)
from cluster.frontend.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChat,
    TokenizeCompletion,
)
from cluster.frontend.service import BearerAuthInterceptor, FrontendError, check_listener, host_for_address
from cluster.router.api import (
    FinalEvent,
    InstanceHealthView,
    RequestEvent,
    RequestHandle,
    RouterAPI,
    RouterError,
    TokenEvent,
)
from cluster.shutdown import STOP_TIMEOUT_S, bounded
from worker.tokenizer import ChatTemplateError, TokenizerError

logger = logging.getLogger(__name__)

DEFAULT_HTTP_PORT = 8000
DEFAULT_SERVED_MODEL_NAME = "duet-default"
MAX_BODY_BYTES = 8 * 1024 * 1024
ORPHAN_ABORT_WAIT_S = 5.0
_DONE = b"data: [DONE]\n\n"


def _version() -> str:
    try:
        return importlib.metadata.version("duet-serve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _sse(value: Any) -> bytes:
    return b"data: " + _dumps(value) + b"\n\n"


class _JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return _dumps(content)


class HttpError(Exception):
    """A request refused with an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(status, message, param, code)


@dataclass(frozen=True)
class HttpTls:
    """The front end's TLS files (the gRPC front end's settings); with `client_ca`, mutual TLS."""

    certfile: str
    keyfile: str
    client_ca: str | None = None


# ---- event plumbing ----------------------------------------------------------------------------


class _Events:
    """The events of one body's requests, in arrival order, as (choice index, event); tracks which
    requests have not ended (aborted if the client goes away)."""

    def __init__(self, handles: Sequence[RequestHandle]) -> None:
        self.handles = handles
        self.open = set(range(len(handles)))
        self._tasks: list[asyncio.Task[None]] = []
        if len(handles) == 1:
            self._single = handles[0].events().__aiter__()
        else:
            # One reader per request, so a slow choice never holds back another's tokens.
            self._queue: asyncio.Queue[tuple[int, RequestEvent | Exception]] = asyncio.Queue()
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._read(i, handle)) for i, handle in enumerate(handles)]

    async def _read(self, index: int, handle: RequestHandle) -> None:
        try:
            async for event in handle.events():
                await self._queue.put((index, event))
        except Exception as error:  # raised where the events are read
            await self._queue.put((index, error))

    async def next(self) -> tuple[int, RequestEvent] | None:
        if not self.open:
            return None
        if self._tasks:
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            event = item
        else:
            index, event = 0, await self._single.__anext__()
        if isinstance(event, FinalEvent):
            self.open.discard(index)
        return index, event

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


async def _wait_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(Response):
    """A Server-Sent Events response whose producer is cancelled when the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, produce: Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]], headers: dict[str, str]) -> None:
        self._produce = produce
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **headers})
        self.raw_headers.append((b"content-type", b"text/event-stream; charset=utf-8"))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})

        async def write(chunk: bytes) -> None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        loop = asyncio.get_running_loop()
        producer = loop.create_task(self._produce(write))
        watcher = loop.create_task(_wait_disconnect(receive))
        try:
            await asyncio.wait((producer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not producer.done():
                producer.cancel()  # the client left: its finally aborts the requests
                await asyncio.wait((producer,))
        if producer.cancelled() or producer.exception() is not None:
            if not producer.cancelled() and not isinstance(producer.exception(), OSError):
                logger.error("stream failed", exc_info=producer.exception())
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# ---- the app -----------------------------------------------------------------------------------


class OpenAIApp:
    """The endpoints over one router. Holds no request state besides orphan aborts in flight."""

    def __init__(
        self,
        router: RouterAPI,
        tokenizer: Any,
        *,
        served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
        tokens: Sequence[str] = (),
        registry: Any = None,
        chat_template: str | None = None,
    ) -> None:
        self._router = router
        self._tokenizer = tokenizer
        self.served_model_name = served_model_name
        self._auth = BearerAuthInterceptor(tokens) if tokens else None
        self._registry = registry
        self._chat = ChatFormatter(tokenizer, chat_template)
        self._texts = TokenTexts(lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        self._created = int(time.time())
        self._version = _version()
        self.serving = True
        self._orphan_aborts: set[asyncio.Task[None]] = set()
        routes = [
            Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._endpoint(self.chat_completions), methods=["POST"]),
            Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
            Route("/v1/models/{model_id:path}", self._endpoint(self.model), methods=["GET"]),
            Route("/health", self._endpoint(self.health, authenticated=False), methods=["GET"]),
            Route("/metrics", self._endpoint(self.metrics), methods=["GET"]),
            Route("/tokenize", self._endpoint(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._endpoint(self.detokenize), methods=["POST"]),
            Route("/version", self._endpoint(self.version), methods=["GET"]),
        ]
        self.asgi = Starlette(
            routes=routes,
            exception_handlers={HTTPException: self._http_exception, Exception: self._internal},
        )

    # --- plumbing ---------------------------------------------------------------------------------
    def _endpoint(self, handler: Callable[[Request], Awaitable[Response]], *, authenticated: bool = True):
        async def endpoint(request: Request) -> Response:
            try:
                if authenticated and self._auth is not None:
                    self._authenticate(request)
                return await handler(request)
            except HttpError as error:
                return _JSON(error.body, status_code=error.status)
            except RequestValidationError as error:
                return _JSON(error_body(400, str(error), error.field), status_code=400)
            except ModelNotFound as error:
                return _JSON(error_body(404, str(error), "model", "model_not_found"), status_code=404)
            except RouterError as error:
                status, body = router_error_body(error)
                return _JSON(body, status_code=status)

        return endpoint

    def _authenticate(self, request: Request) -> None:
        assert self._auth is not None
        refusal = self._auth.verdict([("authorization", value) for value in request.headers.getlist("authorization")])
        if refusal is not None:
            raise HttpError(401, refusal[1], None, "invalid_api_key")

    async def _http_exception(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        message = "no such route" if error.status_code == 404 else str(error.detail)
        return _JSON(error_body(error.status_code, f"{request.method} {request.url.path}: {message}"), status_code=error.status_code)

    async def _internal(self, request: Request, error: Exception) -> Response:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return _JSON(error_body(500, "internal error"), status_code=500)

    @staticmethod
    async def _parse(request: Request, model: type[BaseModel]) -> Any:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise HttpError(400, f"body: must be at most {MAX_BODY_BYTES} bytes, got {len(raw)}", "body")
        try:
            return model.model_validate_json(raw)
        except ValidationError as error:
            first = error.errors(include_url=False)[0]
            if first["type"] == "json_invalid":
                raise HttpError(400, f"body: not valid JSON ({first['msg']})", "body") from None
            location = [part for part in first["loc"] if isinstance(part, int) or part in _field_names(model)]
            field = _field_path(location) or "body"
            raise HttpError(400, f"{field}: {first['msg']}", field) from None

    def _limits(self) -> ModelLimits:
        # Read per call: the router learns the model's limits when its instances register.
        return ModelLimits(vocab_size=self._router.vocab_size, max_seq_len=self._router.max_seq_len)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))

    def _abort_open(self, events: _Events) -> None:
        for index in sorted(events.open):
            request_id = events.handles[index].request_id
            task = asyncio.get_running_loop().create_task(self._abort_quietly(request_id))
            self._orphan_aborts.add(task)
            task.add_done_callback(self._orphan_aborts.discard)
        events.open.clear()

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            aborted, state = await self._router.abort(request_id=request_id)
        except RouterError as error:  # NOT_FOUND: it ended on its own meanwhile
            logger.debug("abort of %s after its client left: %s", request_id, error)
            return
        logger.info("request %s aborted: its client went away (state %s, aborted=%s)", request_id, state, aborted)

    async def wait_for_orphan_aborts(self, timeout_s: float) -> None:
        if self._orphan_aborts:
            await asyncio.wait(set(self._orphan_aborts), timeout=timeout_s)

    # --- generation -------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        check_model(body.model, self.served_model_name)
        plan = completion_plan(
            body, self._limits(), self._router.tokenize, self._decode, request_id=request.headers.get("x-request-id")
        )
        return await self._generate(request, plan, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        check_model(body.model, self.served_model_name)
        plan = chat_plan(body, self._limits(), self._chat, request_id=request.headers.get("x-request-id"))
        return await self._generate(request, plan, chat=True)

    async def _generate(self, request: Request, plan: Plan, *, chat: bool) -> Response:
        handles = await self._router.submit_all([choice.request for choice in plan.choices])
        client_id = request.headers.get("x-request-id")
        name = client_id if client_id is not None else handles[0].request_id
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{name}"
        headers = {"x-request-id": client_id if client_id is not None else handles[0].request_id}
        render = _Rendering(plan, chat, response_id, self.served_model_name, self._texts, handles)
        if plan.stream:
            return _EventStream(lambda write: self._stream(write, handles, render), headers)
        events = _Events(handles)
        loop = asyncio.get_running_loop()
        collecting = loop.create_task(self._collect(events, render))
        watcher = loop.create_task(_wait_disconnect(request.receive))
        try:
            await asyncio.wait((collecting, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collecting.done():
                collecting.cancel()
                await asyncio.wait((collecting,))
            events.close()
            self._abort_open(events)
        if collecting.cancelled():
            return Response(status_code=499)  # nobody reads it
        status, body = collecting.result()
        return _JSON(body, status_code=status, headers=headers)

    async def _collect(self, events: _Events, render: _Rendering) -> tuple[int, dict[str, Any]]:
        while (item := await events.next()) is not None:
            index, event = item
            if isinstance(event, TokenEvent):
                render.add_tokens(index, event)
                continue
            error = final_error(event)
            if error is not None:
                return error
            render.finish(index, event)
        return 200, render.response()

    async def _stream(self, write: Callable[[bytes], Awaitable[None]], handles: Sequence[RequestHandle], render: _Rendering) -> None:
        events = _Events(handles)
        try:
            for chunk in render.opening_chunks():
                await write(_sse(chunk))
            while (item := await events.next()) is not None:
                index, event = item
                if isinstance(event, TokenEvent):
                    await write(_sse(render.token_chunk(index, event)))
                    continue
                error = final_error(event)
                if error is not None:
                    await write(_sse(error[1]))
                    break
                await write(_sse(render.final_chunk(index, event)))
            else:
                closing = render.closing_chunk()
                if closing is not None:
                    await write(_sse(closing))
            await write(_DONE)
        except RouterError as error:
            await write(_sse(router_error_body(error)[1]))
            await write(_DONE)
        finally:
            events.close()
            self._abort_open(events)

    # --- the rest ---------------------------------------------------------------------------------
    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.served_model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "duet",
            "root": self.served_model_name,
            "max_model_len": self._router.max_seq_len,
        }

    async def models(self, request: Request) -> Response:
        return _JSON({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        check_model(request.path_params["model_id"], self.served_model_name)
        return _JSON(self._model_card())

    async def health(self, request: Request) -> Response:
        if not self.serving:
            return _JSON(error_body(503, "draining"), status_code=503)
        view = self._router.cluster_status()
        if not any(instance.health is InstanceHealthView.HEALTHY for instance in view.instances):
            return _JSON(error_body(503, "no healthy instance"), status_code=503)
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        if self._registry is None:
            raise HttpError(404, "GET /metrics: this server has no metrics registry")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        try:
            data = json.loads(await request.body())
        except ValueError:
            data = None  # _parse names the problem
        has_messages = isinstance(data, dict) and "messages" in data
        model: type[BaseModel] = TokenizeChat if has_messages else TokenizeCompletion
        body = await self._parse(request, model)
        if body.model is not None:
            check_model(body.model, self.served_model_name)
        try:
            if isinstance(body, TokenizeChat):
                ids = self._chat.encode(chat_messages(body.messages), body.add_generation_prompt)
            else:
                ids = list(self._tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        except ChatTemplateError as error:
            raise RequestValidationError("messages", str(error)) from None
        return _JSON({"count": len(ids), "max_model_len": self._router.max_seq_len, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        body = await self._parse(request, DetokenizeRequest)
        if body.model is not None:
            check_model(body.model, self.served_model_name)
        try:
            text = self._tokenizer.decode(body.tokens)
        except TokenizerError as error:
            raise RequestValidationError("tokens", str(error)) from None
        return _JSON({"prompt": text})

    async def version(self, request: Request) -> Response:
        return _JSON({"version": self._version})


def _field_names(model: type[BaseModel]) -> set[str]:
    names: set[str] = set()
    for field in model.model_fields.values():
        names.add(field.alias or "")
    names.update(model.model_fields)
    # Nested bodies (messages[i].content[j]) name their own fields.
    names.update(("role", "content", "type", "text", "name", "include_usage"))
    return names


def _field_path(parts: Sequence[str | int]) -> str:
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


class _Rendering:
    """One body's response, built as its events arrive (non-streamed), or its stream chunks."""

    def __init__(
        self,
        plan: Plan,
        chat: bool,
        response_id: str,
        model: str,
        texts: TokenTexts,
        handles: Sequence[RequestHandle],
    ) -> None:
        self.plan = plan
        self.chat = chat
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.texts = texts
        self.handles = handles
        count = len(plan.choices)
        self.text: list[list[str]] = [[] for _ in range(count)]
        self.token_ids: list[list[int]] = [[] for _ in range(count)]
        self.finals: list[FinalEvent | None] = [None] * count
        self.completion_logprobs = [CompletionLogprobs() for _ in range(count)] if not chat else []
        self.chat_logprobs: list[list[dict[str, Any]]] = [[] for _ in range(count)]
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    # non-streamed
    def add_tokens(self, index: int, event: TokenEvent) -> None:
        self.text[index].append(event.text)
        self.token_ids[index].extend(event.token_ids)
        if self.plan.logprobs is not None:
            if self.chat:
                self.chat_logprobs[index].extend(chat_logprobs(event, self.texts))
            else:
                self.completion_logprobs[index].add(event, self.texts)

    def finish(self, index: int, event: FinalEvent) -> None:
        self.finals[index] = event

    def _echo(self, index: int) -> str:
        if not self.plan.echo_texts:
            return ""
        return self.plan.echo_texts[self.plan.choices[index].prompt_index]

    def response(self) -> dict[str, Any]:
        choices = []
        for index, final in enumerate(self.finals):
            assert final is not None
            text = self._echo(index) + "".join(self.text[index])
            if self.chat:
                choice: dict[str, Any] = {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": {"content": self.chat_logprobs[index]} if self.plan.logprobs is not None else None,
                    "finish_reason": final.finish_reason,
                }
            else:
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": self.completion_logprobs[index].since(0) if self.plan.logprobs is not None else None,
                    "finish_reason": final.finish_reason,
                }
            choice["stop_reason"] = final.stop_reason
            if self.plan.return_token_ids:
                choice["token_ids"] = self.token_ids[index]
            choices.append(choice)
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
        }
        if self.plan.return_timeline:
            body["duet"] = self._timelines()
        return body

    def _usage(self) -> dict[str, Any]:
        finals = [final for final in self.finals if final is not None]
        cached = {}
        for choice, final in zip(self.plan.choices, self.finals, strict=True):
            if final is not None:
                cached.setdefault(choice.prompt_index, final.usage.cached_tokens)
        return usage(
            sum(len(prompt) for prompt in self.plan.prompts),
            sum(final.usage.completion_tokens for final in finals),
            sum(cached.values()),
        )

    def _timelines(self) -> dict[str, Any]:
        return {
            "requests": [
                timeline(self.handles[index].request_id, index, final)
                for index, final in enumerate(self.finals)
                if final is not None
            ]
        }

    # streamed
    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model, "choices": choices}

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chat: each choice's first chunk carries the role. Completions with echo: the prompts."""
        if self.chat:
            return [
                self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
                for i in range(len(self.plan.choices))
            ]
        if self.plan.echo_texts:
            return [
                self._chunk([{"index": i, "text": self._echo(i), "logprobs": None, "finish_reason": None}])
                for i in range(len(self.plan.choices))
            ]
        return []

    def token_chunk(self, index: int, event: TokenEvent) -> dict[str, Any]:
        logprobs = None
        if self.chat:
            if self.plan.logprobs is not None:
                logprobs = {"content": chat_logprobs(event, self.texts)}
            choice = {"index": index, "delta": {"content": event.text}, "logprobs": logprobs, "finish_reason": None}
        else:
            if self.plan.logprobs is not None:
                logprobs = self.completion_logprobs[index].add(event, self.texts)
            choice = {"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": None}
        if self.plan.return_token_ids:
            choice["token_ids"] = list(event.token_ids)
        return self._chunk([choice])

    def final_chunk(self, index: int, event: FinalEvent) -> dict[str, Any]:
        self.finals[index] = event
        if self.chat:
            choice: dict[str, Any] = {"index": index, "delta": {}, "logprobs": None, "finish_reason": event.finish_reason}
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": event.finish_reason}
        choice["stop_reason"] = event.stop_reason
        return self._chunk([choice])

    def closing_chunk(self) -> dict[str, Any] | None:
        """After every choice ended: usage (stream_options.include_usage) and duet's timelines."""
        if not self.plan.include_usage and not self.plan.return_timeline:
            return None
        chunk = self._chunk([])
        if self.plan.include_usage:
            chunk["usage"] = self._usage()
        if self.plan.return_timeline:
            chunk["duet"] = self._timelines()
        return chunk


# ---- the server --------------------------------------------------------------------------------


class OpenAIServer:
    """uvicorn serving an `OpenAIApp` on the running event loop (the router's)."""

    def __init__(
        self,
        router: RouterAPI,
        tokenizer: Any,
        *,
        served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
        host: str = "127.0.0.1",
        port: int = DEFAULT_HTTP_PORT,
        tokens: Sequence[str] = (),
        tls: HttpTls | None = None,
        registry: Any = None,
        chat_template: str | None = None,
    ) -> None:
        check_listener(host, port, tokens, port_name="http_port")
        self._host = host
        self._port = port
        self._tls = tls
        self.app = OpenAIApp(
            router,
            tokenizer,
            served_model_name=served_model_name,
            tokens=tokens,
            registry=registry,
            chat_template=chat_template,
        )
        self._server: Any = None
        self._socket: socket.socket | None = None
        self._main: asyncio.Task[None] | None = None
        self._bound_port: int | None = None

    @property
    def port(self) -> int:
        if self._bound_port is None:
            raise FrontendError("the server is not started")
        return self._bound_port

    @property
    def url(self) -> str:
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://{host_for_address(self._host)}:{self.port}/v1"

    async def start(self) -> int:
        import uvicorn

        if self._server is not None:
            raise FrontendError("the server is already started")
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # IPPROTO_TCP named, not 0: asyncio turns Nagle's algorithm off only on sockets that say TCP,
        # and with it on, a response's second write waits for the client's delayed ACK (~40 ms).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host.strip("[]"), self._port))
            sock.listen(2048)
            sock.setblocking(False)
        except OSError as error:
            sock.close()
            raise FrontendError(f"cannot bind {self._host}:{self._port} for the OpenAI API: {error}") from error
        tls: dict[str, Any] = {}
        if self._tls is not None:
            tls = {"ssl_certfile": self._tls.certfile, "ssl_keyfile": self._tls.keyfile}
            if self._tls.client_ca is not None:
                tls.update(ssl_ca_certs=self._tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        # log_config=None: uvicorn must not reconfigure the process's logging; lifespan off: the
        # router, not the app, owns startup and shutdown.
        config = uvicorn.Config(
            self.app.asgi, lifespan="off", log_config=None, access_log=False, server_header=False, **tls
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        self._server, self._socket = server, sock
        self._bound_port = sock.getsockname()[1]
        self._main = asyncio.get_running_loop().create_task(server.main_loop(), name="openai-http")
        logger.info("OpenAI API on %s", self.url)
        return self._bound_port

    def set_serving(self, serving: bool) -> None:
        """/health answers 503 while not serving (draining)."""
        self.app.serving = serving

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting; requests still running after `grace_s` are cancelled (and aborted at the router)."""
        if self._server is None:
            return
        server, self._server = self._server, None
        self.set_serving(False)
        server.should_exit = True
        if self._main is not None:
            await bounded(self._main, "the OpenAI API's main loop")
        server.config.timeout_graceful_shutdown = grace_s
        await bounded(server.shutdown(sockets=[self._socket]), "the OpenAI API's server stop", grace_s + STOP_TIMEOUT_S)
        await self.app.wait_for_orphan_aborts(ORPHAN_ABORT_WAIT_S)
        logger.info("OpenAI API on %s:%s stopped", self._host, self._bound_port)

