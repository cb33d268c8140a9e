"""`splitinfer bench batch`: what batching concurrent sessions buys the cloud, and what clients see.

Two parts, reported separately because they measure different things:

1. Cloud side, in-process (no clients competing for the CPU): the middle layers of the shard, B sessions
   with different context lengths, B single-token decode steps run as one batched pass vs the same steps
   one at a time; then mixed block sizes cut into passes by the scheduler's own grouping rule; then what
   the scheduler, an executor and a server on loopback cost a lone session (bench/lone.py). Inputs are
   random hidden states (compute time does not depend on values). This process is pinned to one core
   with `--threads` torch threads.
2. End to end: a `splitinfer serve` child (pinned to core 1, one thread) behind a `splitinfer wan`
   proxy adding the round trip, and N concurrent sequential-decoding clients as threads of this process
   (pinned to core 0, one thread), served batched and one session at a time (`--max-batch 1`). On a
   2-core machine the clients share one core, so these figures are bounded by the clients' own compute.

Writes OUT/batching.json and OUT/batching.md. Nothing heavy is imported until the command runs.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..options import Opt, Shared, add_options, described
from ..tables import left_table
from ..telemetry import median
from ..wire.dtypes import DTYPE_NAMES
from .harness import median_ms, rounds
from .lone import lone_session, markdown as lone_markdown
from .parsers import add_shards_and_out, floats
from .stepping import SteppedSessions


def _ints(text: str, name: str) -> list[int]:
    values = [int(x) for x in floats(text, name)]
    if not all(values) or values != [float(x) for x in text.split(",") if x.strip()]:
        raise ConfigError(f"{name} must be comma-separated integers, all >= 1, e.g. 1,4,16; got {text!r}.")
    return values


def _compared(batched, alone, repeats: int) -> dict:
    """Median ms of the same steps batched and one at a time, interleaved round by round after a warm-up
    round (bench/harness.py), so drift on a shared machine hits both alike; each call makes its steps too."""
    times = rounds({"batched": batched, "alone": alone}, repeats)
    return {"batched_ms": median_ms(times["batched"]), "one_at_a_time_ms": median_ms(times["alone"])}


def cloud_side(half, sizes: list[int], context: int, repeats: int) -> dict:
    from ..cloud.scheduler import BatchConfig, plan_groups

    sessions = SteppedSessions(half, max(sizes), context)
    rows = []
    for b in sizes:
        idx = list(range(b))
        rows.append({"kind": "decode", "batch": b, "block_rows": [1] * b,
                     **_compared(lambda: sessions.batched(idx, [1] * b), lambda: sessions.one_at_a_time(idx, [1] * b),
                                 repeats)})
    config = BatchConfig()
    for mix in ([1, 4, 8, 16], [1, 1, 1, 1, 8, 8, 8, 8], [1] * 12 + [32] * 4):
        if len(mix) > max(sizes):
            continue
        idx = list(range(len(mix)))
        groups = plan_groups(mix, config)

        def grouped():
            for g in groups:
                sessions.batched([idx[i] for i in g], [mix[i] for i in g])

        rows.append({"kind": "mixed", "batch": len(mix), "block_rows": mix, "passes": len(groups),
                     **_compared(grouped, lambda: sessions.one_at_a_time(idx, mix), repeats)})
    one = next(r["batched_ms"] for r in rows if r["kind"] == "decode" and r["batch"] == 1)
    for r in rows:
        r["batched_vs_one_step"] = round(r["batched_ms"] / one, 3)
        r["speedup_vs_one_at_a_time"] = round(r["one_at_a_time_ms"] / r["batched_ms"], 3)
        r["steps_per_s_batched"] = round(r["batch"] / r["batched_ms"] * 1e3, 1)
        r["steps_per_s_one_at_a_time"] = round(r["batch"] / r["one_at_a_time_ms"] * 1e3, 1)

    # A lone session called directly, through the scheduler, a one-thread executor and a server on loopback.
    return {"rows": rows, "lone_session": lone_session(half, context, max(20, repeats * 4), server=True)}


def _replay(middle, hidden_size: int, context: int, steps: int, latencies: list[float], start=None) -> None:
    """A client with no model: prefill `context` random rows, wait at `start`, then `steps` one-row steps."""
    import torch

    from ..masks import BlockStructure
    from ..wire.messages import Step

    middle.open()
    middle.step(Step(0, (), tuple(range(context)), BlockStructure.chain(), torch.randn(context, hidden_size), "float16"))
    keep = tuple(range(context))
    if start is not None:
        start.wait()
    for i in range(steps):
        t0 = time.perf_counter()
        middle.step(Step(i + 1, keep, (context + i,), BlockStructure.chain(), torch.randn(1, hidden_size), "float16"))
        latencies.append((time.perf_counter() - t0) * 1e3)
        keep = (0,)
    middle.close()


# The server's two ways of running steps the end-to-end parts compare: batched, and one session at a time.
SERVER_MODES = (("batched", ()), ("one_at_a_time", ("--max-batch", "1")))


@contextmanager
def _served(shards: Path, extra: tuple[str, ...], rtt_ms: float):
    """A `serve` child (one core, one thread; `extra` its options) behind a `wan` child adding `rtt_ms`: yields
    the URL clients connect to."""
    from ..launch import cloud_server, wan_proxy

    with cloud_server(shards / "cloud", cpu=1, threads=1, extra=extra) as (url, _), wan_proxy(url, rtt_ms, cpu=1) as wan:
        yield wan


def server_under_load(shards: Path, clients: list[int], rtt_ms: float, steps: int, context: int) -> list[dict]:
    """Steps served per second by a real server behind the WAN proxy, driven by model-less clients (each
    step costs the client a few microseconds of encoding), batched and one session at a time."""
    from ..local.middle import RemoteMiddle

    manifest = json.loads((shards / "cloud" / "manifest.json").read_text())
    width = manifest["hidden_size"]
    results = []
    for mode, extra in SERVER_MODES:
        with _served(shards, extra, rtt_ms) as wan:
            def middle():
                return RemoteMiddle.for_shard(wan, manifest, width, "float16")

            _replay(middle(), width, context, 3, [])  # warm-up
            for n in clients:
                latencies: list[list[float]] = [[] for _ in range(n)]
                start = threading.Barrier(n + 1)  # the clock starts when every client has prefilled
                threads = [threading.Thread(target=_replay, args=(middle(), width, context, steps, latencies[i], start))
                           for i in range(n)]
                for t in threads:
                    t.start()
                start.wait()
                t0 = time.perf_counter()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - t0
                served = sum(len(x) for x in latencies)
                if served != n * steps:
                    raise ConfigError(f"only {served} of {n * steps} steps were answered; rerun with -v to see why.")
                results.append({"mode": mode, "clients": n, "rtt_ms": rtt_ms, "steps": served, "wall_s": round(wall, 3),
                                "steps_served_per_s": round(served / wall, 2),
                                "step_latency_ms_median": median([v for x in latencies for v in x], 3)})
                print(f"  server {mode:>13} {n:>2} client(s): {results[-1]['steps_served_per_s']} steps/s, "
                      f"{results[-1]['step_latency_ms_median']} ms per step", flush=True)
    return results


def end_to_end(shards: Path, clients: list[int], rtt_ms: float, tokens: int) -> list[dict]:
    from ..clients import open_client
    from ..local.config import ClientConfig
    from .runtime import load_prompts

    prompts = [p["prompt"] for p in load_prompts(None, 2)]
    results = []
    for mode, extra in SERVER_MODES:
        with _served(shards, extra, rtt_ms) as wan:
            # float16 on the wire and no draft head, whatever the shard records: every run compares like with like
            client = open_client(shards / "local", wan, ClientConfig(wire_dtype="float16", drafter="off"),
                                 allow_public_weights=True, checks=False)
            # Token ids encoded here, once: client threads then never share the tokenizer's encoder. A
            # synthetic shard has no tokenizer: seeded random ids of the prompts' lengths time it alike.
            prompt_ids = ([client.encode_prompt(p) for p in prompts] if client.local.tokenizer is not None
                          else random_prompt_ids(client.local.config.vocab_size, [64] * len(prompts)))
            client.generate(prompt_ids[0], max_new_tokens=4, strategy="sequential")  # warm-up, discarded
            for n in clients:
                gens: dict[int, object] = {}
                barrier = threading.Barrier(n)

                def worker(i):
                    barrier.wait()
                    gens[i] = client.generate(prompt_ids[i % len(prompt_ids)], max_new_tokens=tokens,
                                              strategy="sequential", stop_ids=set())

                threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - t0
                if len(gens) != n:
                    raise ConfigError(f"{n - len(gens)} of {n} clients failed; rerun with -v to see why.")
                stats = [g.stats for g in gens.values()]
                steps = sum(s["steps"] for s in stats)
                results.append({
                    "mode": mode, "clients": n, "rtt_ms": rtt_ms, "wall_s": round(wall, 3),
                    "generated_tokens": sum(s["generated_tokens"] for s in stats),
                    "aggregate_tok_s": round(sum(s["generated_tokens"] for s in stats) / wall, 2),
                    "per_session_tok_s_median": median([s["tokens_per_s"] for s in stats], 3),
                    "decode_steps": steps, "steps_served_per_s": round(steps / wall, 2),
                    "median_cloud_compute_ms": median([s["median_ms"]["cloud_compute"] for s in stats], 3),
                    "median_local_compute_ms": median([s["median_ms"]["local_compute"] for s in stats], 3),
                    "median_round_trip_ms": median([s["median_ms"]["round_trip"] for s in stats], 3),
                })
                print(f"  e2e {mode:>13} {n:>2} client(s): {results[-1]['aggregate_tok_s']} tok/s aggregate, "
                      f"{results[-1]['steps_served_per_s']} steps/s", flush=True)
    return results


def random_prompt_ids(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Seeded random token ids, one prompt per length (for shards without a tokenizer)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def markdown(report: dict) -> str:
    lines = [f"# Batched cloud execution ({report['model_id']})", "", report["how"], "",
             "## Cloud side, in-process (no clients on the CPU)", ""]
    body = []
    for r in report["cloud"]["rows"]:
        rows = r["block_rows"]
        shape = f"{rows[0]} x {len(rows)}" if len(set(rows)) == 1 else ",".join(map(str, rows))
        body.append([r["kind"], r["batch"], shape, r.get("passes", 1), r["batched_ms"], r["one_at_a_time_ms"],
                     r["batched_vs_one_step"], r["speedup_vs_one_at_a_time"], r["steps_per_s_batched"],
                     r["steps_per_s_one_at_a_time"]])
    lines += left_table(["kind", "sessions", "block rows", "passes", "batched ms", "one at a time ms", "batched / one step",
                    "speedup", "steps/s batched", "steps/s one at a time"], body)
    lines += ["", *lone_markdown(report["cloud"]["lone_session"]), ""]
    targets = report["targets"]
    if "batch16_vs_one_step" in targets:
        lines += ["Target: batched compute of 16 single-token steps <= 3x one step: "
                  f"**{targets['batch16_vs_one_step']}x** ({'met' if targets['batch16_met'] else 'not met'})."]
    if report["server_under_load"]:
        rtt = report["server_under_load"][0]["rtt_ms"]
        lines += ["", f"## The real server at +{rtt:g} ms round trip, driven by model-less clients (cloud side)", "",
                  "Clients replay single-token decode steps of random hidden states (no local layers), so the "
                  "server's batching, not the clients' compute, sets the rate.", ""]
        lines += left_table(["mode", "clients", "steps served/s", "step latency ms (median)"],
                       [[r["mode"], r["clients"], r["steps_served_per_s"], r["step_latency_ms_median"]]
                        for r in report["server_under_load"]])
        if "server_steps16_vs_lone" in targets:
            met = "met" if targets["server_steps16_met"] else "not met"
            lines += ["", "Target: steps served per second at 16 sessions >= 5x a lone session's: "
                      f"**{targets['server_steps16_vs_lone']}x** ({met})."]
    if report["e2e"]:
        rtt = report["e2e"][0]["rtt_ms"]
        lines += ["", f"## End to end at +{rtt:g} ms round trip (clients share a core; see above)",
                  ""]
        lines += left_table(["mode", "clients", "aggregate tok/s", "per-session tok/s (median)", "steps served/s",
                        "cloud compute ms (median)", "local compute ms (median)", "round trip ms (median)"],
                       [[r["mode"], r["clients"], r["aggregate_tok_s"], r["per_session_tok_s_median"],
                         r["steps_served_per_s"], r["median_cloud_compute_ms"], r["median_local_compute_ms"],
                         r["median_round_trip_ms"]] for r in report["e2e"]])
        if "e2e_steps16_vs_lone" in targets:
            lines += ["", "End to end, steps served per second at 16 clients vs one (bounded by the clients sharing "
                      f"a core): {targets['e2e_steps16_vs_lone']}x."]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    import torch

    from ..launch import pinned
    from ..model.shards import load_cloud

    shards, out = Path(args.shards), Path(args.out)
    sizes = _ints(args.sizes, "--sizes")
    clients = _ints(args.clients, "--clients") if args.clients else []
    load_clients = _ints(args.load_clients, "--load-clients") if args.load_clients else []
    if not (shards / "cloud").is_dir():
        raise ConfigError(f"{shards} has no cloud shard; run `splitinfer prepare --out {shards}` first.")
    with pinned(0, args.threads):  # a caller in the same process (tests) gets its CPUs and threads back
        half = load_cloud(shards / "cloud", device=args.device, dtype=args.dtype)
        print(f"cloud side: batches {sizes}, context ~{args.context} rows, {args.repeats} repeats", flush=True)
        cloud = cloud_side(half, sizes, args.context, args.repeats)
        torch.set_num_threads(1)
        load = server_under_load(shards, load_clients, args.rtt_ms, args.load_steps, args.context) if load_clients else []
        e2e = end_to_end(shards, clients, args.rtt_ms, args.max_new_tokens) if clients else []
    rows = {r["batch"]: r for r in cloud["rows"] if r["kind"] == "decode"}
    targets = {}
    if 16 in rows:
        targets["batch16_vs_one_step"] = rows[16]["batched_vs_one_step"]
        targets["batch16_met"] = rows[16]["batched_vs_one_step"] <= 3.0
    for name, rows in (("server", load), ("e2e", e2e)):
        batched = {r["clients"]: r for r in rows if r["mode"] == "batched"}
        if 1 in batched and 16 in batched:
            ratio = round(batched[16]["steps_served_per_s"] / batched[1]["steps_served_per_s"], 2)
            targets[f"{name}_steps16_vs_lone"], targets[f"{name}_steps16_met"] = ratio, ratio >= 5.0
    report = {
        "model_id": half.manifest["model_id"], "device": args.device, "dtype": str(half.stack.compute_dtype),
        "how": (f"Cloud side: this process pinned to core 0, {args.threads} torch thread(s), device {args.device}. "
                "End to end: server child on core 1 (1 thread) behind the WAN proxy; clients are threads of this "
                "process on core 0 (1 torch thread), sequential decoding, float16 wire, "
                f"{args.max_new_tokens} new tokens each. Medians over {args.repeats} interleaved repeats."),
        "argv": sys.argv, "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cloud": cloud, "server_under_load": load, "e2e": e2e, "targets": targets,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "batching.json").write_text(json.dumps(report, indent=2))
    (out / "batching.md").write_text(markdown(report))
    print(markdown(report))
    return 0


@dataclass(frozen=True)
class BatchBenchOptions:
    """The defaults of `splitinfer bench batch`."""

    sizes: str = "1,4,16,64"  # decode batch sizes for the cloud-side measurement
    context: int = 128  # committed rows per session (varied by up to +56)
    repeats: int = 3  # measured repetitions
    load_clients: str = "1,4,16,64"  # model-less concurrent clients driving the real server ('' skips that part)
    load_steps: int = 16  # decode steps per model-less client
    clients: str = "1,4,16"  # concurrent clients end to end ('' skips that part)
    rtt_ms: float = 80.0  # added round trip end to end
    max_new_tokens: int = 32  # tokens per client end to end
    threads: int = 1  # torch threads for the cloud-side part


def register(subparsers) -> None:
    s = subparsers.add_parser(
        "batch", help="batched vs one-at-a-time cloud compute, and concurrent clients end to end"
    )
    add_shards_and_out(s, "batching.json and batching.md")
    add_options(s, BatchBenchOptions, described(BatchBenchOptions, "sizes", "context", "repeats", "load_clients",
                                                "load_steps", "clients", "rtt_ms", "max_new_tokens", "threads"))
    add_options(s, Shared, (Opt("device", help="cloud-side part: cpu, cuda, cuda:1 ..."),))
    s.add_argument("--dtype", choices=DTYPE_NAMES, help="cloud-side compute dtype")
    s.set_defaults(func=run)
