"""Interfaces are types, not sniffed: decoding/, local/ and wire/ call no getattr/hasattr, and every
implementation of the Middle and Verifier Protocols offers each of their members."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import splitinfer
from splitinfer.decoding.verifier import OneAtATime, Verifier
from splitinfer.inprocess import InProcessMiddle
from splitinfer.local.failover import FailoverMiddle
from splitinfer.local.middle import RemoteMiddle
from splitinfer.local.session import SplitSession
from splitinfer.wire.transport import Middle

PACKAGE = Path(splitinfer.__file__).parent
TYPED = ("decoding", "local", "wire")
SNIFFERS = {"getattr", "hasattr"}


def sniffing(source: str, module: str) -> list[str]:
    """'module:line name' for each getattr/hasattr call in `source`."""
    return [
        f"{module}:{node.lineno} {node.func.id}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in SNIFFERS
    ]


def test_no_feature_sniffing_in_decoding_local_or_wire():
    found = []
    for package in TYPED:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            found += sniffing(path.read_text(), path.relative_to(PACKAGE).as_posix())
    assert not found, "getattr/hasattr (declare the member in a Protocol or config instead): " + ", ".join(found)


def test_the_checker_finds_getattr_and_hasattr():
    source = "a = getattr(x, 'post', None)\nif hasattr(x, 'y'):\n    pass\nz = x.getattr\n"
    assert sniffing(source, "m") == ["m:1 getattr", "m:2 hasattr"]


def _members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}
    return names


@pytest.mark.parametrize("cls", [RemoteMiddle, FailoverMiddle, InProcessMiddle])
def test_every_middle_offers_the_whole_protocol(cls):
    members = _members(Middle)
    assert {"open", "step", "post", "collect", "close", "head_layers", "sends_ahead"} <= members
    assert isinstance(cls.sends_ahead, bool)
    missing = [m for m in members if not hasattr(cls, m) and m not in cls.__init__.__code__.co_names]
    assert not missing, f"{cls.__name__} lacks {missing}"


@pytest.mark.parametrize("cls", [SplitSession, OneAtATime])
def test_every_verifier_offers_the_whole_protocol(cls):
    members = _members(Verifier)
    assert {"in_flight", "pinned", "send_block", "receive_block", "resolve", "settle", "features"} <= members
    assert not [m for m in members if not hasattr(cls, m)], cls.__name__
