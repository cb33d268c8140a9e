"""The exception hierarchy and its wire codes."""

from __future__ import annotations

import inspect

import pytest

from splitinfer import errors
from splitinfer.errors import (
    CapacityError,
    ConfigError,
    Draining,
    MessageTooLarge,
    ModelError,
    ProtocolError,
    RemoteError,
    SessionError,
    ShardMismatch,
    SplitInferError,
    TransportError,
    VersionMismatch,
    error_from_code,
)

KNOWN = [
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
]

ALL_DEFINED = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, SplitInferError) and cls.__module__ == errors.__name__
]


@pytest.mark.parametrize("cls", KNOWN, ids=lambda c: c.__name__)
def test_error_from_code_round_trips(cls):
    exc = error_from_code(cls.code, "Try again later.")
    assert type(exc) is cls
    assert str(exc) == "Try again later."


def test_every_defined_error_class_is_reachable_by_its_code():
    # A class added to errors.py but not to the code table would come back as RemoteError.
    for cls in ALL_DEFINED:
        if cls is not RemoteError:
            assert type(error_from_code(cls.code, "x")) is cls, cls


def test_codes_are_unique():
    codes = [cls.code for cls in ALL_DEFINED]
    assert len(codes) == len(set(codes))


@pytest.mark.parametrize("code", ["no-such-code", "", "PROTOCOL"])
def test_unknown_code_is_remote_error(code):
    exc = error_from_code(code, "something odd happened.")
    assert type(exc) is RemoteError
    assert isinstance(exc, SplitInferError)
    assert str(exc) == "something odd happened."


def test_retryable_flags():
    retryable = {cls for cls in ALL_DEFINED if cls.retryable}
    assert retryable == {SessionError, CapacityError, TransportError, Draining}
    assert error_from_code("session", "x").retryable is True
    assert error_from_code("protocol", "x").retryable is False


def test_protocol_subclasses():
    assert issubclass(MessageTooLarge, ProtocolError)
    assert issubclass(VersionMismatch, ProtocolError)
    assert all(issubclass(cls, SplitInferError) for cls in ALL_DEFINED)


def test_model_and_shard_mistakes_are_config_errors():
    # A user's model or shard is a setting the user gave: `except ConfigError` catches it, its code stays.
    assert issubclass(ModelError, ConfigError)
    assert type(error_from_code("model", "x")) is ModelError


def test_no_module_raises_the_base_class():
    # Callers catch by kind; a bare SplitInferError says nothing about what went wrong or who can fix it.
    import pathlib
    import re

    src = pathlib.Path(errors.__file__).parent
    offenders = [str(p.relative_to(src)) for p in src.rglob("*.py") if re.search(r"raise SplitInferError\(", p.read_text())]
    assert offenders == []
