"""docs/deploy.md, followed on one machine: the GPU host on loopback (GPU_HOST=localhost, the CPU for
CUDA, free ports for 8765 and 8000), with the guide's own commands: the shipped model prepared, privatized
under a secret key, a self-signed certificate and a token, `serve` with TLS and the token, a config file,
`bench probe`, `api`, and the guide's openai client, whose reply is checked."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

GUIDE = Path(__file__).parents[1] / "docs" / "deploy.md"
STEP = re.compile(r"<!-- deploy: (\w+) -->\n```(\w*)\n(.*?)```", re.S)
# What differs on one machine without a GPU; everything else runs as written.
LOOPBACK = (("--device cuda --dtype bfloat16", "--device cpu --dtype float32"), ("cd ~/splitinfer", "cd splitinfer"))

pytestmark = pytest.mark.slow


def steps() -> dict[str, str]:
    return {name: body for name, _, body in STEP.findall(GUIDE.read_text())}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(port: int, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"nothing listens on {port}")


def on_loopback(text: str, serve_port: int, api_port: int) -> str:
    for old, new in LOOPBACK:
        text = text.replace(old, new)
    return text.replace("8765", str(serve_port)).replace("8000", str(api_port))


def test_the_deployment_guide_runs_on_loopback(tmp_path):
    guide = steps()
    assert list(guide) == ["env", "prepare", "privatize", "credentials", "serve", "config", "api", "client"]
    serve_port, api_port = free_port(), free_port()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    exports = on_loopback(guide["env"], serve_port, api_port).replace("gpu-host.example.com", "localhost")
    prefix = exports + "\n"

    def bash(name: str, background: bool = False):
        script = prefix + on_loopback(guide[name], serve_port, api_port)
        if background:
            return subprocess.Popen(["bash", "-ec", script], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                    stderr=open(tmp_path / f"{name}.log", "w"))
        done = subprocess.run(["bash", "-ec", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"
        return done

    for name in ("prepare", "privatize", "credentials"):
        bash(name)
    # The guide's scp, on one machine: the keyed cloud shard and the server's credentials, nothing else.
    host = tmp_path / "splitinfer"
    shutil.copytree(tmp_path / "shards" / "mymodel-keyed" / "cloud", host / "cloud")
    for name in ("token.txt", "server.pem", "server.key"):
        shutil.copy(tmp_path / name, host / name)
    serve = bash("serve", background=True)
    api = None
    try:
        wait_for(serve_port, serve)
        bash("config")
        *probe, start_api = on_loopback(guide["api"], serve_port, api_port).strip().splitlines()
        guide["probe"], guide["start_api"] = "\n".join(probe), start_api
        assert "round trip" in bash("probe").stdout.lower()
        api = bash("start_api", background=True)
        wait_for(api_port, api)
        client = on_loopback(guide["client"], serve_port, api_port)
        done = subprocess.run([sys.executable, "-c", client], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(done.stdout.split()) >= 3  # a reply of some words
    finally:
        for proc in (api, serve):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
