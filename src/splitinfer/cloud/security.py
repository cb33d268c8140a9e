"""Who may use the cloud server, and over what channel: bearer tokens, TLS contexts, the exposure rule.

Pure policy, no sockets: the server adapter calls `TokenSet.identify` from its handshake hook (before the
WebSocket upgrade, so an unauthenticated peer never reaches the protocol) and `server_ssl_context` when
it starts. A client's identity is a digest of its token; sessions belong to the identity that opened
them, so knowing another client's session id is not enough to touch that session.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import ssl
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..tokens import read_token_file

SERVER_TOKENS_ENV = "SPLITINFER_SERVER_TOKENS"  # whitespace- or comma-separated tokens, for `serve`
MIN_TOKEN_CHARS = 16  # shorter secrets can be guessed online; secrets.token_urlsafe(32) gives 43
ANONYMOUS = "anonymous"  # the identity of every client when the server has no tokens (loopback, --insecure)
_BEARER = re.compile(r"Bearer ([\x21-\x7e]{1,512})")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(frozen=True)
class TokenSet:
    """The accepted bearer tokens, kept only as SHA-256 digests (never logged, never in a repr)."""

    digests: tuple[bytes, ...] = field(default=(), repr=False)

    @classmethod
    def from_tokens(cls, tokens) -> "TokenSet":
        tokens = list(tokens)
        for token in tokens:
            if len(token) < MIN_TOKEN_CHARS or not _BEARER.fullmatch(f"Bearer {token}"):
                raise ConfigError(
                    f"every token must be {MIN_TOKEN_CHARS}-512 printable characters without spaces; generate one "
                    "with: python -c 'import secrets; print(secrets.token_urlsafe(32))'."
                )
        return cls(tuple(_digest(t) for t in tokens))

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def identify(self, authorization: str | None) -> str | None:
        """The identity behind an Authorization header value, or None when it is missing or wrong.

        Every configured token is compared, in constant time and without stopping at a match, so the time
        taken says nothing about which token (or which prefix) was close. Digests make every comparison
        the same length.
        """
        if not self.enabled:
            return ANONYMOUS
        match = _BEARER.fullmatch(authorization or "")
        given = _digest(match.group(1) if match else "")
        found = False
        for digest in self.digests:
            found |= hmac.compare_digest(given, digest)
        return hashlib.sha256(b"splitinfer-identity:" + given).hexdigest()[:32] if found and match else None


def load_server_tokens(token_file: str | None) -> TokenSet:
    """Tokens from --token-file (one per line, '#' comments) or the SPLITINFER_SERVER_TOKENS variable."""
    if token_file:
        return TokenSet.from_tokens(read_token_file(token_file))
    raw = os.environ.get(SERVER_TOKENS_ENV, "")
    return TokenSet.from_tokens(t for t in re.split(r"[\s,]+", raw) if t)


def server_ssl_context(cert_file: str, key_file: str, client_ca: str | None = None) -> ssl.SSLContext:
    """TLS >= 1.2 with the given certificate chain; with `client_ca`, clients must present a certificate it signed."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
        if client_ca:
            context.load_verify_locations(cafile=client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load the TLS certificate/key ({cert_file}, {key_file}"
            f"{', ' + client_ca if client_ca else ''}): {exc}; give PEM files that belong together."
        ) from exc
    return context


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or "" (all interfaces): assume it is reachable from outside


def exposure_problem(host: str, tokens: TokenSet, tls: bool) -> str | None:
    """Why serving on `host` this way would be unsafe, or None. `serve --insecure` overrides it."""
    if is_loopback(host):
        return None
    if not tokens.enabled:
        return (
            f"refusing to serve on {host or 'all interfaces'} without authentication: anyone who can reach the "
            "port could use this server. Give --token-file (and --tls-cert/--tls-key), serve on 127.0.0.1, "
            "or pass --insecure if the network itself is trusted."
        )
    if not tls:
        return (
            f"refusing to serve on {host or 'all interfaces'} without TLS: bearer tokens and hidden states would "
            "cross the network in clear. Give --tls-cert and --tls-key, or pass --insecure if the network is trusted."
        )
    return None

