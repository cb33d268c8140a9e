"""Threat T6, measured: what a network observer with TLS intact learns from message sizes and times, with and
without padding (wire/padding.py, `--pad-rows`).

The traffic is real: a `splitinfer serve` child on loopback (optionally behind the WAN emulator) and a split
client in this process, the default tree strategy, greedy; a tap at the client's transport
(`RemoteMiddle.tap`) records the direction, time and byte length of every message, and nothing else.
Per padding setting, three sets of generations:
  own     the held-out prompts (data/heldout.jsonl): traffic the attacker generated itself;
  known   the benchmark prompts (data/prompts.jsonl), run by the attacker: the N documents it knows;
  victim  the benchmark prompts again, a fresh run: the traffic under attack.
Accepted counts and categories are attacked in two folds (train on own, test on victim; train on known, test
on own), so no attacker is tested on a prompt it trained on; documents: known against victim. The attacks
themselves are traffic.py's. Rows have the audit's fields (audit.py), with threat T6, side = what is
recovered (accepted, category, document) and defence = the padding.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from . import stats
from ..wire.padding import PadSetting
from .traffic import (
    SIZES, TIMING, Scored, Trace, attack_category, attack_document, attack_steps, attack_steps_lookup,
)

log = logging.getLogger("splitinfer.privacy")
WHAT = {"accepted": "the accepted count of each decode step", "category": "the prompt's category (5)",
        "document": "which of the N known documents is processed"}


@dataclass(frozen=True)
class MetadataConfig:
    # padding settings measured (wire/padding.py's PadSetting names: rows, then steps and timing); "0" is none.
    # 33 rows is the largest tree block (ControllerConfig.max_nodes 32 drafts + the root), so every decode
    # step pads to the same size.
    pad_rows: tuple[str, ...] = ("0", "33")
    # every padded setting also pads prompt messages to this many rows (ClientConfig.pad_prompt_rows); 0: not
    pad_prompt_rows: int = 0
    max_new_tokens: int = 64  # per generation
    step_neighbours: int = 5  # k of the per-step attacker
    generation_neighbours: int = 3  # k of the category attacker
    rtt_ms: float = 0.0  # round trip the WAN emulator adds between client and server; 0: loopback, no emulator


def prompt_sets() -> dict[str, list[dict]]:
    """The attacker's own prompts and the benchmark prompts, from the package's data."""
    data = resources.files("splitinfer.data")

    def read(name: str) -> list[dict]:
        return [json.loads(x) for x in data.joinpath(name).read_text().splitlines() if x.strip()]

    return {"own": read("heldout.jsonl"), "benchmark": read("prompts.jsonl")}


def record(client, tap: list, prompt: dict, max_new_tokens: int) -> Trace:
    """One greedy tree generation through `client`, as the tap saw it, with its per-step truth beside it."""
    tap.clear()
    result = client.generate(prompt["prompt"], max_new_tokens=max_new_tokens, chat=prompt.get("chat", True),
                             strategy="tree")
    kinds = [s["kind"] for s in result.steps]
    order = {"prefill": 0, "decode": 1, "cover": 2}
    if set(kinds) - set(order) or kinds != sorted(kinds, key=order.get):
        raise RuntimeError(f"expected prefill steps, decode steps, then cover exchanges (one block in flight), got {kinds}.")
    return Trace(prompt["id"], prompt["category"], tuple(tap), tuple(s["accepted"] for s in result.steps
                                                                     if s["kind"] == "decode"),
                 kinds.count("prefill"))


def collect_traffic(shards: Path, config: MetadataConfig) -> dict[str, dict[str, list[Trace]]]:
    """{setting key: {"own", "known", "victim": traces}} from real generations over a loopback server."""
    from ..launch import cloud_server, wan_proxy

    sets = prompt_sets()
    traffic: dict[str, dict[str, list[Trace]]] = {}
    with ExitStack() as stack:
        url, _ = stack.enter_context(cloud_server(shards / "cloud", cpu=1, threads=1))
        if config.rtt_ms:
            url = stack.enter_context(wan_proxy(url, config.rtt_ms, cpu=1))
        for setting in dict.fromkeys(PadSetting.parse(p) for p in config.pad_rows):
            client, tap = _tapped_client(shards, url, setting, config.pad_prompt_rows if setting.rows else 0)
            client.generate(sets["own"][0]["prompt"], max_new_tokens=8, strategy="tree")  # warm up, not recorded
            runs = (("own", sets["own"]), ("known", sets["benchmark"]), ("victim", sets["benchmark"]))
            traffic[setting.key] = {name: [record(client, tap, p, config.max_new_tokens) for p in prompts]
                                    for name, prompts in runs}
            log.info("T6 traffic recorded with padding %s", setting.key)
    return traffic


def _tapped_client(shards: Path, url: str, setting: PadSetting, prompt_rows: int):
    """(a client of `url` with this padding, the list its WebSocket's messages are recorded in)."""
    from ..clients import open_client
    from ..local.middle import RemoteMiddle
    from ..local.session import ClientConfig

    client = open_client(shard=shards / "local", server=url, allow_public_weights=True,
                         config=ClientConfig(pad_prompt_rows=prompt_rows, in_flight=1, **setting.client_fields()))
    tap: list = []
    inner = client.make_middle

    def tapped():
        middle = inner()
        if not isinstance(middle, RemoteMiddle):
            raise RuntimeError("the metadata audit records one server's WebSocket; pass one server URL.")
        middle.tap = tap
        return middle

    client.make_middle = tapped
    return client, tap


def _row(what: str, attacker: str, pad: PadSetting, scored: list[Scored], depth: int, n_boot: int, extra: dict) -> dict:
    """An audit row (audit.py's fields) pooled over the folds in `scored`."""
    hits = np.concatenate([s.hits for s in scored])
    chance_hits = np.concatenate([s.chance_hits for s in scored])
    docs = np.concatenate([s.docs for s in scored])
    chance = scored[0].chance
    baseline = chance if what == "document" else float(chance_hits.mean())
    return {
        "side": what, "depth": depth, "threat": "T6", "attacker": attacker,
        "defence": _defence(pad, extra.get("pad_prompt_rows", 0)),
        "top1": float(hits.mean()), "top1_ci": stats.bootstrap_ci(hits, docs, n_boot),
        "top5": None, "top5_ci": None,
        "baseline_top1": baseline, "baseline_top1_ci": stats.bootstrap_ci(chance_hits, docs, n_boot),
        "baseline_top5": None, "majority_token": None if what == "document" else _plain(chance),
        "ceiling": 1.0, "train_type_coverage": float(np.mean([s.train_coverage for s in scored])),
        "n_tokens": int(len(hits)), "n_documents": int(len(np.unique(docs))),
        "exact_sequence": None, "canary_top1": None, "canary_tokens": 0, "by_frequency": {},
        "eval_set": "test", "outcomes_top1_hex": stats.pack(hits),
        "recovers": WHAT[what], "pad_rows": pad.rows, "pad_steps": pad.steps, "pad_hold_ms": pad.hold_ms,
        "pad_think_ms": pad.think_ms, "n_train": sum(s.n_train for s in scored), **extra,
    }


def _defence(pad: PadSetting, prompt_rows: int) -> str:
    """A setting in words: "none", or "padding 33 rows, prompts 256, steps 64, hold 110 ms, think 50 ms"."""
    if not pad.rows:
        return "none"
    parts = [f"padding {pad.rows} rows", f"prompts {prompt_rows}" if prompt_rows else "",
             f"steps {pad.steps}" if pad.steps else "", f"hold {pad.hold_ms} ms" if pad.hold_ms else "",
             f"think {pad.think_ms} ms" if pad.think_ms else ""]
    return ", ".join(p for p in parts if p)


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def traffic_summary(traces: list[Trace]) -> dict:
    """Bytes per decode step (request + reply) and the decode steps' row counts, as the client recorded them."""
    from .traffic import exchanges

    decode = [e for t in traces for e in exchanges(t)[1 + t.prefill_exchanges:]]
    sizes = sorted({e[0] for e in decode})
    return {"bytes_per_decode_step": round(float(np.mean([e[0] + e[1] for e in decode])), 1),
            "distinct_request_sizes": len(sizes), "distinct_reply_sizes": len({e[1] for e in decode}),
            "decode_steps": len(decode), "generations": len(traces),
            "cover_exchanges": len(decode) - sum(len(t.accepted) for t in traces),  # among "decode_steps"
            "mean_accepted": round(float(np.mean([a for t in traces for a in t.accepted])), 3)}


def score(traffic: dict[str, dict[str, list[Trace]]], row_bytes: int, config: MetadataConfig, depth: int,
          n_boot: int) -> list[dict]:
    """Every T6 row: per padding, per attack, sizes alone and sizes with timing."""
    rows = []
    for key, sets in traffic.items():
        pad = PadSetting.parse(key)
        extra = traffic_summary(sets["victim"]) | {"pad_prompt_rows": config.pad_prompt_rows if pad.rows else 0}
        folds = ((sets["own"], sets["victim"]), (sets["known"], sets["own"]))
        lookup = [attack_steps_lookup(a, b, row_bytes) for a, b in folds]
        rows.append(_row("accepted", "size lookup", pad, lookup, depth, n_boot, extra))
        for features in (SIZES, TIMING):
            steps = [attack_steps(a, b, features, row_bytes, config.step_neighbours) for a, b in folds]
            rows.append(_row("accepted", f"kNN over {features}", pad, steps, depth, n_boot, extra))
            cats = [attack_category(a, b, features, config.generation_neighbours) for a, b in folds]
            rows.append(_row("category", f"kNN over {features}", pad, cats, depth, n_boot, extra))
            doc = attack_document(sets["known"], sets["victim"], features)
            rows.append(_row("document", f"nearest trace over {features}", pad, [doc], depth, n_boot, extra))
    for r in rows:
        log.info("T6 %s %s %s: %.3f (chance %.3f)", r["side"], r["attacker"], r["defence"], r["top1"],
                 r["baseline_top1"])
    return rows


def metadata_threat(shards: str | Path, config: MetadataConfig, n_boot: int = 1000) -> tuple[list[dict], dict]:
    """(T6 rows, the section's record for audit.json): traffic recorded, then attacked."""
    from ..wire.frame import WIRE_DTYPES, wire_dtype_of

    shards = Path(shards)
    manifest = json.loads((shards / "local" / "manifest.json").read_text())
    cloud = json.loads((shards / "cloud" / "manifest.json").read_text())
    hidden = json.loads((shards / "cloud" / "config.json").read_text())["hidden_size"]
    row_bytes = hidden * WIRE_DTYPES[wire_dtype_of(manifest)].itemsize
    started = time.perf_counter()
    traffic = collect_traffic(shards, config)
    rows = score(traffic, row_bytes, config, manifest["split"]["head_layers"], n_boot)
    record = {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.__dict__.items()},
              "row_bytes": row_bytes, "model": cloud.get("model_id"), "seconds": round(time.perf_counter() - started, 1),
              "traffic": {pad: {name: traffic_summary(t) for name, t in sets.items()} for pad, sets in traffic.items()},
              "folds": "accepted and category: train own -> test victim, train known -> test own; document: known -> victim",
              # the recorded traffic itself, so the attacks can be rerun on it (run_audit writes it to traffic.json)
              "traces": {pad: {name: [asdict(t) for t in ts] for name, ts in sets.items()} for pad, sets in traffic.items()}}
    return rows, record


def load_traffic(path: str | Path) -> dict[str, dict[str, list[Trace]]]:
    """The traffic a metadata audit recorded (its traffic.json), to attack again without recording."""
    data = json.loads(Path(path).read_text())
    return {str(key): {name: [Trace(t["prompt_id"], t["category"], tuple(map(tuple, t["messages"])),
                                    tuple(t["accepted"]), t["prefill_exchanges"]) for t in ts]
                       for name, ts in sets.items()} for key, sets in data.items()}


def metadata_section(result: dict) -> list[str]:
    """audit.md's T6 section: every row with its chance beside it, and what the padding costs in bytes."""
    from ..tables import left_table

    rows = [r for r in result["results"] if r["threat"] == "T6"]
    if not rows:
        return []
    info = result.get("metadata", {})
    def pct(x: float) -> str:
        return f"{100 * x:.1f}"

    lines = ["## T6: a network observer with TLS intact (message sizes and times)", "",
             f"Real traffic through a loopback `splitinfer serve` ({info.get('config', {}).get('rtt_ms', 0)} ms "
             f"added round trip), the tree strategy, greedy, {info.get('config', {}).get('max_new_tokens', '?')} "
             f"new tokens a generation; {info.get('folds', '')}. Chance: the training majority (accepted, "
             "category) or 1/N (document). Intervals: bootstrap over prompts.", ""]
    lines += left_table(
        ["defence", "recovers", "attacker", "recovered % [95% CI]", "chance %", "items / prompts",
         "bytes per decode step", "distinct request sizes"],
        [[r["defence"], r["side"], r["attacker"], f"{pct(r['top1'])} [{pct(r['top1_ci'][0])}, {pct(r['top1_ci'][1])}]",
          pct(r["baseline_top1"]), f"{r['n_tokens']} / {r['n_documents']}", r["bytes_per_decode_step"],
          r["distinct_request_sizes"]] for r in rows])
    return [*lines, ""]
