"""The OpenAI-compatible HTTP server on the trusted machine (standard library HTTP, one thread per request).

    POST /v1/chat/completions   POST /v1/completions   (stream: server-sent events, chunked)
    GET  /v1/models             GET  /metrics (Prometheus)   GET /health

It binds to loopback by default: it hands out text, which is exactly what the split keeps off the
network, and without `--api-key-file` it asks for no key. It only adapts HTTP to the engine and maps failures to
OpenAI's error body with a fitting status.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..errors import CapacityError, ConfigError, ShardMismatch, SplitInferError, TransportError
from ..metrics import CONTENT_TYPE_LATEST
from . import protocol as p
from .engine import Engine

log = logging.getLogger("splitinfer.api")

MAX_BODY_BYTES = 8 * 1024 * 1024


def api_error(exc: BaseException) -> p.APIError:
    """The OpenAI-shaped error for a failure (status, type, code)."""
    if isinstance(exc, p.APIError):
        return exc
    if isinstance(exc, ConfigError):
        code = "context_length_exceeded" if "context" in str(exc) else "invalid_value"
        return p.APIError(400, str(exc), code=code)
    if isinstance(exc, (CapacityError, TransportError)):
        return p.APIError(503, f"the cloud half is unavailable: {exc}", type="server_error", code=exc.code)
    if isinstance(exc, ShardMismatch):
        return p.APIError(502, str(exc), type="server_error", code=exc.code)
    if isinstance(exc, SplitInferError):
        return p.APIError(502, str(exc), type="server_error", code=exc.code)
    return p.APIError(500, "internal error; see the api server's log.", type="server_error", code="internal")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_HTTPServer"

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        log.debug("%s " + format, self.address_string(), *args)

    # -- plumbing ------------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: dict) -> None:
        self._send(status, json.dumps(obj).encode())

    def _fail(self, exc: BaseException) -> None:
        err = api_error(exc)
        if err.status == 500:
            log.error("request failed", exc_info=exc)
        metrics = self.server.engine.metrics
        if metrics is not None:
            metrics.error(err.code or f"http_{err.status}")
        self._json(err.status, err.body())

    def _read(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True  # the unread body would be taken for the next request
            raise p.APIError(413, f"give a Content-Length of at most {MAX_BODY_BYTES} bytes.", code="too_large")
        return self.rfile.read(length)

    @staticmethod
    def _parse(raw: bytes) -> dict:
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise p.APIError(400, f"the request body is not valid JSON: {exc}.", code="invalid_json") from exc
        if not isinstance(body, dict):
            raise p.APIError(400, "the request body must be a JSON object.", code="invalid_json")
        return body

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, obj: dict | str) -> None:
        payload = obj if isinstance(obj, str) else json.dumps(obj)
        self._chunk(f"data: {payload}\n\n".encode())

    def _authorized(self) -> bool:
        keys = self.server.api_keys
        if not keys:
            return True
        given = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip().encode()
        if any(hmac.compare_digest(given, key) for key in keys):
            return True
        self._fail(p.APIError(401, "missing or wrong API key; send the key of --api-key-file as the bearer token.",
                              type="invalid_request_error", code="invalid_api_key"))
        return False

    # -- routes --------------------------------------------------------------------------------------
    def do_GET(self):  # noqa: N802 - http.server's naming
        engine = self.server.engine
        path = self.path.split("?", 1)[0]
        if path != "/health" and not self._authorized():
            return
        if path == "/v1/models":
            model = {"id": engine.model_id, "object": "model", "created": self.server.started, "owned_by": "splitinfer"}
            self._json(200, {"object": "list", "data": [model]})
        elif path == "/metrics" and engine.metrics is not None:
            self._send(200, engine.metrics.render(), CONTENT_TYPE_LATEST)
        elif path == "/health":
            self._json(200, {"status": "ok", "mode": engine.client.mode})
        else:
            self._fail(p.APIError(404, f"no route GET {path}.", code="not_found"))

    def do_POST(self):  # noqa: N802
        path = self.path.split("?", 1)[0]
        self._streaming = False
        try:
            raw = self._read()  # read first, so that an error reply leaves the connection reusable
            if not self._authorized():
                return
            if path not in ("/v1/chat/completions", "/v1/completions"):
                raise p.APIError(404, f"no route POST {path}.", code="not_found")
            self._complete(self._parse(raw), chat=path == "/v1/chat/completions")
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            if getattr(self, "_streaming", False):
                self._stream_error(exc)
            else:
                self._fail(exc)

    def _complete(self, body: dict, chat: bool) -> None:
        engine = self.server.engine
        model = body.get("model")
        if model != engine.model_id:
            raise p.APIError(404, f"the model {model!r} does not exist here; this server serves {engine.model_id!r}.",
                             param="model", code="model_not_found")
        params = p.parse_params(body, engine.default_max_tokens, engine.strategy)
        prompt_ids = engine.chat_ids(p.chat_messages(body)) if chat else engine.prompt_ids(p.completion_prompt(body))
        rid = p.new_id("chatcmpl" if chat else "cmpl")
        if not params.stream:
            turn = engine.generate(prompt_ids, params)
            make = p.chat_body if chat else p.completion_body
            stats = {k: turn.stats[k] for k in ("tokens_per_s", "mean_accepted_per_step", "steps", "strategy")}
            self._json(200, make(rid, model, turn.text, turn.finish_reason, p.usage(turn.prompt_tokens, len(turn.token_ids)), stats))
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._streaming = True
        if chat:
            self._event(p.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
            on_text = lambda text: self._event(p.chat_chunk(rid, model, {"content": text}))  # noqa: E731
        else:
            on_text = lambda text: self._event(p.completion_chunk(rid, model, text))  # noqa: E731
        turn = engine.generate(prompt_ids, params, on_text)
        if chat:
            self._event(p.chat_chunk(rid, model, {}, turn.finish_reason))
        else:
            self._event(p.completion_chunk(rid, model, "", turn.finish_reason))
        if params.include_usage:
            use = p.usage(turn.prompt_tokens, len(turn.token_ids))
            self._event((p.chat_chunk if chat else p.completion_chunk)(rid, model, {} if chat else "", use=use))
        self._end_stream()

    def _end_stream(self) -> None:
        self._event("[DONE]")
        self._chunk(b"")
        self._streaming = False

    def _stream_error(self, exc: BaseException) -> None:
        """Headers are gone: the error travels as one more event, as OpenAI's streams do."""
        if isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            log.info("client went away mid-stream; its cloud session was closed")
            self.close_connection = True
            return
        err = api_error(exc)
        metrics = self.server.engine.metrics
        if metrics is not None:
            metrics.error(err.code or f"http_{err.status}")
        try:
            self._event(err.body())
            self._end_stream()
        except OSError:
            self.close_connection = True


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    engine: Engine
    started: int
    api_keys: tuple[bytes, ...]


class ApiServer:
    """The HTTP server on its own thread; `port=0` picks a free port (tests)."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 8000, api_keys: tuple[str, ...] = ()):
        self.httpd = _HTTPServer((host, port), _Handler)
        self.httpd.engine = engine
        self.httpd.api_keys = tuple(k.encode() for k in api_keys)  # empty: no key needed (loopback use)
        self.httpd.started = int(time.time())
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> "ApiServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="splitinfer-api", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
