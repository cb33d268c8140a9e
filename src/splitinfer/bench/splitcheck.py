"""A split on one host, on token ids: the cloud half on a device (as CUDA graphs there: `--graphs`), the trusted
half on this CPU (or `--local-device cuda`: both halves on the GPU), an emulated round trip between them; sequential and tree decoding of the same prompts, and whether they are identical.

    python -m splitinfer.bench.splitcheck --shards SHARDS --device cuda --dtype bfloat16 --rtt-ms 80 --out split.json

For shards without a tokenizer (synthetic ones, model/synthetic.py: their text is noise, their timing is
the model's), where `bench spec` cannot run: prompts are seeded random token ids. A `splitinfer serve` child
holds the cloud shard on `--device`, behind a `splitinfer wan` child adding the round trip; this process is
the client (the local shard on the CPU, `--threads` torch threads). Every strategy runs on every prompt
after one warm-up generation; each generation's tokens are compared with sequential's on the same prompt
(greedy decoding must be token-identical; a difference is reported with its position, never hidden).

The defaults are float32 on both sides and on the wire: a block of many rows and one of a single row round
differently in bfloat16 (GPU matrix kernels are chosen by shape), and random weights spread their logits
thin (near-uniform over the vocabulary, so the top two are often close), so a bfloat16 split would flip
near-ties that say nothing about the split; float32 leaves only last-bit differences. The bfloat16 step is
timed by bench/devicestep.py.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.graphs import MODES as GRAPH_MODES
from ..options import Opt, check_args

STAT_KEYS = ("cloud_compute", "local_compute", "round_trip")


def generation_record(strategy: str, prompt: int, g) -> dict:
    s = g.stats
    return {"strategy": strategy, "prompt": prompt, "token_ids": g.token_ids, "tokens": len(g.token_ids),
            "tokens_per_s": s["tokens_per_s"], "steps": s["steps"],
            "mean_accepted_per_step": s.get("mean_accepted_per_step"),
            "median_ms": {k: s["median_ms"].get(k) for k in STAT_KEYS}}


def compare(runs: list[dict]) -> list[dict]:
    """Every non-sequential generation against sequential's on the same prompt: identical, or where not."""
    reference = {r["prompt"]: r["token_ids"] for r in runs if r["strategy"] == "sequential"}
    checks = []
    for r in runs:
        if r["strategy"] == "sequential":
            continue
        ref = reference[r["prompt"]]
        first = next((i for i, (a, b) in enumerate(zip(r["token_ids"], ref)) if a != b),
                     None if len(r["token_ids"]) == len(ref) else min(len(ref), len(r["token_ids"])))
        checks.append({"strategy": r["strategy"], "prompt": r["prompt"], "identical": first is None,
                       "first_different_token": first})
    return checks


def run(shards: Path, device: str, dtype: str, rtt_ms: float, prompts: int, prompt_tokens: int, tokens: int,
        strategies: list[str], threads: int, wire_dtype: str, log=print, graphs: str = "auto",
        local_device: str = "cpu") -> dict:
    from ..clients import open_client
    from ..launch import cloud_server, wan_proxy
    from ..local.session import ClientConfig
    from .batching import random_prompt_ids

    torch.set_num_threads(threads)
    manifest = json.loads((shards / "local" / "manifest.json").read_text())
    extra = ("--device", device, "--dtype", dtype, "--graphs", graphs)
    runs = []
    t0 = time.monotonic()
    with cloud_server(shards / "cloud", extra=extra, ready_timeout_s=900.0) as (url, _), wan_proxy(url, rtt_ms) as wan:
        log(f"split: server ready in {time.monotonic() - t0:.0f} s")
        client = open_client(shard=shards / "local", server=wan, allow_public_weights=True, device=local_device,
                             config=ClientConfig(wire_dtype=wire_dtype))
        ids = random_prompt_ids(client.local.config.vocab_size, [prompt_tokens] * prompts, seed=1)
        client.generate(ids[0], max_new_tokens=4, strategy="sequential", stop_ids=set())  # warm-up, discarded
        for i, prompt in enumerate(ids):
            for strategy in strategies:
                g = client.generate(prompt, max_new_tokens=tokens, strategy=strategy, stop_ids=set())
                runs.append(generation_record(strategy, i, g))
                log(f"split {strategy:<12} prompt {i}: {g.stats['tokens_per_s']:.2f} tok/s, "
                    f"{g.stats.get('mean_accepted_per_step', 0):.2f} tokens a step")
    checks = compare(runs)
    return {"model_id": manifest["model_id"], "synthetic": bool(manifest.get("synthetic")), "cloud_device": device,
            "cloud_dtype": dtype, "cloud_graphs": graphs, "local_device": local_device, "local_dtype": manifest["dtype"], "wire_dtype": client.config.wire_dtype,
            "rtt_ms": rtt_ms, "threads": threads, "prompt_tokens": prompt_tokens, "max_new_tokens": tokens,
            "strategies": strategies, "runs": runs, "checks": checks,
            "identical": f"{sum(c['identical'] for c in checks)} of {len(checks)}",
            "exact": all(c["identical"] for c in checks)}


@dataclass(frozen=True)
class SplitCheckOptions:
    """The defaults of `python -m splitinfer.bench.splitcheck` (module docstring: why float32)."""

    device: str = "cuda"  # the cloud server's device
    dtype: str = "float32"  # the cloud server's compute dtype
    wire_dtype: str = "float32"  # hidden states on the wire
    rtt_ms: float = 80.0  # the emulated round trip
    prompts: int = 3  # seeded random prompts
    prompt_tokens: int = 48  # tokens in each
    max_new_tokens: int = 32  # tokens generated for each, by every strategy
    strategies: str = "sequential,tree-nohead"  # comma-separated; sequential always runs
    threads: int = 1  # torch threads of this process (the trusted half)
    graphs: str = "auto"  # the server's --graphs (auto: CUDA graphs on a CUDA device; static: uncaptured)
    local_device: str = "cpu"  # where the trusted half runs (cuda: both halves on the GPU, the paper's setup)


OPTIONS = tuple(Opt(f) for f in ("device", "dtype", "wire_dtype", "rtt_ms", "prompts", "prompt_tokens", "max_new_tokens",
                                 "strategies", "threads", "local_device")) + (Opt("graphs", choices=GRAPH_MODES),)


def main(argv: list[str] | None = None) -> int:
    args = check_args(__doc__, ("--shards", "a prepared OUT directory (OUT/local and OUT/cloud)"), SplitCheckOptions,
                      OPTIONS, argv)
    strategies = [s for s in args.strategies.split(",") if s]
    if "sequential" not in strategies:
        strategies.insert(0, "sequential")
    result = run(Path(args.shards), args.device, args.dtype, args.rtt_ms, args.prompts, args.prompt_tokens,
                 args.max_new_tokens, strategies, args.threads, args.wire_dtype,
                 log=lambda line: print(line, file=sys.stderr, flush=True), graphs=args.graphs, local_device=args.local_device)
    result["command"] = "python -m splitinfer.bench.splitcheck " + " ".join(sys.argv[1:] if argv is None else argv)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"split: {result['identical']} identical to sequential", file=sys.stderr)
    return 0 if result["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
