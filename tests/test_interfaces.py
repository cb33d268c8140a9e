"""Interfaces are types, not sniffed: decoding/, local/, wire/ and cloud/ call no getattr/hasattr, a model
config's optional fields are read in one place (hfconfig.py), and every implementation of the Middle and
Verifier Protocols offers each of their members."""

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
TYPED = ("decoding", "local", "wire", "cloud")
SNIFFERS = {"getattr", "hasattr"}


def sniffing(source: str, module: str) -> list[str]:
    """'module:line name' for each getattr/hasattr call in `source`."""
    return [
        f"{module}:{node.lineno} {node.func.id}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in SNIFFERS
    ]


def test_no_feature_sniffing_in_decoding_local_wire_or_cloud():
    found = []
    for package in TYPED:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            found += sniffing(path.read_text(), path.relative_to(PACKAGE).as_posix())
    assert not found, "getattr/hasattr (declare the member in a Protocol or config instead): " + ", ".join(found)


# The one place either side reads optional fields of a HF model config (eos ids, the context length).
CONFIG_READER = "hfconfig.py"


def dict_reads(source: str, module: str) -> list[str]:
    """'module:line' for each `.to_dict().get(...)`: a config field sniffed through its dict."""
    return [
        f"{module}:{node.lineno}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
        and isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Attribute)
        and node.func.value.func.attr == "to_dict"
    ]


def test_model_config_fields_are_read_in_one_place():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module != CONFIG_READER:
            found += dict_reads(path.read_text(), module)
    assert dict_reads((PACKAGE / CONFIG_READER).read_text(), CONFIG_READER), "the reader reads"
    assert not found, f".to_dict().get(...) reads (go through {CONFIG_READER}): " + ", ".join(found)
    assert dict_reads("a = config.to_dict().get('x')\nb = d.get('x')\n", "m") == ["m:1"]


def test_the_speculative_bench_reads_its_options_as_declared():
    """bench spec's options all come from SpecBenchOptions (bench/commands.py): none read with a default of its own."""
    source = (PACKAGE / "bench" / "speculative.py").read_text()
    assert not sniffing(source, "bench/speculative.py")


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
