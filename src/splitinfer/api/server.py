"""The OpenAI-compatible API server on the trusted machine: the ASGI app of app.py under uvicorn.

It binds to loopback by default: it hands out text, which is exactly what the split keeps off the
network, and without API keys it asks for none. The socket is bound here, before uvicorn starts, so a
taken port fails at construction and `port=0` knows its port at once (tests). `start()` serves on a
thread, `serve_forever()` in the caller's (the CLI: uvicorn then handles Ctrl-C).

Needs the `api` extra (starlette, uvicorn); constructing a server without it raises ConfigError.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from ..errors import ConfigError
from ..extras import API, require_extra
from ..options import Shared
from .config import API_DEFAULTS
from .engine import Engine

log = logging.getLogger("splitinfer.api")

START_TIMEOUT_S = 30.0


def _uvicorn_server(uvicorn):  # a factory: uvicorn is imported only once the api extra is known to be there
    class Server(uvicorn.Server):
        """uvicorn's server; on Ctrl-C or SIGTERM it first ends every stream (an error event, then [DONE]),
        so the graceful shutdown finishes at once instead of waiting for generations to run out."""

        def __init__(self, config, app):
            super().__init__(config)
            self.api = app

        def handle_exit(self, sig, frame) -> None:
            self.api.cancel_all()
            super().handle_exit(sig, frame)

    return Server


class ApiServer:
    """uvicorn serving `ApiApp(engine)`; a context manager that serves on a thread."""

    def __init__(self, engine: Engine, host: str = Shared.host, port: int = API_DEFAULTS.port,
                 api_keys: tuple[str, ...] = (), limits=None):
        require_extra("api", API, "splitinfer api")
        import uvicorn

        from .app import ApiApp, ApiLimits

        limits = ApiLimits() if limits is None else limits
        self.app = ApiApp(engine, api_keys, limits)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family)  # OSError: the caller says which port
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_config=None, log_level="warning", access_log=False, lifespan="off", server_header=False,
            limit_concurrency=limits.max_connections, timeout_graceful_shutdown=limits.shutdown_grace_s,
        )
        self._uvicorn = _uvicorn_server(uvicorn)(config, self.app)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self) -> "ApiServer":
        self._thread = threading.Thread(target=self.serve_forever, name="splitinfer-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"the api server did not start on {self.host}:{self.port}; see the log above.")
            time.sleep(0.01)
        return self

    def serve_forever(self) -> None:
        self._uvicorn.run(sockets=[self.sock])

    def close(self) -> None:
        self.app.cancel_all()  # generations stop at their next token and close their cloud sessions
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=self.app.limits.shutdown_grace_s + 10)
        self.sock.close()
        # Generation threads are daemons: left running at exit, their cloud sessions would linger until the
        # cloud's idle TTL.
        if not self.app.wait_idle(self.app.limits.shutdown_grace_s):
            log.warning("%d generation(s) still running at shutdown; their cloud sessions expire by TTL",
                        self.app.pending)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
