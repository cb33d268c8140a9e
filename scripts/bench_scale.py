"""Decode steps/s of `serve --tp N` and of `serve --ray --replicas R` against a plain `serve` on the same
shards, every output compared with the plain server's.

    PYTHONPATH=src python scripts/bench_scale.py shards/smollm2 --tp 3 --sessions 4 --tokens 16
    PYTHONPATH=src python scripts/bench_scale.py shards/smollm2 --ray 2 --sessions 16 --tokens 24 --rtt-ms 80

Each server runs as its own child process(es) on loopback, every server process (rank, replica) with one
torch thread; with --tp the plain server also runs with N threads (the cores the N ranks use). With
--rtt-ms every server URL is reached through its own `splitinfer wan` proxy. The clients are threads of
this process, one session each (sequential decoding, float32 wire), all started together after one
warm-up generation. A tool for one machine, not a benchmark sweep: say how loaded the machine was next
to any figure it prints. `--ray` needs the ray extra.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from splitinfer.launch import cloud_server, free_port, wan_proxy
from splitinfer.clients import open_client
from splitinfer.local.session import ClientConfig

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shards", type=Path)
    parser.add_argument("--tp", type=int, help="also run serve --threads N and serve --tp N")
    parser.add_argument("--ray", type=int, help="also run serve --ray --replicas R")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    local = open_client(args.shards / "local", "ws://127.0.0.1:1", allow_public_weights=True, checks=False)
    prompts = [local.encode_prompt(TEXTS[i % len(TEXTS)]) for i in range(args.sessions)]
    configs = [("serve", plain_or_tp(args.shards, 1, []))]
    if args.tp:
        configs.append((f"serve --threads {args.tp}", plain_or_tp(args.shards, args.tp, [])))
        configs.append((f"serve --tp {args.tp}", plain_or_tp(args.shards, 1, ["--tp", str(args.tp)])))
    if args.ray:
        configs.append((f"serve --ray --replicas {args.ray}", ray_replicas(args.shards, args.ray)))
    runs = [run_config(servers, name, args.shards, prompts, args.tokens, args.rtt_ms) for name, servers in configs]
    report = {"rtt_ms": args.rtt_ms, "tokens": args.tokens,
              "identical_outputs": all(r["outputs"] == runs[0]["outputs"] for r in runs),
              "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
