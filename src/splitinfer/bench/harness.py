"""The one harness of the `splitinfer bench` commands: a timing loop and the writer of a stored run.

`timed` runs one call after untimed warm-up calls and returns the time of each repeat; `rounds` times
several calls round by round (every call once a round, after untimed warm-up rounds, the order turned by one
every round or shuffled), so the machine's drift falls on every call alike; `median_ms` and `paired_ratio`
reduce them. `write` stores a run as OUT/NAME.json (the record under the exact command and its provenance:
source commit, torch, CPU flags, threads, cores) and OUT/NAME.md (a title, the command, the provenance in
one line, then the body), the pair each stored run under notes/bench is.

It knows no model, no command and no shard; torch is imported only when `provenance` runs.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from pathlib import Path

Clock = Callable[[], float]


def timed(call: Callable[[], object], repeats: int, warmup: int = 1, clock: Clock = time.perf_counter) -> list[float]:
    """Seconds of each of `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start = clock()
        call()
        times.append(clock() - start)
    return times


def rounds(calls: Mapping[Hashable, Callable[[], object]], repeats: int, *, warmup: int = 1,
           shuffle: random.Random | None = None, before: Callable[[], object] | None = None,
           check: Callable[[dict], object] | None = None,
           clock: Clock = time.perf_counter) -> dict[Hashable, list[float]]:
    """{name: seconds of its call in each timed round}: `warmup` untimed rounds, then `repeats` timed ones, each
    running every call once, in an order turned by one every round (A B, B A, ... for two) or, given
    `shuffle`, shuffled by it. `before()` runs ahead of each call, untimed (e.g. flushing the caches);
    `check(outputs)` gets each round's {name: return value} (e.g. to compare them bit for bit)."""
    names = list(calls)
    times: dict[Hashable, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + repeats):
        if shuffle is not None:
            shuffle.shuffle(names)
        order = names if shuffle is not None else names[round_ % len(names):] + names[:round_ % len(names)]
        outputs = {}
        for name in order:
            if before is not None:
                before()
            start = clock()
            outputs[name] = calls[name]()
            if round_ >= warmup:
                times[name].append(clock() - start)
        if check is not None:
            check(outputs)
    return times


def median_ms(seconds: Iterable[float], digits: int = 3) -> float:
    return round(statistics.median(seconds) * 1e3, digits)


def paired_ratio(numerator: list[float], denominator: list[float], digits: int = 3) -> float:
    """The median over rounds of numerator / denominator, each pair from one round (drift cancels in it)."""
    return round(statistics.median(a / b for a, b in zip(numerator, denominator, strict=True)), digits)


def command_line(args) -> str:
    """The command that made a run, as it can be typed again (the CLI keeps its words in `args.argv`)."""
    argv = getattr(args, "argv", None)
    return "splitinfer " + shlex.join(argv) if argv is not None else shlex.join(["splitinfer", *sys.argv[1:]])


def cpu_flags() -> list[str]:
    """The CPU features the products' speed depends on (the same torch differs between CPUs of one kind)."""
    from .. import kernels

    return sorted(kernels.build.cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni"})


def provenance() -> dict:
    """What a run ran on: the source, the libraries, the CPU's flags and the threads and cores it had."""
    import torch

    from .. import __version__
    from .provenance import source_commit

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"splitinfer": __version__, "commit": source_commit(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "cpu_flags": cpu_flags(),
            "threads": torch.get_num_threads(), "cores": cores}


def provenance_line(p: Mapping) -> str:
    cores = p.get("cores")
    return (f"splitinfer {p['splitinfer']} at {p['commit'] or 'an unknown commit'}; torch {p['torch']}, Python "
            f"{p['python']}; {p['platform']}; CPU flags {' '.join(p['cpu_flags']) or 'none of note'}; "
            f"{p['threads']} torch thread(s) on {'core(s) ' + ','.join(map(str, cores)) if cores else 'any core'}.")


def write(out: Path, name: str, record: Mapping, body: list[str], *, title: str, command: str,
          log: Callable[[str], object] = print) -> str:
    """OUT/NAME.json ({command, provenance, **record}) and OUT/NAME.md (title, command, provenance, body); the
    Markdown, also given to `log`."""
    made = {"command": command, "provenance": provenance()}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({**made, **record}, indent=1) + "\n")
    text = "\n".join([f"# {title}", "", f"Command: `{command}`", "", provenance_line(made["provenance"]), "",
                      *body]).rstrip("\n") + "\n"
    (out / f"{name}.md").write_text(text)
    log(text)
    return text
