"""The OpenAI-compatible HTTP API as an ASGI application (Starlette); server.py runs it under uvicorn.

    POST /v1/chat/completions   POST /v1/completions   (stream: server-sent events)
    GET  /v1/models             GET  /metrics (Prometheus)   GET /health

It only adapts HTTP to the engine, and failures to OpenAI's error body (`error_for`). Request bodies are read up to a size bound (413 beyond) and requests
are admitted up to a count bound (429 beyond). Each admitted request generates on a thread of its own,
because generation is blocking torch and socket work that must never run on the event loop; text reaches
the loop through a queue. While a request is open its connection is watched: a client that goes away sets
the generation's cancel flag, the next text callback raises `ClientGone`, and the engine closes the cloud
session on the way out, so a dropped stream frees its cloud KV within one decode step.

A slow reader never holds a generation back: text queues here (bounded by max_tokens) while uvicorn waits
for the socket to drain, so the cloud session and the engine slot are freed as soon as generation ends.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..errors import CapacityError, ConfigError, ShardMismatch, SplitInferError, TransportError
from ..metrics import CONTENT_TYPE_LATEST
from . import logprobs as lp
from . import protocol as p
from .engine import Engine

log = logging.getLogger("splitinfer.api")


def error_for(exc: BaseException) -> p.APIError:
    """The OpenAI-shaped error for a failure (status, type, code)."""
    if isinstance(exc, p.APIError):
        return exc
    if isinstance(exc, ConfigError):
        code = "context_length_exceeded" if "context" in str(exc) else "invalid_value"
        return p.APIError(400, str(exc), code=code)
    if isinstance(exc, (CapacityError, TransportError)):
        return p.APIError(503, f"the cloud half is unavailable: {exc}", type="server_error", code=exc.code)
    if isinstance(exc, (ShardMismatch, SplitInferError)):
        return p.APIError(502, str(exc), type="server_error", code=exc.code)
    return p.APIError(500, "internal error; see the api server's log.", type="server_error", code="internal")


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise p.APIError(400, f"the request body is not valid JSON: {exc}.", code="invalid_json") from exc
    except ValueError as exc:  # Python parses integers of up to 4300 digits
        raise p.APIError(400, "the request body holds an integer of over 4300 digits; send numbers of ordinary size.",
                         code="invalid_json") from exc
    except RecursionError as exc:  # the parser recurses once per level of nesting
        raise p.APIError(400, "the request body nests arrays or objects too deeply; OpenAI's request bodies "
                              "need a few levels, so send one of those.", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise p.APIError(400, "the request body must be a JSON object.", code="invalid_json")
    return body


def sse(obj: dict | str) -> bytes:
    """One server-sent event carrying a JSON object (or a literal such as "[DONE]")."""
    payload = obj if isinstance(obj, str) else json.dumps(obj)
    return f"data: {payload}\n\n".encode()


@dataclass(frozen=True)
class ApiLimits:
    max_body_bytes: int = 8 * 1024 * 1024  # request bodies above this get 413
    max_pending: int = 64  # requests generating or waiting for an engine slot at once; more get 429
    max_connections: int = 512  # open connections uvicorn accepts (its own plain 503 beyond)
    shutdown_grace_s: float = 5.0  # on shutdown, streams still open after this are cut

    def __post_init__(self):
        if self.max_body_bytes < 1 or self.max_pending < 1 or self.max_connections < 1 or self.shutdown_grace_s < 0:
            raise ValueError("API limits must be positive")


class ClientGone(Exception):
    """Raised from a generation's text callback once its client has gone away (or the server stops)."""


class _Generation:
    """One request's prompt preparation and generation on a thread, reporting to the event loop.

    Events on `events`, in order: ("ready", None) once the prompt is tokenized, then ("text", (str, entries))
    per streamed piece, then ("done", Turn) or ("error", exception); ("gone", None) when the client left.
    With logprobs asked for, `entries` are the logprob entries of the tokens behind that piece (logprobs.py),
    and `kept` collects them for a reply that is not streamed.
    """

    def __init__(self, engine: Engine, prepare: Callable[[], list[int]], params: p.Params,
                 on_exit: Callable[["_Generation"], None]):
        self.engine, self.prepare, self.params, self.on_exit = engine, prepare, params, on_exit
        self.cancelled = threading.Event()
        self.events: asyncio.Queue = asyncio.Queue()  # unbounded: at most max_tokens small strings
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="splitinfer-api-generate", daemon=True)
        self.recorder = (lp.TokenRecorder(engine.token_text, engine.client.stop_ids()) if params.logprobs else None)
        self.kept: list[dict] = []  # logprob entries of the text generated so far (a reply that is not streamed)

    def start(self) -> "_Generation":
        self._thread.start()
        return self

    def _put(self, kind: str, value) -> None:
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop has closed: nobody is left to read, so stop generating
            self.cancelled.set()

    def abort(self, kind: str = "gone", value=None) -> None:
        """Stop at the next text piece and tell the request's task (any thread)."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            self._put(kind, value)

    def _on_text(self, text: str) -> None:
        if self.cancelled.is_set():
            raise ClientGone  # the engine closes the cloud session as this unwinds
        entries = self.recorder.take() if self.recorder is not None else []
        if self.params.stream:
            self._put("text", (text, entries))
        else:
            self.kept.extend(entries)

    def _run(self) -> None:
        try:
            prompt_ids = self.prepare()
            self._put("ready", None)
            if self.cancelled.is_set():
                raise ClientGone
            on_token = self.recorder.on_token if self.recorder is not None else None
            last = ("done", self.engine.generate(prompt_ids, self.params, self._on_text, on_token))
        except BaseException as exc:  # noqa: BLE001 - every failure is handed to the request's task
            last = ("error", exc)
        # Leave before the reply goes out: a client that sends its next request on reading this one's end
        # must find the slot free.
        self.on_exit(self)
        self._put(*last)


class ApiApp:
    """The ASGI application: routes, authentication, limits; `cancel_all()` stops every generation."""

    def __init__(self, engine: Engine, api_keys: tuple[str, ...] = (), limits: ApiLimits = ApiLimits()):
        self.engine = engine
        self.api_keys = tuple(k.encode() for k in api_keys)  # empty: no key needed (loopback use)
        self.limits = limits
        self.started = int(time.time())
        self._lock = threading.Lock()
        self._active: set[_Generation] = set()  # admitted requests, until their thread ends
        self._app = Starlette(
            routes=[
                Route("/v1/chat/completions", _Completions(self, chat=True), methods=["POST"]),
                Route("/v1/completions", _Completions(self, chat=False), methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_exception},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._active)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every admitted request's thread has ended (and so closed its cloud session)."""
        deadline = time.monotonic() + timeout_s
        while self.pending:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def cancel_all(self) -> None:
        with self._lock:
            active = list(self._active)
        shutdown = p.APIError(503, "the api server is shutting down; retry once it is back.", type="server_error",
                              code="shutdown")
        for generation in active:
            generation.abort("error", shutdown)

    # -- admission, errors, authentication -----------------------------------------------------------
    def admit(self, generation: _Generation) -> None:
        with self._lock:
            if len(self._active) >= self.limits.max_pending:
                raise p.APIError(429, f"the server is busy ({self.limits.max_pending} requests in progress); "
                                      "retry in a moment.", type="rate_limit_error", code="rate_limit_exceeded")
            self._active.add(generation)
        generation.start()

    def _leave(self, generation: _Generation) -> None:
        with self._lock:
            self._active.discard(generation)

    def error_response(self, exc: BaseException) -> JSONResponse:
        err = error_for(exc)
        if err.status == 500:
            log.error("request failed", exc_info=exc)
        self.count_error(err)
        headers = {}
        if err.status == 413:
            headers["Connection"] = "close"  # the unread body would be taken for the next request
        elif err.status == 429:
            headers["Retry-After"] = "1"
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def count_error(self, err: p.APIError) -> None:
        if self.engine.metrics is not None:
            self.engine.metrics.error(err.code or f"http_{err.status}")

    async def _http_exception(self, request: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        return self.error_response(p.APIError(exc.status_code, f"no route {request.method} {request.url.path}.", code=code))

    def authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        given = (request.headers.get("authorization") or "").removeprefix("Bearer ").strip().encode()
        # Compare with every key, not stopping at a match, so timing does not tell which key was sent.
        if not any([hmac.compare_digest(given, key) for key in self.api_keys]):
            raise p.APIError(401, "missing or wrong API key; send the key of --api-key-file as the bearer token.",
                             code="invalid_api_key")

    async def read_body(self, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        too_large = p.APIError(413, f"send a request body of at most {limit} bytes.", code="too_large")
        declared = request.headers.get("content-length")
        if declared is not None and not (declared.isascii() and declared.isdigit() and int(declared) <= limit):
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():  # chunked bodies have no length to check up front
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > 2 * limit:
                break
            # Past the limit, read on (up to as much again) and discard: closing on a client that is still
            # sending resets the connection, and the 413 would be lost with it.
        if size > limit:
            raise too_large
        return b"".join(chunks)

    # -- GET routes ----------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except p.APIError as exc:
            return self.error_response(exc)
        model = {"id": self.engine.model_id, "object": "model", "created": self.started, "owned_by": "splitinfer"}
        return JSONResponse({"object": "list", "data": [model]})

    async def metrics(self, request: Request) -> Response:
        try:
            self.authorize(request)
            if self.engine.metrics is None:
                raise p.APIError(404, "this server keeps no metrics.", code="not_found")
        except p.APIError as exc:
            return self.error_response(exc)
        return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "mode": self.engine.client.mode})


class _Completions:
    """POST /v1/chat/completions or /v1/completions, as a raw ASGI endpoint: the connection is watched for
    the whole request, streamed or not, which Starlette's request -> response functions cannot do."""

    def __init__(self, api: ApiApp, chat: bool):
        self.api, self.chat = api, chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = self.api
        request = Request(scope, receive)
        try:
            raw = await api.read_body(request)  # read first, so that an error reply leaves the connection usable
            api.authorize(request)
            body = parse_body(raw)
            generation = self._generation(body)
            api.admit(generation)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            await _answer(api.error_response(exc), scope, receive, send)
            return
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_watch, receive, generation)
                await self._respond(generation, body["model"], scope, receive, send)
                tasks.cancel_scope.cancel()
        finally:
            generation.abort()  # no-op once it finished; else it stops at its next piece of text

    def _generation(self, body: dict) -> _Generation:
        engine = self.api.engine
        model = body.get("model")
        if model != engine.model_id:
            raise p.APIError(404, f"the model {p.show(model)} does not exist here; this server serves {engine.model_id!r}.",
                             param="model", code="model_not_found")
        params = p.parse_params(body, engine.default_max_tokens, engine.strategy, chat=self.chat)
        if self.chat:
            messages = p.chat_messages(body)
            prepare = lambda: engine.chat_ids(messages)  # noqa: E731 - tokenizing runs on the generation's thread
        else:
            prompt = p.completion_prompt(body)
            prepare = lambda: engine.prompt_ids(prompt)  # noqa: E731
        return _Generation(engine, prepare, params, self.api._leave)

    async def _respond(self, generation: _Generation, model: str, scope: Scope, receive: Receive, send: Send) -> None:
        kind, value = await generation.events.get()
        if kind == "ready" and generation.params.stream:
            return await _Stream(self.api, generation, model, self.chat).send(send)
        if kind == "ready":
            kind, value = await generation.events.get()
        if kind == "gone":
            log.info("client went away before its reply; its generation stops and closes its cloud session")
        elif kind == "error":
            await _answer(self.api.error_response(value), scope, receive, send)
        else:
            turn = value
            make = p.chat_body if self.chat else p.completion_body
            stats = {k: turn.stats[k] for k in ("tokens_per_s", "mean_accepted_per_step", "steps", "strategy")}
            use = p.usage(turn.prompt_tokens, len(turn.token_ids))
            rid = p.new_id("chatcmpl" if self.chat else "cmpl")
            logprobs = None
            if generation.params.logprobs:
                logprobs = lp.chat_logprobs(generation.kept) if self.chat else lp.completion_logprobs(generation.kept)
            body = make(rid, model, turn.text, turn.finish_reason, use, stats, logprobs)
            await _answer(JSONResponse(body), scope, receive, send)


async def _answer(response: Response, scope: Scope, receive: Receive, send: Send) -> None:
    """Send a whole reply; a client that went away meanwhile gets none (the ASGI server raises OSError on send)."""
    try:
        await response(scope, receive, send)
    except OSError:
        log.info("client went away before its reply")


async def _watch(receive: Receive, generation: _Generation) -> None:
    """Wait for the client to go away; the request body has been read, so nothing else arrives."""
    while (await receive())["type"] != "http.disconnect":
        pass
    generation.abort()


class _Stream:
    """A generation's events as server-sent events, ending with `data: [DONE]` (OpenAI's stream form)."""

    def __init__(self, api: ApiApp, generation: _Generation, model: str, chat: bool):
        self.api, self.generation, self.model, self.chat = api, generation, model, chat
        self.rid = p.new_id("chatcmpl" if chat else "cmpl")
        self.offset = 0  # where the next chunk's text starts in the reply (the completions' text_offset)

    def _chunk(self, text: str | None = None, finish: str | None = None, use: dict | None = None,
               entries: list[dict] | None = None) -> dict:
        logprobs = None
        if self.generation.params.logprobs and use is None:
            logprobs = lp.chat_logprobs(entries or []) if self.chat else lp.completion_logprobs(entries or [], self.offset)
        self.offset += len(text or "")
        if self.chat:
            return p.chat_chunk(self.rid, self.model, {} if text is None else {"content": text}, finish, use, logprobs)
        return p.completion_chunk(self.rid, self.model, text or "", finish, use, logprobs)

    async def send(self, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

        async def event(obj: dict | str) -> None:
            await send({"type": "http.response.body", "body": sse(obj), "more_body": True})

        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            if self.chat:
                await event(p.chat_chunk(self.rid, self.model, {"role": "assistant", "content": ""}))
            while True:
                kind, value = await self.generation.events.get()
                if kind == "text":
                    text, entries = value
                    await event(self._chunk(text, entries=entries))
                    continue
                if kind == "gone":
                    log.info("client went away mid-stream; its generation stops and closes its cloud session")
                    return
                if kind == "done":
                    await event(self._chunk(finish=value.finish_reason))
                    if self.generation.params.include_usage:
                        await event(self._chunk(use=p.usage(value.prompt_tokens, len(value.token_ids))))
                else:  # headers are gone: the error travels as one more event, as OpenAI's streams do
                    err = error_for(value)
                    if err.status == 500:
                        log.error("stream failed", exc_info=value)
                    self.api.count_error(err)
                    await event(err.body())
                await event("[DONE]")
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
        except OSError:  # the ASGI server reports a closed connection on send
            self.generation.abort()
