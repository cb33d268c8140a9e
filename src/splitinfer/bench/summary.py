"""From a sweep's raw runs to the report's numbers: medians, fits, break-even, projection, cost, checks.

Pure functions of the runs recorded by runtime.py (no timing happens here), so the Markdown report and
the plots can be rebuilt from bench.json alone.
"""

from __future__ import annotations

import statistics

from ..errors import ConfigError
from ..telemetry import median
from . import throughput
from .runtime import SPLIT_MODES

BREAKDOWN = ("network_ms", "cloud_compute_ms", "server_other_ms", "local_compute_ms", "serialize_ms", "between_steps_ms")
FIT_TOLERANCE = 0.15  # issue 4: fitted f of sequential within 15% of the measured fixed overhead
PROBE_TOLERANCE = 0.10  # issue 4: probe reports the emulated RTT within 10%



def rows(runs: list[dict], price_per_hour: float) -> list[dict]:
    """One row per (mode, RTT): medians over prompts x repetitions of per-generation means."""
    reference = {(r["prompt_id"], r["repeat"]): r["token_ids"] for r in runs if r["mode"] == "local-only"}
    out = []
    for mode, rtt in dict.fromkeys((r["mode"], r["rtt_ms"]) for r in runs):
        mine = [r for r in runs if r["mode"] == mode and r["rtt_ms"] == rtt]
        steps = sum(r["steps"] for r in mine)
        row = {
            "mode": mode,
            "rtt_ms": rtt,
            "generations": len(mine),
            "tokens_per_s": median([r["tokens_per_s"] for r in mine], 3),
            # pooled over all steps, as the model's a is (tokens per round trip)
            "accepted_per_step": round(sum(r["accepted_per_step"] * r["steps"] for r in mine) / max(steps, 1), 4),
            "bytes_per_step": median([r["bytes_per_step"] for r in mine], 3),
            "step_ms": median([r["step_ms"] for r in mine], 3),
            **{k: median([r[k] for r in mine], 3) for k in BREAKDOWN},
            "identical_to_local_only": sum(r["token_ids"] == reference.get((r["prompt_id"], r["repeat"])) for r in mine),
        }
        measured = row["tokens_per_s"] > 0 and row["accepted_per_step"] > 0  # not when every generation stopped at once
        row["efficiency"] = round(throughput.efficiency(
            row["tokens_per_s"], row["accepted_per_step"], rtt, row["local_compute_ms"], row["cloud_compute_ms"]), 3) if measured else None
        row["usd_per_million_tokens"] = (
            round(throughput.cost_per_million_tokens(price_per_hour, row["tokens_per_s"]), 2) if measured else None
        )
        out.append(row)
    return out


def fits(table: list[dict]) -> dict[str, dict]:
    """The model per mode: fitted over the RTTs for split modes, a and f at RTT 0 for local ones."""
    result = {}
    for mode in dict.fromkeys(r["mode"] for r in table):
        mine = sorted((r for r in table if r["mode"] == mode), key=lambda r: r["rtt_ms"])
        measured_a = round(sum(r["accepted_per_step"] for r in mine) / len(mine), 4)
        # fixed overhead from telemetry: the measured step minus the added round trip, median over RTTs
        measured_f = median([r["step_ms"] - r["rtt_ms"] for r in mine], 3)
        entry = {"measured_a": measured_a, "measured_f_ms": measured_f,
                 "measured_f_with_between_steps_ms": median([r["step_ms"] + r["between_steps_ms"] - r["rtt_ms"] for r in mine], 3)}
        if mode in SPLIT_MODES and len(mine) >= 2:
            # The same model with a held at the measured acceptance: the mean of 1000 a / tok/s - RTT. Next to
            # the free fit it shows how much of a's misfit comes from overhead that grows with the round trip
            # (measured here: a process that slept through a longer round trip computes slower after it).
            timed = [r for r in mine if r["tokens_per_s"] > 0]
            entry["f_ms_at_measured_a"] = round(statistics.fmean(
                1000 * r["accepted_per_step"] / r["tokens_per_s"] - r["rtt_ms"] for r in timed), 3) if timed else None
            entry["measured_f_by_rtt"] = {f"{r['rtt_ms']:g}": round(r["step_ms"] - r["rtt_ms"], 3) for r in mine}
            try:
                f = throughput.fit([r["rtt_ms"] for r in mine], [r["tokens_per_s"] for r in mine])
                entry.update(fitted=True, **f.as_dict())
            except ConfigError as exc:
                entry.update(fitted=False, error=str(exc))
        else:
            tps = mine[0]["tokens_per_s"]
            entry.update(fitted=False, a=measured_a, f_ms=round(1000 * measured_a / tps, 3) if tps else None)
        result[mode] = entry
    return result


def _fit_of(entry: dict) -> throughput.Fit | None:
    if not entry.get("fitted"):
        return None
    return throughput.Fit(entry["a"], entry["f_ms"], entry["points"], entry["max_residual_ms"])


def projection(model: dict[str, dict], rtts_ms: list[float]) -> list[dict]:
    fitted = {m: f for m, e in model.items() if (f := _fit_of(e)) is not None}
    return throughput.project(fitted, rtts_ms) if fitted else []


def break_even(model: dict[str, dict], table: list[dict], rtts_ms: list[float]) -> list[dict]:
    """a* for each speculative mode at each RTT against split sequential, with the measured a where there is one."""
    seq = model.get("split-sequential", {})
    if not seq.get("fitted"):
        return []
    out = []
    for mode, entry in model.items():
        if mode not in SPLIT_MODES or mode == "split-sequential" or not entry.get("fitted"):
            continue
        for rtt in rtts_ms:
            a_star = throughput.break_even_acceptance(rtt, entry["f_ms"], seq["f_ms"])
            measured = next((r["accepted_per_step"] for r in table if r["mode"] == mode and r["rtt_ms"] == rtt), None)
            out.append({"mode": mode, "rtt_ms": rtt, "break_even_a": round(a_star, 3), "measured_a": measured,
                        "pays": None if measured is None else measured > a_star})
    return out


def checks(model: dict[str, dict], probe_rtt_ms: dict[str, list[float]]) -> list[dict]:
    """The issue's pass/fail checks, computed from the measurements (never asserted)."""
    out = []
    seq = model.get("split-sequential", {})
    if seq.get("fitted"):
        out.append(throughput.check("fitted f of split-sequential vs measured fixed overhead per step (ms)",
                                    seq["f_ms"], seq["measured_f_ms"], FIT_TOLERANCE))
    for rtt, samples in probe_rtt_ms.items():
        if float(rtt) > 0 and samples:
            out.append(throughput.check(f"probe round trip (median of {len(samples)}) vs emulated {rtt} ms",
                                        statistics.median(samples), float(rtt), PROBE_TOLERANCE))
    return out


def summarize(raw: dict, price_per_hour: float, projection_rtts: list[float]) -> dict:
    table = rows(raw["runs"], price_per_hour)
    model = fits(table)
    swept = sorted({r["rtt_ms"] for r in table if r["mode"] in SPLIT_MODES})
    outside = [r for r in projection_rtts if r not in swept]
    probe = {rtt: {"median_ms": median(s, 3), "p90_ms": round(statistics.quantiles(s, n=10)[-1], 3) if len(s) > 1 else None}
             for rtt, s in raw["probe_rtt_ms"].items()}
    return {
        "rows": table,
        "model": model,
        "projection": projection(model, outside),
        "break_even": break_even(model, table, sorted(set(swept) | set(outside))),
        "probe": probe,
        "checks": checks(model, raw["probe_rtt_ms"]),
        "gpu_price_per_hour": price_per_hour,
        "projection_rtts": projection_rtts,
    }
