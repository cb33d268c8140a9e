"""`splitinfer bench scale`: decode steps/s of `serve --tp N` and of `serve --ray --replicas R` against a plain
`serve` on the same shards, every output compared with the plain server's.

Each server runs as its own child process(es) on loopback, every server process (rank, replica) with one torch
thread; with --tp the plain server also runs with N threads (the cores the N ranks use). With --rtt-ms every
server URL is reached through its own `splitinfer wan` proxy. The clients are threads of this process, one
session each (sequential decoding, float32 wire), all started together after one warm-up generation. A tool for
one machine: say how loaded the machine was next to any figure it gives. `--ray` needs the ray extra.
Writes OUT/NAME.json and OUT/NAME.md (--name, default scale).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from ..clients import open_client
from ..launch import cloud_server, free_port, wan_proxy
from ..local.session import ClientConfig
from ..tables import table
from .harness import command_line, write

TEXTS = [
    "Explain in three sentences why the round trip dominates split inference over a WAN.",
    "Write a short poem about a lighthouse keeper.",
    "List five uses of a paperclip.",
    "What is the capital of France, and why is it famous?",
    "Summarise the plot of a detective story in two sentences.",
    "Give three tips for learning a new language.",
    "Describe the water cycle to a child.",
    "Why is the sky blue?",
]


@contextmanager
def plain_or_tp(shards: Path, threads: int, extra: list[str]):
    with cloud_server(shards / "cloud", threads=threads, extra=extra) as (url, _):
        yield [url]


@contextmanager
def ray_replicas(shards: Path, replicas: int):
    """`serve --ray --replicas R` as a child; yields the replica URLs it prints."""
    command = [sys.executable, "-m", "splitinfer", "serve", "--shard", str(shards / "cloud"), "--ray",
               "--replicas", str(replicas), "--port", str(free_port()), "--threads", "1"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("replicas:"):
                yield line.split()[2::2]
                break
        else:
            raise RuntimeError(f"serve --ray exited with {proc.wait()} before printing its replicas")
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def run_config(servers, name: str, shards: Path, prompts, tokens: int, rtt_ms: float) -> dict:
    config = ClientConfig(wire_dtype="float32")
    with servers as urls, ExitStack() as proxies:
        reach = [proxies.enter_context(wan_proxy(url, rtt_ms)) if rtt_ms else url for url in urls]
        client = open_client(shards / "local", reach, config, allow_public_weights=True, checks=False)
        client.generate(prompts[0], max_new_tokens=4, stop_ids=set(), strategy="sequential")  # warm-up
        results: list = [None] * len(prompts)

        def one(i):
            results[i] = client.generate(prompts[i], max_new_tokens=tokens, stop_ids=set(), strategy="sequential")

        workers = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - start
    steps = sum(sum(1 for s in r.steps if s["kind"] == "decode") for r in results)
    return {"config": name, "servers": len(urls), "sessions": len(prompts), "decode_steps": steps,
            "wall_s": round(wall, 3), "steps_per_s": round(steps / wall, 2),
            "outputs": [r.token_ids for r in results]}


def run(args, log=print) -> dict:
    shards = Path(args.shards)
    local = open_client(shards / "local", "ws://127.0.0.1:1", allow_public_weights=True, checks=False)
    prompts = [local.encode_prompt(TEXTS[i % len(TEXTS)]) for i in range(args.sessions)]
    configs = [("serve", plain_or_tp(shards, 1, []))]
    if args.tp:
        configs.append((f"serve --threads {args.tp}", plain_or_tp(shards, args.tp, [])))
        configs.append((f"serve --tp {args.tp}", plain_or_tp(shards, 1, ["--tp", str(args.tp)])))
    if args.ray:
        configs.append((f"serve --ray --replicas {args.ray}", ray_replicas(shards, args.ray)))
    runs = [run_config(servers, name, shards, prompts, args.tokens, args.rtt_ms) for name, servers in configs]
    report = {"rtt_ms": args.rtt_ms, "tokens": args.tokens,
              "identical_outputs": all(r["outputs"] == runs[0]["outputs"] for r in runs),
              "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]}
    body = [f"{args.sessions} concurrent sessions of {args.tokens} tokens each, sequential decoding, float32 wire, "
            f"{args.rtt_ms:g} ms added round trip; every output identical to plain serve's: "
            f"{report['identical_outputs']}.", "",
            *table(["server", "processes", "sessions", "decode steps", "wall s", "steps/s"],
                   [[r["config"], r["servers"], r["sessions"], r["decode_steps"], r["wall_s"], r["steps_per_s"]]
                    for r in report["runs"]])]
    write(Path(args.out), args.name, report, body, title="Decode steps/s: tensor parallel and replicas against "
          "one server", command=command_line(args), log=log)
    return report
