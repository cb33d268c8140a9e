"""`splitinfer bench plain-split`: splitinfer's split sequential against a plain transformers split, in one run.

Both split the same shards the same way (k local head layers, the middle on a server, m local tail layers,
norm and LM head), send the same messages through the project's wire codec over a WebSocket, each through
its own `splitinfer wan` emulator at the same added round trip, and decode greedily one token a round
trip. splitinfer runs its own code on both sides (`splitinfer serve`, SplitClient with sequential
decoding); the anchor runs transformers on both sides (bench/plaincloud.py: its own `DynamicCache`,
masks, `F.linear`, sdpa, no splitinfer model code), its cloud half a separate server process with its own
cache, as splitinfer's is. Fairness as in `bench spec`: this process (both clients) pinned to core 0 with
one torch thread, both servers and the emulators on core 1 with one thread each; the two run back to back
on every prompt, in alternating order, after a warm-up each.

Checked in the same run: the plain split's tokens against transformers greedy decoding of the whole model
(the same weights in one process; identical with a float32 wire, and with a float16 wire as long as the
rounding at the two cuts never flips a token), splitinfer's against the plain split's, and that both cost
the same round trips and bytes per decode step.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..options import Opt, add_options
from ..tables import table
from ..telemetry import median, step_summary
from ..wire.dtypes import DTYPE_NAMES
from .parsers import add_shards_and_out, reporting

IMPLS = ("splitinfer", "transformers")


@dataclass(frozen=True)
class PlainSplitOptions:
    """The defaults of `splitinfer bench plain-split`."""

    rtt_ms: str = "0,80"  # comma-separated added round trips
    max_new_tokens: int = 128  # tokens per generation (fewer when the model stops)
    repeats: int = 1  # measured repetitions after the warm-up
    per_category: int = 3  # prompts taken from each category


@contextmanager
def plain_cloud_server(shard: Path, cpu: int | None, threads: int):
    """Yields the ws:// URL of a plain transformers cloud process (bench/plaincloud.py) on a loopback port."""
    from ..launch import free_port, listening_child

    port = free_port()
    with listening_child(["--shard", str(shard), "--port", str(port)], port, cpu, threads,
                         module="splitinfer.bench.plaincloud"):
        yield f"ws://127.0.0.1:{port}"


def record(impl: str, rtt: float, rep: int, p: dict, tokens: list[int], stats: dict, steps: list[dict]) -> dict:
    """One generation: tokens, rate, and medians over its decode steps of what a step is made of."""
    decode = [s for s in steps if s["kind"] == "decode"]
    n = len(tokens)
    parts = step_summary(steps, ("bytes", "round_trip", "cloud_compute", "local_compute", "serialize"),
                         lambda values: median(values, 3))
    return {
        "impl": impl, "rtt_ms": rtt, "repeat": rep, "prompt_id": p["id"], "category": p["category"],
        "token_ids": tokens, "tokens_per_s": stats["tokens_per_s"], "decode_s": stats["decode_s"],
        "ms_per_token": round(stats["decode_s"] * 1e3 / max(n - 1, 1), 3), "decode_steps": len(decode),
        "round_trips": len(decode) + stats["prefill_messages"],
        "bytes_per_step": parts["bytes"],
        "median_ms": {"round_trip": parts["round_trip"], "cloud_compute": parts["cloud_compute"],
                      "local": parts["local_compute"], "serialize": parts["serialize"]},
    }


def measure(args, shards: Path, prompts: list[dict], rtts: list[float], log) -> tuple[list[dict], list[dict], str]:
    """(runs, transformers greedy references, wire dtype): both splits on every prompt at every round trip."""
    from .plaincloud import PlainSplitClient
    from ..clients import open_client
    from ..launch import cloud_server, pin_self, wan_proxy
    from ..local.session import ClientConfig
    from ..model.shards import load_whole_hf
    from .anchors import greedy_transformers

    pin_self(0)
    runs, references = [], []
    with ExitStack() as stack:
        servers = {"splitinfer": stack.enter_context(cloud_server(shards / "cloud", cpu=1, threads=1))[0],
                   "transformers": stack.enter_context(plain_cloud_server(shards / "cloud", 1, 1))}
        urls = {(impl, rtt): url if rtt == 0 else stack.enter_context(wan_proxy(url, rtt, cpu=1))
                for impl, url in servers.items() for rtt in rtts}
        ours = {rtt: open_client(shard=shards / "local", server=urls[("splitinfer", rtt)], allow_public_weights=True,
                                 config=ClientConfig(wire_dtype=args.wire_dtype)) for rtt in rtts}
        wire = next(iter(ours.values())).config.wire_dtype  # the shard's unless --wire-dtype
        plain = {rtt: PlainSplitClient(shards / "local", urls[("transformers", rtt)], wire) for rtt in rtts}
        whole = load_whole_hf(shards)
        some = next(iter(ours.values()))
        stops = some.stop_ids()

        def one(impl: str, rtt: float, ids: list[int], n: int) -> tuple[list[int], dict, list[dict]]:
            if impl == "splitinfer":
                g = ours[rtt].generate(ids, n, strategy="sequential", stop_ids=stops)
                return g.token_ids, g.stats, g.steps
            g = plain[rtt].generate(ids, n, stops)
            return g["token_ids"], g["stats"], g["steps"]

        ids = {p["id"]: some.encode_prompt(p["prompt"], p.get("chat", True)) for p in prompts}
        for impl in IMPLS:  # warm-up: first calls allocate buffers and connect
            for rtt in rtts:
                one(impl, rtt, ids[prompts[0]["id"]], 8)
        for rep in range(args.repeats):
            for i, p in enumerate(prompts):
                for rtt in rtts:
                    for impl in (IMPLS if (rep + i) % 2 == 0 else IMPLS[::-1]):
                        runs.append(record(impl, rtt, rep, p, *one(impl, rtt, ids[p["id"]], args.max_new_tokens)))
                        log(f"[{rep}] {impl:<12} @{rtt:>4g} ms {p['id']:<16} {runs[-1]['tokens_per_s']:7.2f} tok/s")
        for p in prompts:  # untimed: the whole model in one process, as many tokens as the plain split made
            n = len(next(r for r in runs if r["prompt_id"] == p["id"] and r["impl"] == "transformers")["token_ids"])
            references.append({"prompt_id": p["id"], "token_ids": greedy_transformers(whole, ids[p["id"]], n)[0]})
    return runs, references, wire


def summarize(runs: list[dict], references: list[dict], rtts: list[float]) -> list[dict]:
    """Per round trip and implementation: whole-set rate, medians of the step's parts; paired ratio; checks."""
    greedy = {r["prompt_id"]: r["token_ids"] for r in references}
    rows = []
    for rtt in rtts:
        at = {impl: [r for r in runs if r["rtt_ms"] == rtt and r["impl"] == impl] for impl in IMPLS}
        pairs = [(a, b) for a in at["splitinfer"] for b in at["transformers"]
                 if (a["repeat"], a["prompt_id"]) == (b["repeat"], b["prompt_id"])]
        for impl, rs in at.items():
            tokens = sum(len(r["token_ids"]) - 1 for r in rs)
            seconds = sum(r["decode_s"] for r in rs)
            rows.append({
                "rtt_ms": rtt, "impl": impl, "generations": len(rs),
                "tokens_per_s": round(tokens / seconds, 3) if seconds else 0.0,
                "ms_per_token": round(seconds * 1e3 / tokens, 2) if tokens else 0.0,
                "median_ms": {f: round(statistics.median(r["median_ms"][f] for r in rs), 2)
                              for f in rs[0]["median_ms"]},
                "bytes_per_step": statistics.median(r["bytes_per_step"] for r in rs),
                "round_trips": sum(r["round_trips"] for r in rs),
                "identical_to_greedy": sum(r["token_ids"] == greedy[r["prompt_id"]] for r in rs),
            })
        rows[-2]["x_transformers_paired"] = round(statistics.median(
            a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs if b["tokens_per_s"]), 3) if pairs else None
        rows[-2]["identical_to_plain_split"] = sum(a["token_ids"] == b["token_ids"] for a, b in pairs)
    return rows


def markdown(report: dict) -> str:
    lines = ["# Split sequential: splitinfer against a plain transformers split behind the same emulator", "",
             f"`{report['command']}`", "", report["setup"], ""]
    header = ["RTT ms", "split", "tok/s, whole set", "x plain (median pair)", "ms/token", "round trip", "cloud compute",
              "local", "serialize", "bytes/step", "round trips", "= greedy", "= plain split"]
    body = [[r["rtt_ms"], r["impl"], r["tokens_per_s"], f"{r['x_transformers_paired']}x" if "x_transformers_paired" in r
             else "-", r["ms_per_token"], *r["median_ms"].values(), r["bytes_per_step"], r["round_trips"],
             f"{r['identical_to_greedy']}/{r['generations']}",
             f"{r['identical_to_plain_split']}/{r['generations']}" if "identical_to_plain_split" in r else "-"]
            for r in report["summary"]]
    lines += table(header, body, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines += ["", "Step parts are medians over generations of each generation's median decode step, ms. \"= greedy\": "
              "generations token-identical to transformers greedy decoding of the whole model in one process (the "
              "same number of tokens); \"= plain split\": splitinfer's generations identical to the plain split's on "
              "the same prompt and repetition. \"x plain\": median over prompts of splitinfer's tok/s over the plain "
              "split's in the same repetition."]
    return "\n".join(lines) + "\n"


def run(args, log=print) -> dict:
    import torch

    from .. import __version__
    from .runtime import load_prompts

    shards = Path(args.shards)
    if not (shards / "local" / "manifest.json").exists():
        raise ConfigError(f"{shards} holds no prepared shards; run `splitinfer prepare --out {shards}` first.")
    rtts = [float(x) for x in str(args.rtt_ms).split(",") if x.strip()]
    if not rtts or any(r < 0 for r in rtts):
        raise ConfigError(f"--rtt-ms takes comma-separated round trips >= 0, e.g. 0,80; got {args.rtt_ms!r}.")
    prompts = load_prompts(args.prompts, args.per_category)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs, references, wire = measure(args, shards, prompts, rtts, log)
    report = {
        "command": "splitinfer bench plain-split " + shlex.join(sys.argv[3:]), "splitinfer": __version__,
        "torch": torch.__version__, "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "setup": f"Both clients: this process, core 0, 1 thread; both cloud servers (`splitinfer serve`; the plain "
                 f"transformers server, bench/plaincloud.py) child processes on core 1, 1 thread each; one WAN "
                 f"emulator per server and round trip, on core 1; {wire} wire; sequential greedy decoding, "
                 f"{args.max_new_tokens} new tokens at most, {len(prompts)} prompts x {args.repeats} repetition(s), "
                 "the two splits back to back on each prompt in alternating order.",
        "model": json.loads((shards / "local" / "manifest.json").read_text())["model_id"],
        "wire_dtype": wire, "rtts_ms": rtts, "prompts": [p["id"] for p in prompts],
        "summary": summarize(runs, references, rtts), "references": references, "runs": runs,
    }
    (out / "plainsplit.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "plainsplit.md").write_text(markdown(report))
    log(markdown(report))
    return report


def register(sub) -> None:
    s = sub.add_parser("plain-split", help="split sequential: splitinfer against a plain transformers split of the "
                       "same layers behind the same emulator, in one run")
    add_shards_and_out(s, "plainsplit.json and plainsplit.md")
    s.add_argument("--prompts", help="JSONL prompt file, or mt-bench (default: the packaged benchmark prompts)")
    add_options(s, PlainSplitOptions, (
        Opt("rtt_ms", help="comma-separated added round trips"),
        Opt("max_new_tokens", help="tokens per generation"),
        Opt("repeats", help="measured repetitions after a warm-up"),
        Opt("per_category", help="prompts taken from each category"),
    ))
    s.add_argument("--wire-dtype", choices=DTYPE_NAMES, help="dtype of hidden states on the wire (default: the "
                   "shard's)")
    s.set_defaults(func=reporting(run))
