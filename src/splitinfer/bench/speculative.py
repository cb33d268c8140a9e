"""Speculative decoding benchmark: accepted tokens per step and tok/s of each strategy against sequential.

    splitinfer bench spec --shards shards/smollm2 --out docs/bench

Same fairness rules as the runtime benchmark (runtime.py): client on core 0, cloud on core 1, one thread
each, WAN emulator on core 1, configurations interleaved within each repetition, one warm-up each,
medians. Speed-ups are ratios of tok/s on the same prompt in the same repetition at the same round trip.
As a reference drafter it runs transformers' own prompt-lookup decoding locally on the same prompts and
counts its accepted tokens per model call. Each generation starts with a fresh strategy: nothing learned
about the text of one prompt (or of an earlier repetition of it) is reused. What is shared, as in any use
of one client, is the client's measurement of what a verified block costs on this deployment (its
StepCosts: rows and milliseconds of recent tree steps), which says nothing about the text.

The blocks-in-flight axis (`--in-flight 1,2,3`) runs each speculative strategy with D blocks in flight,
labelled `tree@D2` and so on, and reports each against the bound 1000 a / ((1 - p) L + p max(t, L / D)):
a the pooled emitted tokens per resolved block of that run, p the share of its blocks sent ahead whose
assumption held, L one block's latency and t the busiest stage per block, both measured on the same
strategy's D = 1 runs (decode wall time per step; the larger of local + drafting and cloud compute).
`--in-flight auto` lets the controller (decoding/ahead.py) choose, block by block, up to 3.

The fast-cloud scenario stands for a GPU cloud on this CPU: a shard whose cloud holds one layer
(`prepare --head-layers` + `--tail-layers` = N - 1), so the middle is still computed, exactly, in a
millisecond or two, and `--cloud-pass-ms X` makes every cloud pass last X ms (serve --min-pass-ms: the
compute thread waits out the rest), a GPU's flat pass time whatever the rows. What it does not model: the
client then runs N - 1 layers, so it is the slow side, as a CPU-only trusted machine in front of a GPU is.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import torch

from .. import __version__
from ..launch import cloud_server, wan_proxy
from ..local.client import SplitClient
from ..clients import open_client
from ..local.session import AUTO_IN_FLIGHT, MAX_IN_FLIGHT, ClientConfig, SplitSession
from ..decoding.controller import row_bucket
from ..decoding.strategies import STRATEGIES
from ..errors import ConfigError
from ..model.shards import load_whole_hf
from .runtime import _pin_self, load_prompts
from .step import greedy_transformers


def prompt_lookup_reference(shards: Path, prompts: list[dict], client: SplitClient, max_new_tokens: int) -> dict:
    """transformers' prompt-lookup decoding (prompt_lookup_num_tokens=10), run locally: accepted per call."""
    model = load_whole_hf(shards)
    calls = {"n": 0}
    original = model.forward

    def counting_forward(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    model.forward = counting_forward
    results = {}
    for p in prompts:
        ids = client.encode_prompt(p["prompt"], p.get("chat", True))
        calls["n"] = 0
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, prompt_lookup_num_tokens=10,
            eos_token_id=sorted(client.stop_ids()) or None,
        )
        generated = out.shape[1] - len(ids)
        decode_calls = max(calls["n"] - 1, 1)  # the first call is the prefill, which yields the first token
        results[p["id"]] = {
            "category": p["category"],
            "generated": generated,
            "decode_calls": decode_calls,
            "accepted_per_step": round((generated - 1) / decode_calls, 4),
            "token_ids": out[0, len(ids):].tolist(),
        }
    return results


def margin_before(client: SplitClient, prompt_ids: list[int], tokens: list[int], step: int) -> float:
    """Top-1 minus top-2 logit of the local float32 model before tokens[step] (for divergence reports)."""
    session = SplitSession(client.local, client.make_middle(), ClientConfig(wire_dtype="float32"))
    top = session.prefill(prompt_ids + tokens[:step])[-1].topk(2).values
    session.close()
    return round(float(top[0] - top[1]), 5)


def run_speculative_bench(args) -> dict:
    shards = Path(args.shards)
    rtts = [float(x) for x in str(args.rtt_ms).split(",") if x.strip()]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ConfigError(f"unknown strategy {', '.join(unknown)}; choose among {', '.join(STRATEGIES)}.")
    if "sequential" not in strategies:
        strategies.insert(0, "sequential")
    prompts = load_prompts(args.prompts, args.per_category)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _pin_self(0)
    local = open_client(local_only=True, shards=shards)
    reference = prompt_lookup_reference(shards, prompts, local, args.max_new_tokens)
    print("prompt lookup (transformers, local):", {k: v["accepted_per_step"] for k, v in reference.items()}, file=sys.stderr)
    depths = parse_depths(str(getattr(args, "in_flight", "1")))
    runs, local_runs = _measure(args, shards, prompts, strategies, rtts, local, depths)
    divergences = find_divergences(runs, local)
    device = args.cloud_device or "cpu"
    pass_ms = getattr(args, "cloud_pass_ms", 0) or 0
    if pass_ms:
        device += f", every pass padded to at least {pass_ms:g} ms (the fast-cloud scenario)"
    table = local.recycling_table
    replies = (f" and its suffix lookup also searches the {table.manifest.get('reply_tokens')} reply tokens shipped with it"
               if table is not None and table.replies is not None else "")
    warm = (f"tree's Token Recycling starts from the shipped table ({table.manifest.get('table_tokens')} tokens, data "
            f"{str(table.manifest.get('data_sha256'))[:12]}){replies}" if table is not None else "no recycling table for this model")
    report = {
        "command": "splitinfer bench spec " + " ".join(shlex.quote(a) for a in sys.argv[3:]),
        "splitinfer": __version__,
        "torch": torch.__version__,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "setup": f"client: this process, core 0, 1 thread; cloud server: child process, core 1, 1 thread, {device}; "
        f"WAN emulator: child process on core 1; {args.wire_dtype} wire; greedy; fresh drafting state per generation "
        "(the client's measured step costs, and what its draft head is worth, are shared by its generations); "
        "local-only: the whole model in this process, core 0, 1 thread, sequential greedy, float32; every "
        f"configuration runs on a prompt before the next prompt starts; {warm}",
        "model": json.loads((shards / "local" / "manifest.json").read_text())["model_id"],
        "wire_dtype": args.wire_dtype,
        "cloud_device": device,
        "recycling_table": table.manifest if table is not None else None,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "strategies": strategies,
        "rtts_ms": rtts,
        "prompts": [p["id"] for p in prompts],
        "prompt_lookup": reference,
        "in_flight": depths,
        "summary": summarize(runs, reference, local_runs),
        "divergences": divergences,
        "runs": runs,
        "local_only_runs": local_runs,
    }
    (out / "speculative.json").write_text(json.dumps(report, indent=1))
    (out / "speculative.md").write_text(markdown(report))
    if args.readme:
        replace_results(Path(args.readme), report, out / "speculative.md")
    print(markdown(report))
    return report


def parse_depths(text: str) -> list[int]:
    """--in-flight: comma-separated depths 1-3, or auto (AUTO_IN_FLIGHT: the controller chooses)."""
    depths = []
    for item in (x.strip().lower() for x in text.split(",") if x.strip()):
        if item == "auto":
            depths.append(AUTO_IN_FLIGHT)
        elif item.isdigit() and 1 <= int(item) <= MAX_IN_FLIGHT:
            depths.append(int(item))
        else:
            depths = []
            break
    if not depths:
        raise ConfigError(f"--in-flight takes comma-separated depths between 1 and {MAX_IN_FLIGHT}, or auto, "
                          "e.g. 1,2,3,auto.")
    return depths


def label(strategy: str, depth: int) -> str:
    """A configuration's name in the tables: the strategy, and its blocks in flight when more than one
    (`@Dauto` when the controller chose them)."""
    if depth == AUTO_IN_FLIGHT:
        return f"{strategy}@Dauto"
    return strategy if depth == 1 else f"{strategy}@D{depth}"


def _measure(args, shards: Path, prompts: list[dict], strategies: list[str], rtts: list[float], local: SplitClient,
             depths: list[int] = (1,)):
    """(split runs, local-only runs): every configuration once per prompt and repetition, interleaved prompt
    by prompt (local-only, then every configuration on the same prompt), so a machine whose speed drifts
    during the run slows every configuration alike. Sequential decoding has nothing to send ahead, so it
    runs with one block in flight only."""
    runs: list[dict] = []
    local_runs: list[dict] = []
    extra = ("--device", args.cloud_device) if args.cloud_device else ()
    if getattr(args, "cloud_pass_ms", 0):
        extra += ("--min-pass-ms", str(args.cloud_pass_ms))
    with ExitStack() as stack:
        url, _ = stack.enter_context(cloud_server(shards / "cloud", cpu=1, threads=1, extra=extra))
        targets = {rtt: (url if rtt == 0 else stack.enter_context(wan_proxy(url, rtt, cpu=1))) for rtt in rtts}
        wire = ClientConfig(wire_dtype=args.wire_dtype) if args.wire_dtype else ClientConfig()
        args.wire_dtype = wire.wire_dtype
        clients = {(rtt, d): open_client(shard=shards / "local", server=target, allow_public_weights=True,
                                         config=ClientConfig(wire_dtype=wire.wire_dtype, in_flight=d))
                   for rtt, target in targets.items() for d in sorted(set(depths) | {1})}
        configs = [(s, rtt, d) for rtt in rtts for d in sorted(set(depths) | {1}) for s in strategies
                   if d == 1 or s != "sequential"]
        local.generate(prompts[0]["prompt"], max_new_tokens=16, strategy="sequential")
        whole = load_whole_hf(shards)  # plain transformers on the same core and thread: the anchor
        greedy_transformers(whole, local.encode_prompt(prompts[0]["prompt"]), 16)
        for strategy, rtt, d in configs:
            clients[(rtt, d)].generate(prompts[0]["prompt"], max_new_tokens=16, strategy=strategy)
        for rep in range(args.repeats):
            for p in prompts:
                result = local.generate(p["prompt"], max_new_tokens=args.max_new_tokens, chat=p.get("chat", True),
                                        strategy="sequential")
                local_runs.append(_record("local-only", 0.0, rep, p, result))
                local_runs.append(transformers_record(whole, rep, p, result))
                for strategy, rtt, d in configs:
                    result = clients[(rtt, d)].generate(
                        p["prompt"], max_new_tokens=args.max_new_tokens, chat=p.get("chat", True), strategy=strategy
                    )
                    runs.append(_record(label(strategy, d), rtt, rep, p, result, d))
    return runs, local_runs


def transformers_record(whole, rep: int, p: dict, local_result) -> dict:
    """Plain transformers greedy decoding (the whole model, its own cache, no splitinfer code) on the prompt
    local-only just ran, for as many tokens as local-only generated: the anchor of the local-only row."""
    tokens, ms = greedy_transformers(whole, local_result.prompt_token_ids, len(local_result.token_ids))
    n = len(tokens)
    record = {"strategy": "transformers", "rtt_ms": 0.0, "repeat": rep, "prompt_id": p["id"], "category": p["category"],
              "token_ids": tokens, "identical_to_local_only": tokens == local_result.token_ids,
              "tokens_per_s": round(1000 / ms, 3) if n > 1 else 0.0,
              "stats": {"generated_tokens": n, "decode_s": ms * max(n - 1, 0) / 1e3}}
    print(f"[{rep}] transformers        {p['id']:<16} {record['tokens_per_s']:7.2f} tok/s", file=sys.stderr)
    return record


def _record(strategy: str, rtt: float, rep: int, p: dict, result, depth: int = 1) -> dict:
    """One generation: its tokens, rate, per-step acceptance, and per-step time split for the bound."""
    decode = [s for s in result.steps if s["kind"] == "decode"]
    checked = [s for s in decode if s.get("ahead_held") is not None]
    ahead = {"sent_ahead_used": sum(s.get("assumed", 0) > 0 for s in decode),
             "dropped": sum(s["kind"] == "dropped" for s in result.steps),
             # blocks in flight while each used block ahead ran, itself included: its depth
             "depth_sum": sum(s.get("assumed", 0) + 1 for s in decode if s.get("assumed", 0) > 0),
             # what a block after each one assumed (or would have): the chance given, and how often it held
             "checked": len(checked), "held": sum(bool(s["ahead_held"]) for s in checked),
             "p_sum": round(sum(s["ahead_p"] for s in checked), 4)}
    blocks_ms = sum(s["round_trip_ms"] + s["local_ms"] + s["serialize_ms"] for s in decode)
    record = {
        "strategy": strategy,
        "in_flight": depth,
        "ahead": ahead,
        "rtt_ms": rtt,
        "repeat": rep,
        "prompt_id": p["id"],
        "category": p["category"],
        "prompt_token_ids": result.prompt_token_ids,
        "token_ids": result.token_ids,
        "tokens_per_s": result.stats["tokens_per_s"],
        "accepted": [s["accepted"] for s in decode],
        "rows": [s["rows"] for s in decode],
        "bytes": [s["bytes_up"] + s["bytes_down"] for s in decode],
        "step_ms": [round(s["round_trip_ms"] + s["local_ms"] + s["serialize_ms"], 2) for s in decode],
        # sums over decode steps, ms: what the bound 1000 a / (RTT + local + cloud + drafting) is made of
        "time_ms": {
            "local": round(sum(s["local_ms"] + s["serialize_ms"] for s in decode), 3),
            "cloud": round(sum(s["cloud_compute_ms"] for s in decode), 3),
            "round_trip": round(sum(s["round_trip_ms"] for s in decode), 3),
            # decode wall time outside the blocks: drafting, acceptance and bookkeeping between steps
            "drafting": round(max(result.stats["decode_s"] * 1e3 - blocks_ms, 0.0), 3),
        },
        "stats": result.stats,
    }
    print(f"[{rep}] {strategy:<10} @{rtt:>4g} ms {p['id']:<16} {result.stats['tokens_per_s']:7.2f} tok/s "
          f"{result.stats['mean_accepted_per_step']:.2f} acc/step", file=sys.stderr)
    return record


def find_divergences(runs: list[dict], local: SplitClient) -> list[dict]:
    """Every generation whose tokens differ from sequential's (same prompt, round trip and repetition)."""
    sequential = {(r["prompt_id"], r["rtt_ms"], r["repeat"]): r for r in runs if r["strategy"] == "sequential"}
    found = []
    for r in runs:
        ref = sequential[(r["prompt_id"], r["rtt_ms"], r["repeat"])]
        if r["strategy"] == "sequential" or r["token_ids"] == ref["token_ids"]:
            continue
        step = next((i for i, (a, b) in enumerate(zip(r["token_ids"], ref["token_ids"])) if a != b), None)
        if step is None:
            step = min(len(r["token_ids"]), len(ref["token_ids"]))
        found.append(
            {
                "strategy": r["strategy"], "prompt_id": r["prompt_id"], "rtt_ms": r["rtt_ms"], "repeat": r["repeat"],
                "first_different_token": step,
                "local_float32_margin": margin_before(local, r["prompt_token_ids"], ref["token_ids"], step),
            }
        )
    return found


def _set_rate(runs: list[dict]) -> float:
    """Tokens per second of a list of generations taken as one workload (decode tokens / decode time)."""
    tokens = sum(max(r["stats"]["generated_tokens"] - 1, 0) for r in runs)
    seconds = sum(r["stats"]["decode_s"] for r in runs)
    return tokens / seconds if seconds > 0 else 0.0


def _emitted_per_step(run: dict) -> float:
    """One generation's emitted tokens per step (runs recorded before steps counted only emitted tokens
    may carry a last step that accepted past the limit; the generated count never does)."""
    return max(run["stats"]["generated_tokens"] - 1, 0) / max(len(run["accepted"]), 1)


def _pooled(runs: list[dict]) -> float:
    """Emitted tokens per step over all of `runs`' decode steps (the first token comes from prefill)."""
    tokens = sum(max(r["stats"]["generated_tokens"] - 1, 0) for r in runs)
    return tokens / max(sum(len(r["accepted"]) for r in runs), 1)


def bound(runs: list[dict], rtt_ms: float) -> dict:
    """tok/s = 1000 a / (RTT + local + cloud + drafting), each a mean per decode step over `runs`.

    RTT is the added round trip as configured, so the gap to the measured rate is what the bound leaves
    out: loopback and emulator time, the server's own handling, scheduling on a shared machine.
    """
    steps = max(sum(len(r["accepted"]) for r in runs), 1)
    parts = {k: sum(r["time_ms"][k] for r in runs) / steps for k in ("local", "cloud", "drafting")}
    a = _pooled(runs)
    step = rtt_ms + sum(parts.values())
    return {"a": round(a, 3), "rtt_ms": rtt_ms, **{f"{k}_ms": round(v, 3) for k, v in parts.items()},
            "tokens_per_s": round(1000 * a / step, 3) if step > 0 else 0.0}


def _by_category(runs: list[dict], value) -> dict[str, float]:
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["category"], []).append(r)
    return {c: round(value(v), 3) for c, v in sorted(groups.items())}


def _config_row(strategy: str, rtt: float, mine: list[dict], sequential_tps: dict, reference_runs: list[dict],
                local_rate: float, pld_mean: float) -> dict:
    accepted = [a for r in mine for a in r["accepted"]]
    first = [r for r in mine if r["repeat"] == 0]
    per_prompt = [_emitted_per_step(r) for r in first]
    mean_over_prompts = statistics.mean(per_prompt)
    ratios = [r["tokens_per_s"] / sequential_tps[(r["prompt_id"], r["rtt_ms"], r["repeat"])] for r in mine]
    rate = _set_rate(mine)
    return {
        "strategy": strategy,
        "rtt_ms": rtt,
        "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in mine), 3),
        "tokens_per_s_whole_set": round(rate, 3),
        "speedup_vs_sequential_median": round(statistics.median(ratios), 3),
        "speedup_vs_sequential_min": round(min(ratios), 3),
        # The whole set as one workload: all tokens over all decode time, against sequential's on the same runs.
        "speedup_whole_set": round(rate / _set_rate(reference_runs), 3),
        "vs_local_only_whole_set": round(rate / local_rate, 3) if local_rate else None,
        "prompt_runs_below_0_95x": sum(x < 0.95 for x in ratios),
        "mean_accepted_per_step": round(mean_over_prompts, 3),
        "mean_accepted_pooled": round(_pooled(mine), 3),
        "vs_prompt_lookup": round(mean_over_prompts / pld_mean, 3),
        "max_accepted_per_step": max(accepted, default=0),
        "accepted_histogram": dict(sorted(Counter(accepted).items())),
        "median_rows_per_step": statistics.median(x for r in mine for x in r["rows"]),
        "median_bytes_per_step": statistics.median(x for r in mine for x in r["bytes"]),
        "per_category_accepted": _by_category(
            first, lambda rs: statistics.mean(_emitted_per_step(r) for r in rs)),
        "per_category_pooled": _by_category(mine, _pooled),
        "bound": bound(mine, rtt) if all("time_ms" in r for r in mine) else None,
        "draft_head": head_share(mine),
    }


def head_share(runs: list[dict]) -> dict | None:
    """What the learned head did over `runs` (None where no run had one): the share of decode steps it
    drafted on, per drafting step the block rows and accepted tokens only it proposed and its drafting ms,
    and the tokens only it proposed per decode step, over all runs and by category."""
    mine = [r for r in runs if "draft_head" in r["stats"]]
    if not mine:
        return None

    def per_step(rs: list[dict]) -> float:
        return round(sum(r["stats"]["draft_head"]["tokens"] for r in rs) / max(sum(len(r["accepted"]) for r in rs), 1), 3)

    tally = {k: sum(r["stats"]["draft_head"][k] for r in mine) for k in ("steps", "rows", "tokens", "ms")}
    drafting = max(tally["steps"], 1)
    return {
        "drafting_share": round(tally["steps"] / max(sum(len(r["accepted"]) for r in mine), 1), 3),
        "rows_per_drafting_step": round(tally["rows"] / drafting, 3),
        "tokens_per_drafting_step": round(tally["tokens"] / drafting, 3),
        "ms_per_drafting_step": round(tally["ms"] / drafting, 3),
        "tokens_per_step": per_step(mine),
        "tokens_per_step_by_category": _by_category(mine, per_step),
    }


def _latency_and_busiest(runs: list[dict]) -> tuple[float, float]:
    """(L, t), ms per decode step of one-block-at-a-time runs: the decode wall time per step, and the busier
    stage per step, the client (local compute, serialization, drafting) or the cloud (its compute)."""
    steps = max(sum(len(r["accepted"]) for r in runs), 1)
    latency = sum(r["stats"]["decode_s"] for r in runs) * 1e3 / steps
    local = sum(r["time_ms"]["local"] + r["time_ms"]["drafting"] for r in runs) / steps
    cloud = sum(r["time_ms"]["cloud"] for r in runs) / steps
    return latency, max(local, cloud)


def in_flight_rows(runs: list[dict]) -> list[dict]:
    """Per strategy with a blocks-in-flight axis, round trip and D: the measured rate against the bound
    1000 a / ((1 - p) L + p max(t, L / D)), L and t from the strategy's D = 1 runs at that round trip.

    p here is the share of resolved blocks that went ahead and held (their latency was hidden): for a pinned
    D nearly every block goes ahead, so it is the hold rate; under the controller (auto) the blocks it kept
    back count as not hidden, and D is the mean depth of the blocks ahead that held. `hold` is the share of
    blocks sent ahead whose assumption held; `score` and `held` compare the mean chance the controller gave
    the assumptions with how often they held (its calibration), over every resolved block.
    """
    by_config: dict[tuple[str, float], list[dict]] = {}
    for r in runs:
        by_config.setdefault((r["strategy"], r["rtt_ms"]), []).append(r)
    pipelined = {name.split("@D")[0] for name, _ in by_config if "@D" in name}
    rows = []
    for (name, rtt), mine in by_config.items():
        strategy = name.split("@D")[0]
        base = by_config.get((strategy, rtt), [])
        if strategy not in pipelined or not base or not all("time_ms" in r for r in base):
            continue
        latency, busiest = _latency_and_busiest(base)
        ahead = {k: sum(r.get("ahead", {}).get(k, 0) for r in mine)
                 for k in ("sent_ahead_used", "dropped", "depth_sum", "checked", "held", "p_sum")}
        used, dropped = ahead["sent_ahead_used"], ahead["dropped"]
        resolved = max(sum(len(r["accepted"]) for r in mine), 1)
        p = used / resolved
        pinned = mine[0].get("in_flight", 1)
        depth = ahead["depth_sum"] / used if ahead["depth_sum"] else float(max(pinned, 1))
        a = _pooled(mine)
        step = (1 - p) * latency + p * max(busiest, latency / depth)
        rate = _set_rate(mine)
        rows.append({"strategy": strategy, "rtt_ms": rtt, "in_flight": pinned,
                     "depth": round(depth, 2), "a": round(a, 3), "L_ms": round(latency, 3), "t_ms": round(busiest, 3),
                     "p": round(p, 3), "sent_ahead": used + dropped, "hold": round(used / (used + dropped), 3) if used + dropped else None,
                     "score": round(ahead["p_sum"] / ahead["checked"], 3) if ahead["checked"] else None,
                     "held": round(ahead["held"] / ahead["checked"], 3) if ahead["checked"] else None,
                     "bound_tokens_per_s": round(1000 * a / step, 3) if step > 0 else 0.0,
                     "tokens_per_s_whole_set": round(rate, 3),
                     "vs_one_in_flight": round(rate / _set_rate(base), 3) if _set_rate(base) else None,
                     "vs_one_in_flight_min": _min_ratio(mine, base)})
    # auto (AUTO_IN_FLIGHT, 0) after the pinned depths
    return sorted(rows, key=lambda r: (r["strategy"], r["rtt_ms"], r["in_flight"] or MAX_IN_FLIGHT + 1))


def _min_ratio(mine: list[dict], base: list[dict]) -> float | None:
    """The lowest per-prompt tok/s ratio of `mine` to `base` (same prompt and repetition)."""
    rates = {(r["prompt_id"], r["repeat"]): r["tokens_per_s"] for r in base}
    ratios = [r["tokens_per_s"] / rates[k] for r in mine if (k := (r["prompt_id"], r["repeat"])) in rates and rates[k]]
    return round(min(ratios), 3) if ratios else None


def step_cost_curve(runs: list[dict]) -> dict[str, dict[int, dict]]:
    """Per round trip: the median ms of a decode step (round trip, local compute, serialisation; not drafting)
    per bucket of block rows (decoding/controller.py `row_bucket`), over every step of every strategy: the
    curve the controller prices blocks with, as this run measured it."""
    steps: dict[str, dict[int, list[float]]] = {}
    for r in runs:
        for rows, ms in zip(r["rows"], r.get("step_ms", [])):
            steps.setdefault(f"{r['rtt_ms']:g}", {}).setdefault(row_bucket(rows), []).append(ms)
    return {rtt: {bucket: {"median_ms": round(statistics.median(v), 1), "steps": len(v)} for bucket, v in sorted(b.items())}
            for rtt, b in steps.items()}


def summarize(runs: list[dict], reference: dict, local_runs: list[dict] = ()) -> dict:
    """Per (strategy, round trip): rates, speed-ups against sequential and local-only, acceptance, bound."""
    by_config: dict[tuple[str, float], list[dict]] = {}
    for r in runs:
        by_config.setdefault((r["strategy"], r["rtt_ms"]), []).append(r)
    sequential_tps = {(r["prompt_id"], r["rtt_ms"], r["repeat"]): r["tokens_per_s"] for r in runs if r["strategy"] == "sequential"}
    pld_mean = statistics.mean(v["accepted_per_step"] for v in reference.values())
    anchor_runs = [r for r in local_runs if r["strategy"] == "transformers"]
    local_runs = [r for r in local_runs if r["strategy"] != "transformers"]
    local_rate = _set_rate(list(local_runs)) if local_runs else 0.0
    rows = []
    for (strategy, rtt), mine in by_config.items():
        reference_runs = [r for r in runs if r["strategy"] == "sequential" and r["rtt_ms"] == rtt]
        rows.append(_config_row(strategy, rtt, mine, sequential_tps, reference_runs, local_rate, pld_mean))
    pld_categories: dict[str, list[float]] = {}
    for v in reference.values():
        pld_categories.setdefault(v["category"], []).append(v["accepted_per_step"])
    local_only = None
    if local_runs:
        local_only = {
            "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in local_runs), 3),
            "tokens_per_s_whole_set": round(local_rate, 3),
            "bound": bound(list(local_runs), 0.0),
            "identical_to_split_sequential": _same_tokens(local_runs, runs),
        }
        if anchor_runs:
            anchor_rate = _set_rate(anchor_runs)
            local_only["transformers"] = {
                "tokens_per_s_whole_set": round(anchor_rate, 3),
                "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in anchor_runs), 3),
                "local_only_vs_transformers": round(local_rate / anchor_rate, 3),
                "identical_to_local_only": f"{sum(r['identical_to_local_only'] for r in anchor_runs)} of {len(anchor_runs)}",
            }
    return {
        "rows": rows,
        "in_flight": in_flight_rows(runs),
        "step_cost": step_cost_curve(runs),
        "local_only": local_only,
        "prompt_lookup_mean_accepted": round(pld_mean, 3),
        "prompt_lookup_per_category": {c: round(statistics.mean(v), 3) for c, v in sorted(pld_categories.items())},
    }


def _same_tokens(local_runs: list[dict], runs: list[dict]) -> dict[str, str]:
    """Per round trip: how many split sequential generations equal local-only float32's, as 'n of m'."""
    local = {(r["prompt_id"], r["repeat"]): r["token_ids"] for r in local_runs}
    out = {}
    for rtt in dict.fromkeys(r["rtt_ms"] for r in runs):
        mine = [r for r in runs if r["strategy"] == "sequential" and r["rtt_ms"] == rtt]
        same = sum(r["token_ids"] == local.get((r["prompt_id"], r["repeat"])) for r in mine)
        out[f"{rtt:g}"] = f"{same} of {len(mine)}"
    return out


RESULTS_START = "<!-- bench-spec results: generated by `splitinfer bench-spec --readme`; do not edit by hand -->"
RESULTS_END = "<!-- end of bench-spec results -->"


def results_table(report: dict) -> list[str]:
    """The headline table, one row per mode, every figure from this report's one run."""
    summary = report["summary"]
    lines = [
        "| mode | added RTT ms | tok/s, whole set | x sequential, whole set (median prompt) | x local-only, whole set "
        "| emitted tokens/step, pooled (mean over prompts) | bound tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    local = summary.get("local_only")
    anchor = (local or {}).get("transformers")
    if anchor:
        vs = round(anchor["tokens_per_s_whole_set"] / local["tokens_per_s_whole_set"], 3)
        lines.append(f"| plain transformers greedy (whole model, own cache, same core) | - | "
                     f"{anchor['tokens_per_s_whole_set']} | - | {vs}x | 1.0 | - |")
    if local:
        lines.append(f"| local-only (whole model, one process) | - | {local['tokens_per_s_whole_set']} | - | 1.0x | 1.0 "
                     f"| {local['bound']['tokens_per_s']} |")
    for r in summary["rows"]:
        vs_local = f"{r['vs_local_only_whole_set']}x" if r.get("vs_local_only_whole_set") else "-"
        bound_tps = r["bound"]["tokens_per_s"] if r.get("bound") else "-"
        lines.append(
            f"| split, {r['strategy']} | {r['rtt_ms']:g} | {r.get('tokens_per_s_whole_set', '-')} | "
            f"{r['speedup_whole_set']}x ({r['speedup_vs_sequential_median']}x) | {vs_local} | "
            f"{r['mean_accepted_pooled']} ({r['mean_accepted_per_step']}) | {bound_tps} |"
        )
    return lines


def replace_results(readme: Path, report: dict, details: Path) -> None:
    """Put this run's results table between the markers in `readme` (they must be there already)."""
    text = readme.read_text()
    if RESULTS_START not in text or RESULTS_END not in text:
        raise ConfigError(f"{readme} has no results markers; add the lines {RESULTS_START!r} and {RESULTS_END!r} "
                          "where the table goes.")
    head, rest = text.split(RESULTS_START, 1)
    _, tail = rest.split(RESULTS_END, 1)
    link = os.path.relpath(details, readme.parent)
    speculative = sum(r["strategy"] != "sequential" for r in report["runs"]) if "runs" in report else None
    differing = len(report["divergences"])
    exact = (f"{speculative - differing} of {speculative} speculative generations were token-identical to sequential "
             "decoding at the same round trip." if speculative is not None else "")
    body = [f"{report['model']}, {len(report['prompts'])} prompts x {report['max_new_tokens']} new tokens, "
            f"{report['repeats']} repetitions; {report['setup']}. Command: `{report['command']}`; "
            f"details: [{link}]({link}).", "", *results_table(report), "", exact]
    readme.write_text(head + RESULTS_START + "\n" + "\n".join(body) + "\n" + RESULTS_END + tail)


def markdown(report: dict) -> str:
    summary = report["summary"]
    categories = sorted({c for row in summary["rows"] for c in row["per_category_accepted"]})
    lines = [
        f"# Speculative decoding benchmark: {report['model']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Setup: {report['setup']}. {len(report['prompts'])} prompts, {report['max_new_tokens']} new tokens, "
        f"{report['repeats']} repetitions after one warm-up per configuration. torch {report['torch']}.",
        "",
        *results_table(report),
        "",
        "Bound: 1000 a / (added RTT + local + cloud + drafting), a the pooled emitted tokens per step and the "
        "rest mean ms per decode step of the same runs:",
        "",
        "| mode | added RTT ms | a | local ms | cloud ms | drafting ms | bound tok/s | measured tok/s, whole set |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    local = summary.get("local_only")
    if local:
        b = local["bound"]
        lines.append(f"| local-only | - | {b['a']} | {b['local_ms']} | {b['cloud_ms']} | {b['drafting_ms']} | "
                     f"{b['tokens_per_s']} | {local['tokens_per_s_whole_set']} |")
    for r in summary["rows"]:
        if r.get("bound"):
            b = r["bound"]
            lines.append(f"| {r['strategy']} | {r['rtt_ms']:g} | {b['a']} | {b['local_ms']} | {b['cloud_ms']} | "
                         f"{b['drafting_ms']} | {b['tokens_per_s']} | {r.get('tokens_per_s_whole_set', '-')} |")
    lines += [
        "",
        "| strategy | added RTT ms | tok/s (median) | speed-up vs sequential (median, min) | whole set vs sequential "
        "| runs below 0.95x | accepted/step (mean over prompts) | pooled | max | rows/step (median) | bytes/step (median) "
        "| vs prompt lookup |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["rows"]:
        lines.append(
            f"| {r['strategy']} | {r['rtt_ms']:g} | {r['tokens_per_s_median']} | {r['speedup_vs_sequential_median']}x, "
            f"{r['speedup_vs_sequential_min']}x | {r['speedup_whole_set']}x | {r['prompt_runs_below_0_95x']} | "
            f"{r['mean_accepted_per_step']} | {r['mean_accepted_pooled']} | {r['max_accepted_per_step']} | "
            f"{r['median_rows_per_step']} | {r['median_bytes_per_step']} | {r['vs_prompt_lookup']}x |"
        )
    lines += _head_lines(summary, categories)
    lines += _in_flight_lines(summary)
    lines += _step_cost_lines(summary)
    lines += _category_tables(summary, categories)
    lines += _divergence_lines(report)
    lines += _anchor_lines(summary)
    return "\n".join(lines) + "\n"


def _anchor_lines(summary: dict) -> list[str]:
    anchor = (summary.get("local_only") or {}).get("transformers")
    if not anchor:
        return []
    return ["", f"Local-only against plain transformers greedy decoding of the same model on the same core and thread "
            f"(interleaved prompt by prompt): {anchor['local_only_vs_transformers']}x its rate over the whole set; "
            f"token-identical {anchor['identical_to_local_only']}. Every \"x local-only\" above is against "
            "splitinfer's own local-only path."]


def _head_lines(summary: dict, categories: list[str]) -> list[str]:
    rows = [r for r in summary["rows"] if r.get("draft_head")]
    if not rows:
        return []
    lines = ["", "The learned head: the share of decode steps it drafted on; per drafting step, the block rows and "
             "accepted tokens that only it proposed and its drafting ms; accepted tokens only it proposed per decode "
             "step, over all prompts and by category:", "",
             "| strategy | added RTT ms | drafted on | head-only rows | head-only accepted | drafting ms | per step | "
             + " | ".join(categories) + " |", "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(categories)]
    for r in rows:
        h = r["draft_head"]
        lines.append(f"| {r['strategy']} | {r['rtt_ms']:g} | {h['drafting_share']} | {h['rows_per_drafting_step']} | "
                     f"{h['tokens_per_drafting_step']} | {h['ms_per_drafting_step']} | {h['tokens_per_step']} | "
                     + " | ".join(str(h["tokens_per_step_by_category"].get(c, "")) for c in categories) + " |")
    return lines


def _in_flight_lines(summary: dict) -> list[str]:
    rows = summary.get("in_flight") or []
    if not rows:
        return []
    lines = ["", "Blocks in flight: measured tok/s (whole set) against the bound 1000 a / ((1 - p) L + p max(t, L / D)); "
             "a emitted tokens per resolved block, p the share of resolved blocks that went ahead and held, D their "
             "mean depth, L and t (ms per block: decode wall time, busiest stage) measured on the same strategy's "
             "D = 1 runs; sent ahead and hold: blocks sent ahead and the share whose assumption held; score / held: "
             "the mean chance the controller gave each assumption against how often it held:", "",
             "| strategy | added RTT ms | D | mean D | a | p | sent ahead | hold | score / held | L ms | t ms "
             "| bound tok/s | measured tok/s | x D = 1, whole set | x D = 1, lowest prompt |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        calibration = f"{r['score']} / {r['held']}" if r.get("score") is not None else "-"
        depth = "auto" if r["in_flight"] == AUTO_IN_FLIGHT else r["in_flight"]
        lines.append(f"| {r['strategy']} | {r['rtt_ms']:g} | {depth} | {r.get('depth', '-')} | {r['a']} | "
                     f"{r['p']} | {r.get('sent_ahead', '-')} | {r.get('hold') if r.get('hold') is not None else '-'} | "
                     f"{calibration} | {r['L_ms']} | {r['t_ms']} | {r['bound_tokens_per_s']} | "
                     f"{r['tokens_per_s_whole_set']} | {r['vs_one_in_flight']}x | {r.get('vs_one_in_flight_min', '-')}x |")
    return lines


def _step_cost_lines(summary: dict) -> list[str]:
    curve = summary.get("step_cost") or {}
    buckets = sorted({b for per_rtt in curve.values() for b in per_rtt})
    if not buckets:
        return []
    lowest = {b: next((q + 1 for q in range(b - 1, 0, -1) if row_bucket(q) != b), 1) for b in buckets}
    names = [str(b) if lowest[b] == b else f"{lowest[b]}-{b}" for b in buckets]
    lines = ["", "Decode step ms by block rows (median over every step of every strategy in this run; round trip, "
             "local compute and serialisation, not drafting; steps in brackets): the curve the controller prices "
             "blocks with:", "", "| added RTT ms | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(buckets)]
    for rtt, per_rtt in curve.items():
        cells = [f"{per_rtt[b]['median_ms']} ({per_rtt[b]['steps']})" if b in per_rtt else "" for b in buckets]
        lines.append(f"| {rtt} | " + " | ".join(cells) + " |")
    return lines


def _category_tables(summary: dict, categories: list[str]) -> list[str]:
    header = ["| strategy | added RTT ms | " + " | ".join(categories) + " |", "|---|---:|" + "---:|" * len(categories)]
    lines = [
        "",
        f"Accepted tokens per step by category, mean over prompts (repetition 0); transformers prompt lookup (local, "
        f"`prompt_lookup_num_tokens=10`) for reference, mean {summary['prompt_lookup_mean_accepted']}:",
        "",
        *header,
        "| prompt lookup (local) | - | " + " | ".join(str(summary["prompt_lookup_per_category"].get(c, "")) for c in categories) + " |",
    ]
    for r in summary["rows"]:
        lines.append(
            f"| {r['strategy']} | {r['rtt_ms']:g} | " + " | ".join(str(r["per_category_accepted"].get(c, "")) for c in categories) + " |"
        )
    lines += ["", "Emitted tokens per step by category, pooled over every step of every repetition:", "", *header]
    for r in summary["rows"]:
        pooled = r.get("per_category_pooled", {})
        lines.append(f"| {r['strategy']} | {r['rtt_ms']:g} | " + " | ".join(str(pooled.get(c, "")) for c in categories) + " |")
    lines += ["", "Distribution of accepted tokens per step (count of steps):", ""]
    for r in summary["rows"]:
        lines.append(f"- {r['strategy']} @ {r['rtt_ms']:g} ms: {r['accepted_histogram']}")
    return lines


def _divergence_lines(report: dict) -> list[str]:
    divergences = report["divergences"]
    lines = [""]
    local = report["summary"].get("local_only")
    if local:
        same = ", ".join(f"{v} at {k} ms" for k, v in local["identical_to_split_sequential"].items())
        lines += [f"Split sequential generations token-identical to local-only float32: {same}.", ""]
    if divergences:
        lines.append("Generations whose tokens differ from sequential decoding at the same round trip "
                     f"({report.get('wire_dtype', 'float16')} wire), "
                     "with the local float32 model's top-1 minus top-2 logit at the first different token:")
        lines.append("")
        for d in divergences:
            lines.append(f"- {d['strategy']} @ {d['rtt_ms']:g} ms, {d['prompt_id']} (rep {d['repeat']}): token "
                         f"{d['first_different_token']}, margin {d['local_float32_margin']}")
    else:
        lines.append("Every generation was token-identical to sequential decoding at the same round trip.")
    return lines
