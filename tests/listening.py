"""Helpers for tests that start a server process: a free port, and waiting until something listens on it."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from splitinfer.launch import free_port  # noqa: F401 (the tests' one way to pick a port)


def wait_for(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    """Poll until `port` accepts a connection; fail at once (with the log's tail) if `proc` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server process exited with {proc.returncode}: {log.read_text()[-3000:]}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"nothing listens on {port}")
