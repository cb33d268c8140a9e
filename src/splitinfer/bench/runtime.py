"""The runtime sweep behind `splitinfer bench`: added round trip x decoding mode x prompt category.

Modes: `local-only` (the whole model in this process, sequential), `local-only-pld` (the whole HF model
with transformers' prompt-lookup decoding), and `split-sequential`, `split-lookahead`, `split-tree`
through a `splitinfer serve` child behind one `splitinfer wan` emulator per round trip. Local modes have
no round trip and run once per repetition; split modes run at every RTT.

Fair on a 2-core machine: the client (and the local-only models) run in this process pinned to core 0
with one torch thread; the cloud server runs pinned to core 1 with one thread, and the WAN emulators
share core 1 (they only forward bytes while the server waits). Configurations are interleaved within
each repetition, so drift on a shared machine hits them alike; one warm-up generation per configuration
is discarded. This module only measures and records per-generation figures from the client's and
server's telemetry; summary.py turns them into medians, fits and checks.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ..launch import cloud_server, pin_self, wan_proxy
from ..clients import open_client
from ..local.client import SplitClient
from ..local.middle import RemoteMiddle
from ..local.session import ClientConfig
from ..progress import progress
from ..telemetry import step_summary

LOCAL_MODES = ("local-only", "local-only-pld")
SPLIT_MODES = ("split-sequential", "split-lookahead", "split-tree")
MODES = LOCAL_MODES + SPLIT_MODES


@dataclass(frozen=True)
class SweepConfig:
    rtts_ms: tuple[float, ...] = (0.0, 20.0, 40.0, 80.0, 150.0)  # added round trips for the split modes
    modes: tuple[str, ...] = MODES
    max_new_tokens: int = 40  # per generation (fewer when the model stops early)
    per_category: int = 1  # prompts taken from each category of the prompt file
    repeats: int = 3  # measured repetitions after one warm-up per configuration
    probes: int = 20  # small probe messages per RTT (the emulated-RTT check)
    pld_tokens: int = 10  # transformers' prompt_lookup_num_tokens


# Checks that the whole pipeline works in minutes; too few samples for figures worth quoting.
QUICK = SweepConfig(rtts_ms=(0.0, 40.0, 80.0), max_new_tokens=16, repeats=1, probes=10)


def load_prompts(path: str | None, per_category: int) -> list[dict]:
    """Rows {"id", "category", "prompt", ...} of a JSONL file, the packaged benchmark set (None) or MT-Bench's
    first turns ("mt-bench", from its installed wheel), at most `per_category` from each category."""
    if path == "mt-bench":
        from ..drafter.chat import mtbench_prompts

        return _per_category(mtbench_prompts(), per_category)
    if path:
        text = Path(path).read_text()
    else:
        text = resources.files("splitinfer.data").joinpath("prompts.jsonl").read_text()
    return _per_category([json.loads(line) for line in text.splitlines() if line.strip()], per_category)


def _per_category(rows: list[dict], per_category: int) -> list[dict]:
    chosen: dict[str, list[dict]] = {}
    for row in rows:
        bucket = chosen.setdefault(row["category"], [])
        if len(bucket) < per_category:
            bucket.append(row)
    return [r for bucket in chosen.values() for r in bucket]


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def record_from_steps(stats: dict, steps: list[dict]) -> dict:
    """Per-generation figures from a Generation's telemetry: means per decode step, so parts add up."""
    steps_n = sum(s["kind"] == "decode" for s in steps)
    parts = step_summary(steps, average=_mean)
    wall_ms = stats["decode_s"] * 1e3 / steps_n if steps_n else 0.0
    return {
        "tokens_per_s": stats["tokens_per_s"],
        "generated": stats["generated_tokens"],
        "steps": steps_n,
        "accepted_per_step": parts["accepted"],
        "bytes_per_step": parts["bytes"],
        **{f"{part}_ms": parts[part] for part in
           ("network", "cloud_compute", "server_other", "local_compute", "serialize", "step")},
        # decode wall time per step minus the measured step: drafting and bookkeeping between steps
        "between_steps_ms": max(wall_ms - parts["step"], 0.0),
        "prefill_ms": stats["prefill_ms"],
    }


class PromptLookupRunner:
    """transformers' prompt-lookup decoding on the whole model, timed per model call (local-only-pld)."""

    def __init__(self, shards: Path, client: SplitClient, pld_tokens: int):
        from ..model.shards import load_whole_hf

        self.model = load_whole_hf(shards)
        self.client = client
        self.pld_tokens = pld_tokens
        self.call_ends: list[float] = []
        original = self.model.forward

        def timed_forward(*args, **kwargs):
            out = original(*args, **kwargs)
            self.call_ends.append(time.perf_counter())
            return out

        self.model.forward = timed_forward

    def generate(self, prompt: str, chat: bool, max_new_tokens: int) -> tuple[list[int], dict]:
        ids = self.client.encode_prompt(prompt, chat)
        self.call_ends = []
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                prompt_lookup_num_tokens=self.pld_tokens, eos_token_id=sorted(self.client.stop_ids()) or None,
            )
        end = time.perf_counter()
        tokens = out[0, len(ids):].tolist()
        calls = max(len(self.call_ends) - 1, 1)  # the first call is the prefill, which yields the first token
        decode_ms = (end - self.call_ends[0]) * 1e3
        per_call = decode_ms / calls
        record = {
            "tokens_per_s": round((len(tokens) - 1) / (decode_ms / 1e3), 3) if len(tokens) > 1 else 0.0,
            "generated": len(tokens), "steps": calls, "accepted_per_step": (len(tokens) - 1) / calls,
            "bytes_per_step": 0.0, "network_ms": 0.0, "cloud_compute_ms": 0.0, "server_other_ms": 0.0,
            # the whole model in one call; transformers' own drafting is inside this time
            "local_compute_ms": per_call, "serialize_ms": 0.0, "step_ms": per_call, "between_steps_ms": 0.0,
            "prefill_ms": None,
        }
        return tokens, record


def probe_rtt(url: str, count: int, size: int = 1300) -> list[float]:
    """Round trips (ms) of `count` decode-sized probe messages each way on an idle connection."""
    middle = RemoteMiddle.prober(url)
    try:
        middle.probe(size, size)  # connection warm-up
        return [middle.probe(size, size) for _ in range(count)]
    finally:
        middle.close(end_session=False)


def run_sweep(shards: Path, prompts: list[dict], config: SweepConfig, log=print) -> dict:
    """Every configuration, interleaved per repetition; returns raw per-generation runs and probe RTTs."""
    pin_self(0)
    local_only = open_client(local_only=True, shards=shards)
    pld = PromptLookupRunner(shards, local_only, config.pld_tokens) if "local-only-pld" in config.modes else None
    runs: list[dict] = []
    probes: dict[str, list[float]] = {}
    with ExitStack() as stack:
        url, _ = stack.enter_context(cloud_server(shards / "cloud", cpu=1, threads=1))
        split_modes = [m for m in config.modes if m in SPLIT_MODES]
        configs: list[tuple[str, float]] = [(m, 0.0) for m in config.modes if m in LOCAL_MODES]
        clients: dict[float, SplitClient] = {}
        for rtt in config.rtts_ms if split_modes else ():
            target = url if rtt == 0 else stack.enter_context(wan_proxy(url, rtt, cpu=1))
            probes[f"{rtt:g}"] = probe_rtt(target, config.probes)
            clients[rtt] = open_client(shards / "local", target, ClientConfig(), allow_public_weights=True,
                                       checks=False)
            configs += [(m, rtt) for m in split_modes]

        def one(mode: str, rtt: float, prompt: dict, max_new_tokens: int) -> tuple[list[int], dict]:
            chat = prompt.get("chat", True)
            if mode == "local-only-pld":
                return pld.generate(prompt["prompt"], chat, max_new_tokens)
            if mode == "local-only":
                g = local_only.generate(prompt["prompt"], max_new_tokens, chat=chat, strategy="sequential")
            else:
                g = clients[rtt].generate(prompt["prompt"], max_new_tokens, chat=chat, strategy=mode.split("-", 1)[1])
            return g.token_ids, record_from_steps(g.stats, g.steps)

        for mode, rtt in configs:  # warm-up: first calls allocate buffers and fill caches
            one(mode, rtt, prompts[0], 8)
        bar = progress(total=config.repeats * len(configs) * len(prompts), desc="bench", unit="gen")
        for rep in range(config.repeats):
            for mode, rtt in configs:
                for p in prompts:
                    tokens, record = one(mode, rtt, p, config.max_new_tokens)
                    bar.update(1)
                    runs.append({"mode": mode, "rtt_ms": rtt, "repeat": rep, "prompt_id": p["id"],
                                 "category": p["category"], "token_ids": tokens, **record})
                    log(f"[{rep}] {mode:<16} @{rtt:>4g} ms {p['id']:<14} {record['tokens_per_s']:7.2f} tok/s "
                        f"{record['accepted_per_step']:.2f} acc/step")
        bar.close()
    return {"runs": runs, "probe_rtt_ms": probes, "hidden_size": local_only.local.config.hidden_size}
