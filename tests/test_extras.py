"""Extras: a plain install pulls none of the optional packages, and each command that needs an extra names
it in one line before doing any work.

The fresh-venv test installs torch (the CPU wheel this machine holds) and the package without extras into
a new venv: one to three minutes here, so it is marked `slow` and runs in `make test-all` (CI); set
SPLITINFER_SKIP_INSTALL_TEST=1 to skip it there too.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from splitinfer.cli import main
from splitinfer.errors import ConfigError
from splitinfer.extras import API, AUDIT, BENCH, GGUF, GPU, RAY, require_extra

ROOT = Path(__file__).resolve().parents[1]
EXTRA_MODULES = sorted(set(API + AUDIT + BENCH + GGUF + GPU + RAY))


def test_require_extra_names_the_missing_modules_and_the_extra():
    require_extra("audit", AUDIT, "splitinfer privacy audit")  # the dev install has it
    with pytest.raises(ConfigError) as e:
        require_extra("audit", ("scipy", "no_such_module_x1"), "splitinfer privacy audit")
    assert str(e.value) == ("splitinfer privacy audit needs the audit extra (no_such_module_x1 is not installed): "
                            "pip install 'splitinfer[audit]'")


def test_the_checked_modules_are_the_extras_packages_and_dev_has_them_all():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(requirements):
        return {re.match(r"[A-Za-z0-9_.-]+", r).group().lower().replace("-", "_") for r in requirements}

    for extra, modules in (("api", API), ("audit", AUDIT), ("bench", BENCH), ("gguf", GGUF), ("gpu", GPU), ("ray", RAY)):
        assert names(extras[extra]) == set(modules), extra
        if extra not in ("gpu", "ray"):
            assert set(extras[extra]) <= set(extras["dev"]), f"dev lacks part of the {extra} extra"


def test_with_the_extra_installed_the_command_goes_past_the_check(tmp_path, capsys):
    assert main(["privacy", "audit", "--quick", "--shards", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "needs the audit extra" not in err and "is not a prepared model" in err  # it looked for the shards


def _commands(tmp: Path) -> list[tuple[list[str], str, str]]:
    """(argv, what the message names, extra) for every command that needs an extra."""
    none = str(tmp / "none")
    return [
        (["privacy", "audit", "--quick", "--shards", none, "--out", str(tmp / "audit")], "splitinfer privacy audit", "audit"),
        (["api", "--shard", none, "--server", "ws://127.0.0.1:9"], "splitinfer api", "api"),
        (["bench", "sweep", "--report-only", "--out", none], "splitinfer bench sweep", "bench"),
        (["prepare", "--out", none], "splitinfer prepare (reading a GGUF model; the default is one)", "gguf"),
        (["prepare", "--out", none, "--model", str(tmp / "m.gguf")],
         "splitinfer prepare (reading a GGUF model; the default is one)", "gguf"),
        (["serve", "--shard", none, "--devices", "cuda:0,cuda:1"], "splitinfer serve --devices", "gpu"),
        (["serve", "--shard", none, "--ray"], "splitinfer serve --ray", "ray"),
    ]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPLITINFER_SKIP_INSTALL_TEST") == "1", reason="SPLITINFER_SKIP_INSTALL_TEST=1")
def test_a_plain_install_names_the_extra_each_command_needs(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    torch = f"torch=={importlib.metadata.version('torch')}"  # the build this venv has, so pip finds it at hand
    # This venv's pip installs into the new one; no byte-compiling of torch's thousands of files.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-compile",
                    "--disable-pip-version-check", torch, "-e", str(ROOT)], check=True, timeout=900)
    probe = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m)))"
    found = subprocess.run([str(python), "-c", probe, *EXTRA_MODULES], check=True, capture_output=True, text=True)
    assert found.stdout.split() == [], "a plain install pulled packages of an extra"

    for argv, what, extra in _commands(tmp_path):
        run = subprocess.run([str(venv / "bin" / "splitinfer"), *argv], capture_output=True, text=True, timeout=300)
        expected = rf"splitinfer: error: {re.escape(what)} needs the {extra} extra \(.+ not installed\): " \
                   rf"pip install 'splitinfer\[{extra}\]'\n"
        assert run.returncode == 2 and re.fullmatch(expected, run.stderr), (argv, run.returncode, run.stderr)


def test_serve_ray_without_ray_names_the_extra(monkeypatch, capsys, tmp_path):
    import splitinfer.extras as extras

    monkeypatch.setattr(extras, "_installed", lambda module: module not in RAY)
    assert main(["serve", "--shard", str(tmp_path / "none"), "--ray"]) == 2
    assert capsys.readouterr().err == ("splitinfer: error: splitinfer serve --ray needs the ray extra (ray is not "
                                       "installed): pip install 'splitinfer[ray]'\n")
