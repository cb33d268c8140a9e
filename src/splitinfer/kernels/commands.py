"""`splitinfer kernels`: build (once per install) or load the CPU kernels now, and say what runs here.

For a machine's set-up step (an image build, a deploy script) so that no later start waits for the build,
and for the question "which kernels does this machine run, and why not the others". No torch at import.
"""

from __future__ import annotations

import argparse
import json
import logging


def cmd_kernels(args: argparse.Namespace) -> int:
    from . import build

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build.ensure()
    status = build.status()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"library: {'loaded' if status['loaded'] else 'not loaded'} ({status['reason']})")
    print(f"cache:   {status['cache']}")
    if status["missing_cpu_flags"]:
        print(f"this CPU lacks: {', '.join(status['missing_cpu_flags'])}")
    print(f"chosen:  {status['chosen']} ({build.ENV})")
    width = max(map(len, status["kernels"]))
    for name, runs in status["kernels"].items():
        print(f"  {name:<{width}}  {runs:<40}  {build.KERNELS[name][0]}")
    return 0


def register(subparsers) -> None:
    s = subparsers.add_parser("kernels", help="build or load splitinfer's CPU kernels now and show which run here")
    s.add_argument("--json", action="store_true", help="print the status as JSON")
    s.set_defaults(func=cmd_kernels)
