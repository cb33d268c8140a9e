"""The one exception hierarchy of splitinfer.

Everything a user or a network peer can cause raises a subclass of `SplitInferError`. Each class has a
stable wire `code`, so an error raised on the cloud travels to the client as an error frame and is raised
there again as the same class. Messages are sentences that say what to do. Every mistake a user can make
(an option, a file, a model or shard given) is a ConfigError; ModelError is the kind about a model or shard.
"""

from __future__ import annotations


class SplitInferError(Exception):
    """Base class. `code` is the stable identifier used in error frames."""

    code = "internal"
    #: True when the same request may succeed later (capacity, restart); the client may retry.
    retryable = False


class ConfigError(SplitInferError):
    """A user-supplied setting or file is invalid."""

    code = "config"


class ModelError(ConfigError):
    """A model or shard cannot be loaded or does not match what was asked for (a user's file or setting)."""

    code = "model"


class ProtocolError(SplitInferError):
    """A message is malformed: bad framing, header, field, dtype, shape or value."""

    code = "protocol"


class MessageTooLarge(ProtocolError):
    """A message exceeds the negotiated size limit."""

    code = "too_large"


class VersionMismatch(ProtocolError):
    """The peers speak different protocol versions."""

    code = "version"


class ShardMismatch(SplitInferError):
    """The client's local shard was not prepared together with the server's cloud shard."""

    code = "shard_mismatch"


class SessionError(SplitInferError):
    """The session is unknown to the server, or has expired; the client re-prefills."""

    code = "session"
    retryable = True


class CapacityError(SplitInferError):
    """The server is at its session or cached-token budget; retry later or elsewhere."""

    code = "capacity"
    retryable = True


class TransportError(SplitInferError):
    """The connection failed or closed; the client may reconnect."""

    code = "transport"
    retryable = True


class Draining(TransportError):
    """The server is shutting down gracefully (SIGTERM): it finished the step in progress and closed the
    connection with link.py's DRAINING_CLOSE; the client moves on at once, without backoff."""

    code = "draining"


class AuthError(SplitInferError):
    """The server refused the client's credentials, or the client does not trust the server's certificate."""

    code = "auth"


class RemoteError(SplitInferError):
    """The server reported an error whose code this client does not know."""

    code = "remote"


_BY_CODE = {
    cls.code: cls
    for cls in (
        SplitInferError,
        ConfigError,
        ModelError,
        ProtocolError,
        MessageTooLarge,
        VersionMismatch,
        ShardMismatch,
        SessionError,
        CapacityError,
        TransportError,
        Draining,
        AuthError,
    )
}


def error_from_code(code: str, message: str) -> SplitInferError:
    """Rebuild the exception a peer reported in an error frame."""
    cls = _BY_CODE.get(code, RemoteError)
    return cls(message)
