"""Prefill over a bandwidth-limited link: how long a long prompt's hidden states take, against the floor.

Two measurements, both through a `splitinfer wan` emulator with an added RTT and a per-direction
bandwidth limit in front of a `splitinfer serve` child:

- wire: the exact messages a split prefill of N tokens sends (512-row Steps, sizes from the real
  encoder) and the Results it gets back (a prefill returns every row: the local tail layers need them
  for their cache), carried as Probe messages, so the server does no compute. This isolates the link and
  works for any N, including 32k tokens, beyond SmolLM2's 8192-token context.
- real: an actual split prefill (head -> cloud -> tail, compute included) for prompts the model can take
  and that finish in reasonable time on this CPU (by default up to 1024 tokens).

Floors: `sequential` = sum over chunks of (RTT + (up + down) * 8 / bandwidth), what one-chunk-at-a-time
can reach; `link` = max(total up, total down) * 8 / bandwidth + RTT, what perfect pipelining could reach.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from ..launch import wan_proxy
from ..clients import open_client
from ..local.client import SplitClient
from ..local.middle import RemoteMiddle
from ..local.session import ClientConfig
from ..wire.frame import DEFAULT_WIRE_DTYPE
from .plan import message_bytes

CHUNK = ClientConfig().prefill_chunk


def chunk_plan(tokens: int, hidden: int, wire_dtype: str = DEFAULT_WIRE_DTYPE, chunk: int = CHUNK) -> list[dict]:
    """Rows and exact message sizes of every prefill chunk of a `tokens`-token prompt."""
    plan = []
    for start in range(0, tokens, chunk):
        rows = min(chunk, tokens - start)
        plan.append({
            "rows": rows,
            "bytes_up": message_bytes(rows, hidden, wire_dtype, start, "step"),
            "bytes_down": message_bytes(rows, hidden, wire_dtype, start, "result"),
        })
    return plan


def floors_ms(chunks: list[dict], rtt_ms: float, bandwidth_mbit: float) -> dict:
    byte_ms = 8.0 / (bandwidth_mbit * 1e3)  # ms per byte
    up = sum(c["bytes_up"] for c in chunks)
    down = sum(c["bytes_down"] for c in chunks)
    return {
        "sequential_floor_ms": round(sum(rtt_ms + (c["bytes_up"] + c["bytes_down"]) * byte_ms for c in chunks), 2),
        "link_floor_ms": round(max(up, down) * byte_ms + rtt_ms, 2),
        "bytes_up": up,
        "bytes_down": down,
    }


def wire_prefill(url: str, tokens: int, hidden: int, rtt_ms: float, bandwidth_mbit: float) -> dict:
    chunks = chunk_plan(tokens, hidden)
    middle = RemoteMiddle.prober(url)
    try:
        middle.probe(16, 16)  # connect first: the handshake is not part of a prefill
        t0 = time.perf_counter()
        trace = []
        for c in chunks:
            start = (time.perf_counter() - t0) * 1e3
            middle.probe(c["bytes_up"], c["bytes_down"])
            trace.append({**c, "start_ms": round(start, 2), "end_ms": round((time.perf_counter() - t0) * 1e3, 2)})
        total = (time.perf_counter() - t0) * 1e3
    finally:
        middle.close(end_session=False)
    floors = floors_ms(chunks, rtt_ms, bandwidth_mbit)
    return {"tokens": tokens, "kind": "wire", "chunks": len(chunks), "total_ms": round(total, 2), **floors,
            "vs_sequential_floor": round(total / floors["sequential_floor_ms"], 3),
            "vs_link_floor": round(total / floors["link_floor_ms"], 3), "trace": trace}


def real_prefill(client: SplitClient, tokens: int, rtt_ms: float, bandwidth_mbit: float) -> dict:
    """A real split prefill of `tokens` random token ids (compute included); one generated token."""
    rng = random.Random(tokens)
    vocab = client.local.config.vocab_size
    ids = [rng.randrange(vocab) for _ in range(tokens)]
    g = client.generate(ids, max_new_tokens=1, strategy="sequential", stop_ids=set())
    steps = [s for s in g.steps if s["kind"] == "prefill"]
    floors = floors_ms([{"bytes_up": s["bytes_up"], "bytes_down": s["bytes_down"]} for s in steps], rtt_ms, bandwidth_mbit)
    trace = [{k: round(s[k], 2) if isinstance(s[k], float) else s[k]
              for k in ("rows", "bytes_up", "bytes_down", "round_trip_ms", "cloud_compute_ms", "local_ms")} for s in steps]
    return {"tokens": tokens, "kind": "real", "chunks": len(steps), "total_ms": g.stats["prefill_ms"], **floors,
            "cloud_compute_ms": round(sum(s["cloud_compute_ms"] for s in steps), 2),
            "local_compute_ms": round(sum(s["local_ms"] for s in steps), 2),
            "vs_sequential_floor": round(g.stats["prefill_ms"] / floors["sequential_floor_ms"], 3),
            "vs_link_floor": round(g.stats["prefill_ms"] / floors["link_floor_ms"], 3), "trace": trace}


def run_prefill(shards: Path, url: str, sizes: tuple[int, ...], rtt_ms: float, bandwidth_mbit: float,
                real_max_tokens: int, log=print) -> dict:
    """Wire prefill for every size, and a real one for sizes up to `real_max_tokens`, behind one limited link."""
    results = []
    with wan_proxy(url, rtt_ms, cpu=1, bandwidth_mbit=bandwidth_mbit) as limited:
        client = open_client(shards / "local", limited, ClientConfig(), allow_public_weights=True, checks=False)
        hidden = client.local.config.hidden_size
        for n in sizes:
            results.append(wire_prefill(limited, n, hidden, rtt_ms, bandwidth_mbit))
            log(f"prefill wire {n:>6} tokens: {results[-1]['total_ms']:.0f} ms "
                f"(link floor {results[-1]['link_floor_ms']:.0f} ms)")
            limit = getattr(client.local.config, "max_position_embeddings", None) or n + 1
            if n <= real_max_tokens and n < limit:
                results.append(real_prefill(client, n, rtt_ms, bandwidth_mbit))
                log(f"prefill real {n:>6} tokens: {results[-1]['total_ms']:.0f} ms")
    return {"rtt_ms": rtt_ms, "bandwidth_mbit": bandwidth_mbit, "chunk_rows": CHUNK, "results": results}
