"""How the client proves itself to a server and decides whether to trust it.

A bearer token (read from a file or the SPLITINFER_TOKEN environment variable, never from the command
line, where `ps` would show it) and, for `wss://`, the CA bundle that signed the server's certificate.
Every client command takes the same two options through `add_client_auth_args`.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

TOKEN_ENV = "SPLITINFER_TOKEN"


@dataclass(frozen=True)
class ClientAuth:
    token: str | None = None  # bearer token sent in the WebSocket handshake; None sends no Authorization header
    ca_file: str | None = None  # PEM bundle trusted for wss:// (default: the system's trust store)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def ssl_context(self, url: str) -> ssl.SSLContext | None:
        if not url.startswith("wss://"):
            if self.ca_file:
                raise ConfigError(f"--ca-file was given but {url} is not wss://; use wss:// to talk TLS.")
            return None
        context = ssl.create_default_context(cafile=self.ca_file)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context


def read_token_file(path: str | Path) -> list[str]:
    """Tokens in a file, one per line; blank lines and lines starting with '#' are ignored."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path}: {exc.strerror}.") from exc
    tokens = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not tokens:
        raise ConfigError(f"the token file {path} holds no token; put one token per line.")
    return tokens


def add_client_auth_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", help=f"file whose first line is the bearer token (or set {TOKEN_ENV})")
    parser.add_argument("--ca-file", help="PEM file of the CA that signed the server's certificate (wss://)")


def client_auth_from_args(args: argparse.Namespace) -> ClientAuth:
    token = None
    if getattr(args, "token_file", None):
        token = read_token_file(args.token_file)[0]
    elif os.environ.get(TOKEN_ENV):
        token = os.environ[TOKEN_ENV].strip()
    return ClientAuth(token=token, ca_file=getattr(args, "ca_file", None))
