"""Runnable documentation: the shell, Python and TOML blocks of the README and the user guides run (or,
for TOML, load as a configuration file), so no example can rot. A block preceded by
`<!-- doc-test: skip (why) -->` is left out, and so are docs/deploy.md's steps (`<!-- deploy: ... -->`),
which tests/test_deploy_guide.py runs in order. Blocks that use the shipped model run in the slow set on
a prepared copy; blocks that talk to ws://127.0.0.1:8765 get a cloud server of it on a free port."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from splitinfer.cli import build_parser
from splitinfer.configfile import apply_config

ROOT = Path(__file__).parents[1]
PAGES = ("README.md", "docs/quickstart.md", "docs/deploy.md", "docs/configuration.md", "docs/benchmarks.md",
         "docs/privacy.md", "docs/security.md")
BLOCK = re.compile(r"^(?:<!-- (doc-test: skip|deploy: )[^\n]*-->\n)?```(\w*)\n(.*?)^```", re.S | re.M)
SHIPPED = "shards/smollm2"
SERVER = "127.0.0.1:8765"


def blocks():
    for page in PAGES:
        text = (ROOT / page).read_text()
        for match in BLOCK.finditer(text):
            marker, lang, body = match.groups()
            if marker:
                continue
            line = text[: match.start()].count("\n") + 1
            slow = [pytest.mark.slow] if SHIPPED in body else []
            yield pytest.param(lang, body, id=f"{page}:{line}", marks=slow)


def test_pages_have_blocks_to_run_and_every_skip_says_why():
    params = list(blocks())
    assert len(params) >= 3
    for page in PAGES:
        for reason in re.findall(r"<!-- doc-test: skip(.*?)-->", (ROOT / page).read_text()):
            assert reason.strip().startswith("("), f"{page}: a skipped block must say why"


@pytest.fixture
def cloud_url(request):
    """ws://... of a cloud server of the shipped model, started only for blocks that need one."""
    from splitinfer.cloud.server import ServerThread
    from splitinfer.model.shards import load_cloud

    shards = request.getfixturevalue("smollm2_shards")
    with ServerThread(load_cloud(shards / "cloud")) as server:
        yield server.url


def run_block(lang: str, body: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    argv = [sys.executable, "-c", body] if lang == "python" else ["bash", "-euo", "pipefail", "-c", body]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("lang, body", list(blocks()))
def test_the_block_runs(lang, body, tmp_path, request):
    if lang == "toml":  # a configuration file: every table and key must be one the CLI knows
        path = tmp_path / "splitinfer.toml"
        path.write_text(body)
        apply_config(build_parser(), ["--config", str(path), "config", "show"], {})
        return
    assert lang in ("", "bash", "sh", "python"), lang
    if SHIPPED in body:
        body = body.replace(SHIPPED, str(request.getfixturevalue("smollm2_shards")))
    if SERVER in body:
        body = body.replace(f"ws://{SERVER}", request.getfixturevalue("cloud_url"))
    done = run_block(lang, body, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


def test_every_link_resolves_and_the_configuration_reference_is_current():
    for script, args in (("check_links.py", ()), ("config_reference.py", ("--check",))):
        done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout[-3000:]
