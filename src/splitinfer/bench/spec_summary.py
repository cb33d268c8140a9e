"""`bench spec`'s summary: from the recorded runs to the report's numbers (rates, speed-ups against
sequential and local-only, acceptance, the bounds, the step-cost curve).

Pure functions of the runs speculative.py records (no timing happens here), so a report can be remade
from speculative.json alone; spec_report.py renders what this returns.
"""

from __future__ import annotations

import statistics
from collections import Counter

from ..decoding.controller import row_bucket
from ..local.session import MAX_IN_FLIGHT
from ..telemetry import median


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
        "tokens_per_s_median": median([r["tokens_per_s"] for r in mine], 3),
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
        "rtt_efficiency": rtt_efficiency(mine),
        "draft_head": head_share(mine),
    }


def rtt_efficiency(runs: list[dict]) -> float | None:
    """Network time over step time, summed over the decode steps of `runs`: 1.0 when compute is free, so it
    says how much of a step the project still owns. Network = round trips less the server's compute; step =
    local compute and serialization + round trips + drafting between blocks."""
    if not runs or not all("time_ms" in r for r in runs):
        return None
    t = {k: sum(r["time_ms"][k] for r in runs) for k in ("local", "cloud", "round_trip", "drafting")}
    step = t["local"] + t["round_trip"] + t["drafting"]
    return round((t["round_trip"] - t["cloud"]) / step, 3) if step else None


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
    return {rtt: {bucket: {"median_ms": median(v, 1), "steps": len(v)} for bucket, v in sorted(b.items())}
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
            "tokens_per_s_median": median([r["tokens_per_s"] for r in local_runs], 3),
            "tokens_per_s_whole_set": round(local_rate, 3),
            "bound": bound(list(local_runs), 0.0),
            "identical_to_split_sequential": _same_tokens(local_runs, runs),
        }
        if anchor_runs:
            anchor_rate = _set_rate(anchor_runs)
            local_only["transformers"] = {
                "tokens_per_s_whole_set": round(anchor_rate, 3),
                "tokens_per_s_median": median([r["tokens_per_s"] for r in anchor_runs], 3),
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
