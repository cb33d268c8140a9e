"""Checks run before the slow work, so the common mistakes end in one clear line instead of a traceback.

- a --server URL of the wrong form (before anything loads), or the cloud server unreachable (a TCP connect,
  before the first step),
- the local shard does not fit in free memory (before it loads),
- the server holds another shard or refuses our credentials (one handshake at start-up).

Each raises an exception of errors.py whose sentence says what to do; nothing here prints.
"""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlparse

from .errors import ConfigError, ModelError, TransportError

# Loading goes through a safetensors mmap plus the torch tensors built from it; allow some headroom.
MEMORY_HEADROOM = 1.2


def check_url(url: str):
    """The parsed --server URL; ConfigError unless it is ws:// or wss:// with a host."""
    parsed = urlparse(url)
    if parsed.scheme not in ("ws", "wss") or not parsed.hostname:
        raise ConfigError(f"--server must look like ws://HOST:PORT or wss://HOST:PORT; got {url!r}.")
    return parsed


def check_reachable(url: str, timeout_s: float = 5.0) -> None:
    parsed = check_url(url)
    port = parsed.port or (443 if parsed.scheme == "wss" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise TransportError(
            f"cannot connect to the cloud server at {url} ({reason}); start `splitinfer serve` there, "
            "or check --server, the port and any firewall in between."
        ) from exc


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_local_memory(shard: str | Path, available: int | None = None) -> None:
    """Refuse a local shard whose weights do not fit in the memory available now."""
    shard = Path(shard)
    if not shard.is_dir():
        raise ConfigError(f"the local shard {shard} does not exist; run `splitinfer prepare --out DIR` and pass DIR/local.")
    needed = sum(f.stat().st_size for f in shard.glob("*.safetensors"))
    available = available_memory_bytes() if available is None else available
    if available is not None and needed * MEMORY_HEADROOM > available:
        gib = 1024**3
        raise ModelError(
            f"the local shard {shard} needs about {needed * MEMORY_HEADROOM / gib:.1f} GiB of memory but only "
            f"{available / gib:.1f} GiB is available; free memory, prepare it with --dtype bfloat16, "
            "or keep fewer layers local (--head-layers/--tail-layers)."
        )


def check_handshake(client) -> None:
    """Open and close one cloud session: a wrong shard or refused credentials fail here, at start-up."""
    middle = client.make_middle()
    try:
        middle.open()
    finally:
        middle.close(end_session=True)
