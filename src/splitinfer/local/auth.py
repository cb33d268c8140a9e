"""How the client proves itself to a server and decides whether to trust it.

A bearer token (read from a file or the SPLITINFER_TOKEN environment variable, never from the command
line, where `ps` would show it) and, for `wss://`, the CA bundle that signed the server's certificate
and optionally a client certificate for servers that require one (mutual TLS, `serve --client-ca`).
Every client command takes the same options through `add_client_auth_args`.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass

from ..errors import ConfigError
from ..tokens import read_token_file

TOKEN_ENV = "SPLITINFER_TOKEN"


@dataclass(frozen=True)
class ClientAuth:
    token: str | None = None  # bearer token sent in the WebSocket handshake; None sends no Authorization header
    ca_file: str | None = None  # PEM bundle trusted for wss:// (default: the system's trust store)
    client_cert: str | None = None  # PEM certificate (chain) shown to a server that requires mutual TLS
    client_key: str | None = None  # its private key (default: inside client_cert)

    def __repr__(self) -> str:  # the token must never reach a log or a traceback
        return f"ClientAuth(token={'<set>' if self.token else None}, ca_file={self.ca_file!r}, client_cert={self.client_cert!r})"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def ssl_context(self, url: str) -> ssl.SSLContext | None:
        if not url.startswith("wss://"):
            if self.ca_file or self.client_cert:
                raise ConfigError(f"--ca-file/--client-cert were given but {url} is not wss://; use wss:// to talk TLS.")
            return None
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
            if self.client_cert:
                context.load_cert_chain(self.client_cert, self.client_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load the TLS files (--ca-file/--client-cert/--client-key): {exc}.") from exc
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context


def add_client_auth_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", help=f"file whose first line is the bearer token (or set {TOKEN_ENV})")
    parser.add_argument("--ca-file", help="PEM file of the CA that signed the server's certificate (wss://)")
    parser.add_argument("--client-cert", help="PEM client certificate, for a server started with --client-ca")
    parser.add_argument("--client-key", help="private key of --client-cert (default: inside that file)")


def client_auth_from_args(args: argparse.Namespace) -> ClientAuth:
    """The ClientAuth of a command that added `add_client_auth_args`' options."""
    token = None
    if args.token_file:
        token = read_token_file(args.token_file)[0]
    elif os.environ.get(TOKEN_ENV):
        token = os.environ[TOKEN_ENV].strip()
    return ClientAuth(token=token, ca_file=args.ca_file, client_cert=args.client_cert, client_key=args.client_key)
