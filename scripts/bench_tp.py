"""Decode steps/s of `serve --tp N` against a plain `serve` on the same shards, with outputs compared.

    PYTHONPATH=src python scripts/bench_tp.py shards/smollm2 --tp 3 --sessions 4 --tokens 16 --out tp.json

Each server runs as its own child process(es) on loopback (`launch.cloud_server`); the plain server is run
once with one torch thread and once with N threads (the cores the N ranks use), each rank of the tensor-
parallel server with one thread. The clients are threads of this process, one session each, all started
together after one warm-up generation; every output must equal the plain server's. A tool for one
machine, not a benchmark sweep: say how loaded the machine was next to any figure it prints.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from contextlib import nullcontext
from pathlib import Path

from splitinfer.launch import cloud_server, wan_proxy
from splitinfer.local.client import SplitClient
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


def run_config(shards: Path, name: str, threads: int, extra: list[str], prompts, tokens: int, rtt_ms: float) -> dict:
    config = ClientConfig(wire_dtype="float32")
    with cloud_server(shards / "cloud", threads=threads, extra=extra) as (url, _):
        with wan_proxy(url, rtt_ms) if rtt_ms else nullcontext(url) as reach:
            client = SplitClient.connect(shards / "local", reach, config, allow_public_weights=True)
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
    return {"config": name, "threads": threads, "sessions": len(prompts), "decode_steps": steps,
            "wall_s": round(wall, 3), "steps_per_s": round(steps / wall, 2),
            "outputs": [r.token_ids for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shards", type=Path)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    local = SplitClient.connect(args.shards / "local", "ws://127.0.0.1:1", allow_public_weights=True)
    prompts = [local.encode_prompt(TEXTS[i % len(TEXTS)]) for i in range(args.sessions)]
    runs = [
        run_config(args.shards, "serve", 1, [], prompts, args.tokens, args.rtt_ms),
        run_config(args.shards, f"serve --threads {args.tp}", args.tp, [], prompts, args.tokens, args.rtt_ms),
        run_config(args.shards, f"serve --tp {args.tp}", 1, ["--tp", str(args.tp)], prompts, args.tokens, args.rtt_ms),
    ]
    report = {"rtt_ms": args.rtt_ms, "tokens": args.tokens,
              "identical_outputs": all(r["outputs"] == runs[0]["outputs"] for r in runs),
              "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
