"""`splitinfer bench` commands that time what surrounds a step: `wan` (the emulator's round trip against the one it
is told), `scale` (tensor-parallel and replicated servers against one), `detok` (streamed detokenization by
reply length), `drafting` (a tree's drafting cost, replayed without a model) and `project` (a stored run's
strategies projected to a GPU cloud, or the paper's configuration from measured parts).

Parsing only: each command's work lives in its own module (wan.py, scale.py, detok.py, drafting.py,
projection.py), imported when the command runs, and writes its record through bench/harness.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..options import Opt, Shared, add_options, described
from .parsers import add_shards_and_out
from .step_commands import measured


@dataclass(frozen=True)
class WanBenchOptions:
    """The defaults of `splitinfer bench wan`."""

    rtt_ms: float = 80.0  # the round trip the emulator is told to add
    size: int = 2048  # bytes a message
    count: int = 50  # timed round trips a setting a round
    rounds: int = 3  # rounds, every setting once a round


@dataclass(frozen=True)
class ScaleBenchOptions:
    """The defaults of `splitinfer bench scale`."""

    tp: int = 0  # also run serve --threads N and serve --tp N (0: neither)
    ray: int = 0  # also run serve --ray --replicas R (0: no; needs the ray extra)
    sessions: int = 4  # concurrent client sessions, one thread each
    tokens: int = 16  # new tokens a session
    rtt_ms: float = 0.0  # added round trip to every server (0: none)
    name: str = "scale"  # the run's file name: OUT/NAME.json and OUT/NAME.md


@dataclass(frozen=True)
class DetokBenchOptions:
    """The defaults of `splitinfer bench detok`."""

    runs: str = "notes/bench/readme/speculative.json"  # a stored bench spec run, whose replies are streamed
    tokens: int = 4096  # reply length, tokens
    window: int = 512  # tokens a reported window


@dataclass(frozen=True)
class DraftingBenchOptions:
    """The defaults of `splitinfer bench drafting`."""

    repeats: int = 3  # passes over the replies, each warm and cold


@dataclass(frozen=True)
class ProjectOptions:
    """The defaults of `splitinfer bench project`."""

    cloud_ms: str = "0,1,3,10"  # assumed GPU cloud step costs, comma-separated
    shards: str = "shards/smollm2"  # the prepared shards (for the weights floor)
    bandwidth_gbs: float = 4800.0  # the GPU's memory bandwidth, GB/s
    paper: bool = False  # the paper's configuration (mistral-7b-v0.1, 2 + 2) instead
    paper_rtts: str = "20,50,80,150"  # with --paper: round trips, ms
    trusted: str = ""  # with --paper: `bench trusted-half`'s trusted-half.json (default: the bytes bound)
    device_step: str = ""  # with --paper: the GPU check's device-step.json, the measured cloud step (default: a bound)
    cpu_step: str = "notes/bench/step/step.json"  # with --paper, no --trusted: a bench step run (its bandwidth: the bound)
    laptop_gbs: float = 60.0  # with --paper: a laptop's memory bandwidth, GB/s (an assumption, labelled)


def register(sub) -> None:
    s = sub.add_parser("wan", help="the WAN emulator's round trip against the one it is told, an echo server "
                       "behind `splitinfer wan` (optionally another tree's proxy, alternating)")
    add_options(s, Shared, (Opt("out", help="directory for wan.json and wan.md"),))
    add_options(s, WanBenchOptions, described(WanBenchOptions, *WanBenchOptions.__dataclass_fields__))
    s.add_argument("--other-src", help="another tree's src directory, whose proxy is timed alternately")
    s.set_defaults(func=measured("wan"))

    s = sub.add_parser("scale", help="decode steps/s of serve --tp N and serve --ray --replicas R against one serve, "
                       "outputs compared")
    add_shards_and_out(s, "NAME.json and NAME.md")
    add_options(s, ScaleBenchOptions, described(ScaleBenchOptions, *ScaleBenchOptions.__dataclass_fields__))
    s.set_defaults(func=measured("scale"))

    s = sub.add_parser("detok", help="streamed detokenization: time per token against reply length, DecodeStream "
                       "against decoding the whole reply")
    add_shards_and_out(s, "detok.json and detok.md")
    add_options(s, DetokBenchOptions, described(DetokBenchOptions, *DetokBenchOptions.__dataclass_fields__))
    s.set_defaults(func=measured("detok"))

    s = sub.add_parser("drafting", help="what drafting a tree costs a step, stored generations replayed without a "
                       "model (warm and cold caches)")
    s.add_argument("--replies", required=True, help="a bench spec speculative.json, or a replay.json it left")
    add_options(s, Shared, (Opt("out", help="directory for drafting.json, drafting.md and replay.json"),))
    add_options(s, DraftingBenchOptions, described(DraftingBenchOptions, "repeats"))
    s.set_defaults(func=measured("drafting"))

    s = sub.add_parser("project", help="a projection, not a measurement: a stored bench spec run with a GPU cloud, "
                       "or (--paper) the paper's configuration from measured parts")
    s.add_argument("run", help="a bench spec speculative.json")
    add_options(s, Shared, (Opt("out", help="directory for projection.json and projection.md"),))
    add_options(s, ProjectOptions, described(ProjectOptions, *ProjectOptions.__dataclass_fields__))
    s.set_defaults(func=measured("projection"))
