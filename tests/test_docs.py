"""Runnable documentation: the shell, Python and TOML blocks of the README and docs/ run (or, for TOML, load
as a configuration file), so no example can rot.

Markers, on the line before a block:
  `<!-- doc-test: skip (why) -->`        left out, with its reason (every skip must say why);
  `<!-- doc-test: background (why) -->`  a long-running command (a server): started in the background, and the
                                         page's next block runs against it; both are one test;
  `<!-- deploy: STEP -->`                docs/deploy.md's steps, which tests/test_deploy_guide.py runs in order.

Blocks that use the shipped model (`shards/smollm2`) run in the slow set on a prepared copy whose local
shard carries the public-weights acknowledgement, as `splitinfer prepare --allow-public-weights` (the
documented way to make the demo shards) leaves it. Blocks that talk to ws://127.0.0.1:8765 get a cloud
server of it on a free port; a background `serve` or `api` gets free ports, which its next block is told.

The fast set (`make test`) still fails when a documented command would be refused: every `splitinfer`
command line in every block, skipped or not, must parse with the CLI's own parser, and every client command
on the demo shards must pass the public-weights gate the way the documented preparation leaves them.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from splitinfer.cli import build_parser
from splitinfer.configfile import apply_config

from listening import free_port, wait_for

ROOT = Path(__file__).parents[1]
PAGES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
BLOCK = re.compile(r"^(?:<!-- (doc-test: skip|doc-test: background|deploy: )([^\n]*)-->\n)?```(\w*)\n(.*?)^```",
                   re.S | re.M)
SHIPPED = "shards/smollm2"
SERVER = "127.0.0.1:8765"
API = "127.0.0.1:8000"
CLIENT_COMMANDS = ("generate", "chat", "api", "demo")
SHELL = ("", "bash", "sh")
NOT_RUN = ("text", "ini", "json")  # a diagram or sample output, a systemd unit (deploy's test), a message


def page_blocks(page: str):
    """(marker, reason, lang, body, line) of each block on a page."""
    text = (ROOT / page).read_text()
    for match in BLOCK.finditer(text):
        marker, reason, lang, body = match.groups()
        yield marker, (reason or "").strip(), lang, body, text[: match.start()].count("\n") + 1


def blocks():
    for page in PAGES:
        found = list(page_blocks(page))
        after_background = False
        for i, (marker, _, lang, body, line) in enumerate(found):
            if after_background or marker in ("doc-test: skip", "deploy: ") or lang in NOT_RUN:
                after_background = False
                continue
            then = None
            if marker == "doc-test: background":
                assert i + 1 < len(found), f"{page}:{line}: a background block needs a block after it"
                then = found[i + 1][2:4]
                after_background = True
            slow = [pytest.mark.slow] if SHIPPED in body or (then and SHIPPED in then[1]) else []
            yield pytest.param(lang, body, then, id=f"{page}:{line}", marks=slow)


def test_pages_have_blocks_to_run_and_every_skip_says_why():
    assert len(list(blocks())) >= 3
    for page in PAGES:
        for marker, reason, *_ in page_blocks(page):
            if marker and marker.startswith("doc-test"):
                assert reason.startswith("(") and len(reason) > 4, f"{page}: a skipped or background block must say why"


# -- the fast check: every documented command is one the CLI takes --------------------------------
def command_lines(body: str) -> list[list[str]]:
    """The argv of each `splitinfer` command in a shell block (continuations joined, pipes and & split)."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        line = re.sub(r"^\s*ExecStart=", "", line)  # a systemd unit's command
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if words[:1] == ["sudo"] and words[1:2] == ["-u"]:
            words = words[3:]  # sudo -u USER COMMAND ...
        command: list[str] = []
        for word in [*words, ";"]:
            if word in (";", "&", "&&", "||", "|"):
                if command and (command[0] == "splitinfer" or command[0].endswith("/bin/splitinfer")):
                    out.append(command[1:])
                command = []
            else:
                command.append(word)
    return out


def documented_commands():
    for page in PAGES:
        for marker, _, lang, body, line in page_blocks(page):
            if lang in SHELL + ("ini",):  # ini: a systemd unit's ExecStart
                for argv in command_lines(body):
                    yield page, line, argv


def prepared_shards() -> dict[str, bool]:
    """Each shards directory the docs (and the Makefile, for the demo's) prepare or privatize, and whether
    every command that makes it records the public-weights acceptance."""
    made: dict[str, bool] = {}
    makefile = re.search(r"^\t.*splitinfer (prepare .*)$", (ROOT / "Makefile").read_text(), re.M)
    commands = [argv for _, _, argv in documented_commands() if argv[:1] == ["prepare"] or argv[:2] == ["privacy", "privatize"]]
    for argv in [*commands, *([shlex.split(makefile.group(1))] if makefile else [])]:
        out = argv[argv.index("--out") + 1].replace("$(SHARDS)", SHIPPED) if "--out" in argv else None
        if out:
            made[out] = made.get(out, True) and "--allow-public-weights" in argv
    return made


def test_every_documented_command_parses_and_passes_the_public_weights_gate():
    from splitinfer.local.client import check_local_weights
    from splitinfer.public_weights import RECORD

    parser = build_parser()
    made = prepared_shards()
    assert SHIPPED in made
    seen = 0
    for page, line, argv in documented_commands():
        seen += 1
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # argparse has printed why
            raise AssertionError(f"{page}:{line}: `splitinfer {' '.join(argv)}` is refused by the CLI") from exc
        shard = str(getattr(args, "shard", None) or getattr(args, "shards", None) or "")
        shards = shard.removesuffix("/local")
        if argv[0] in CLIENT_COMMANDS and shards in made and not getattr(args, "local_only", False):
            # the gate itself, on a stock manifest as the documented preparation leaves it
            manifest = {"files": {"weights.safetensors": "0" * 64}}
            if made[shards]:
                manifest[RECORD] = {"weights_sha256": "0" * 64}
            try:
                check_local_weights(manifest, getattr(args, "allow_public_weights", False))
            except Exception as exc:
                raise AssertionError(f"{page}:{line}: `splitinfer {' '.join(argv)}` would be refused: {exc}") from exc
    assert seen >= 10


# -- the blocks, run --------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def docs_shards(smollm2_shards, tmp_path_factory) -> Path:
    """The shipped model's shards as `prepare --allow-public-weights` leaves them: the weights are linked,
    not copied; only the local manifest is a file of its own."""
    from splitinfer.public_weights import acknowledge

    out = tmp_path_factory.mktemp("docs-shards")
    (out / "cloud").symlink_to(smollm2_shards / "cloud", target_is_directory=True)
    (out / "local").mkdir()
    for entry in (smollm2_shards / "local").iterdir():
        if entry.name == "manifest.json":
            shutil.copy(entry, out / "local" / entry.name)
        else:
            (out / "local" / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    acknowledge(out / "local", "tests/test_docs.py")
    return out


@pytest.fixture
def cloud_url(request):
    """ws://... of a cloud server of the shipped model, started only for blocks that need one."""
    from splitinfer.cloud.server import ServerThread
    from splitinfer.model.shards import load_cloud

    shards = request.getfixturevalue("docs_shards")
    with ServerThread(load_cloud(shards / "cloud")) as server:
        yield server.url


def argv_for(lang: str, body: str) -> list[str]:
    return [sys.executable, "-c", body] if lang == "python" else ["bash", "-euo", "pipefail", "-c", body]


def run_block(lang: str, body: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv_for(lang, body), cwd=cwd, env=block_env(), capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)


def block_env() -> dict:
    """The test's own interpreter and package first (this checkout's src/, whatever is installed)."""
    import splitinfer

    package = str(Path(splitinfer.__file__).parents[1])
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                PYTHONPATH=os.pathsep.join([package, *filter(None, [os.environ.get("PYTHONPATH")])]))


def localize(body: str, request, ports: dict[str, str]) -> str:
    if SHIPPED in body:
        body = body.replace(SHIPPED, str(request.getfixturevalue("docs_shards")))
    for old, new in ports.items():
        body = body.replace(old, new)
    if f"ws://{SERVER}" in body:
        body = body.replace(f"ws://{SERVER}", request.getfixturevalue("cloud_url"))
    return body


def background_ports(body: str) -> tuple[dict[str, str], int]:
    """Free ports for a background block's server, as replacements for it and its next block, and the port
    to wait for."""
    if re.search(r"\bsplitinfer serve\b", body):
        port = free_port()
        return {"--port 8765": f"--port {port}", SERVER: f"127.0.0.1:{port}"}, port
    assert re.search(r"\bsplitinfer api\b", body), "a background block runs `splitinfer serve` or `splitinfer api`"
    port = free_port()
    return {"splitinfer api": f"splitinfer api --port {port}", API: f"127.0.0.1:{port}"}, port


@pytest.mark.parametrize("lang, body, then", list(blocks()))
def test_the_block_runs(lang, body, then, tmp_path, request):
    if lang == "toml":  # a configuration file: every table and key must be one the CLI knows
        path = tmp_path / "splitinfer.toml"
        path.write_text(body)
        apply_config(build_parser(), ["--config", str(path), "config", "show"], {})
        return
    assert lang in (*SHELL, "python"), lang
    if then is None:
        done = run_block(lang, localize(body, request, {}), tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        return
    ports, port = background_ports(body)
    log = tmp_path / "background.log"
    with open(log, "w") as sink:
        server = subprocess.Popen(argv_for(lang, "exec " + localize(body, request, ports).strip()), cwd=tmp_path,
                                  env=block_env(), stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for(port, server, log)
        next_lang, next_body = then
        done = run_block(next_lang, localize(next_body, request, ports), tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_every_link_resolves_and_the_configuration_reference_is_current():
    for script, args in (("check_links.py", ()), ("config_reference.py", ("--check",))):
        done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout[-3000:]


def test_every_user_page_is_a_guide_under_400_lines():
    """The README and docs/ are what a user reads; history, raw tables and every run in full live in notes/."""
    long = [f"{page}: {n} lines" for page in PAGES if (n := len((ROOT / page).read_text().splitlines())) >= 400]
    assert not long, "pages of 400 lines or more; move the record to notes/ (or, for a generated page, split it):\n" + \
        "\n".join(long)
