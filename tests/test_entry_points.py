"""One way to make a client: every entry point (the CLI commands, benchmarks, the privacy tools, scripts/) gets
its SplitClient from `splitinfer.clients.open_client` (which calls `SplitClient.remote` on the local half it loaded
and gated, for the remote kind; `SplitClient.connect` is the Python API's own), and a RemoteMiddle that runs steps from
`RemoteMiddle.for_shard` (issue 50). Checked on the source, so a new entry point cannot quietly grow a sixth way."""

from __future__ import annotations

import ast
from pathlib import Path

import splitinfer
from splitinfer import clients

PACKAGE = Path(splitinfer.__file__).parent
SCRIPTS = PACKAGE.parents[1] / "scripts"
FACTORY = "clients.py"  # the one module that calls SplitClient(...)
GONE = {"local_only_client", "open_local_only", "connect_client"}  # the old ways, removed


def constructions(source: str, module: str) -> list[str]:
    """'module:line what' for each direct SplitClient(...) or RemoteMiddle(...) call, SplitClient.connect or
    SplitClient.remote call, or use of a removed client maker in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("SplitClient", "RemoteMiddle"):
                found.append(f"{module}:{node.lineno} {func.id}(...)")
            if isinstance(func, ast.Attribute) and func.attr in ("connect", "remote") \
                    and isinstance(func.value, ast.Name) and func.value.id == "SplitClient":
                found.append(f"{module}:{node.lineno} SplitClient.{func.attr}")
        if isinstance(node, ast.Name) and node.id in GONE:
            found.append(f"{module}:{node.lineno} {node.id}")
        if isinstance(node, ast.alias) and node.name in GONE:
            found.append(f"{module}:? import {node.name}")
    return found


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text()
    for path in sorted(SCRIPTS.rglob("*.py")):
        yield "scripts/" + path.relative_to(SCRIPTS).as_posix(), path.read_text()


def test_every_entry_point_makes_its_client_with_the_one_factory():
    found = []
    for module, source in _sources():
        hits = constructions(source, module)
        if module == FACTORY:  # the factory builds in-process clients itself, remote ones by SplitClient.remote
            hits = [h for h in hits if "SplitClient(...)" not in h and "SplitClient.remote" not in h]
        if module == "local/client.py":  # the remote constructors, the one the factory calls among them
            hits = [h for h in hits if "SplitClient.connect" not in h and "SplitClient.remote" not in h]
        if module == "local/middle.py":
            hits = [h for h in hits if "RemoteMiddle(...)" not in h]
        found += hits
    assert not found, "make clients with splitinfer.clients.open_client and remote middles with " \
                      "RemoteMiddle.for_shard/prober: " + ", ".join(found)


def test_the_cli_commands_load_their_client_through_the_factory():
    from splitinfer.api import commands

    source = Path(commands.__file__).read_text()
    assert source.count("load_client(args") == 2  # api and chat
    assert "open_client(" in Path(clients.__file__).read_text().split("def load_client")[1]


def test_the_checker_finds_each_way_round_the_factory():
    source = (
        "from splitinfer.inprocess import local_only_client\n"
        "a = SplitClient(local, make)\n"
        "b = SplitClient.connect(shard, url)\n"
        "c = RemoteMiddle(url, fp, (1, 2), 8)\n"
        "d = RemoteMiddle.for_shard(url, manifest, 8)\n"
        "e = open_client(shard, url)\n"
        "f = SplitClient.remote(local, shard, url)\n"
    )
    assert constructions(source, "m") == [
        "m:? import local_only_client", "m:2 SplitClient(...)", "m:3 SplitClient.connect", "m:4 RemoteMiddle(...)",
        "m:7 SplitClient.remote",
    ]


def _imports(path: Path) -> set[str]:
    return {node.module or "" for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)}


def test_local_client_and_conversation_import_no_circle():
    """conversation.py reads a Backend (backend.py), never the client module; backend.py imports neither."""
    local = PACKAGE / "local"
    assert "client" not in _imports(local / "conversation.py")
    assert not {"client", "conversation"} & _imports(local / "backend.py")
    assert "conversation" in _imports(local / "client.py")
