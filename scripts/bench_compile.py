"""Does torch.compile make a decode step faster on this CPU? Eager against compiled, per step and per generation.

For each side of the split (bench/step.py's `Side`: the cloud's middle layers; the local head and tail
layers with the final norm and LM head), each context and each block of q rows: the step as splitinfer
runs it (eager, inference mode, model/rows.py's packed products) against a copy of the same layers whose
`run_layers` (and the local side's norm and LM head) go through `torch.compile` (inductor, dynamic shapes,
freezing with weight prepacking: the CPU recipe), on its own caches filled with the same context. Both run
the same real activations, in a shuffled order every repetition after a warm-up; medians reported, with
the compile time of the first block of each row count, and the largest difference between the outputs.

Usage: python scripts/bench_compile.py --shards shards/smollm2 --out notes/bench/compile

The compiled copy runs under no_grad, not inference mode: inductor's freezing cannot take inference
tensors ("Cannot set version_counter for inference tensor"), which is what the runtime's caches are.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch._dynamo
import torch._inductor.config as inductor
from torch import nn

from splitinfer.bench.step import Side, build_sides
from splitinfer.model.stack import LayerStack
from splitinfer.tables import table


def plain_linears(module: nn.Module) -> nn.Module:
    """Every RowsLinear back to nn.Linear: inductor packs the weights itself."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub.__class__ = nn.Linear
    return module


class CompiledSide:
    """A copy of `side`'s layers with compiled passes and caches of its own, filled with the same context."""

    def __init__(self, side: Side):
        self.side = side
        self.stacks = [plain_linears(copy.deepcopy(stack)) for stack in side.stacks]
        for stack in self.stacks:
            stack.run_layers = torch.compile(functools.partial(LayerStack.run_layers.__wrapped__, stack), dynamic=True)
        self.tail = None
        if side.tail is not None:
            norm, head = (plain_linears(copy.deepcopy(m)) for m in side.tail)
            self.tail = torch.compile(lambda h: head(norm(h)), dynamic=True)
        self.caches = [stack.new_cache() for stack in self.stacks]
        with torch.no_grad():
            prompt = side.inputs[:, : side.context]
            allowed = np.tril(np.ones((side.context, side.context), dtype=bool))
            for stack, cache in zip(self.stacks, self.caches):
                prompt = LayerStack.forward.__wrapped__(stack, prompt, torch.arange(side.context), allowed, cache)
                cache.commit_all()

    def ours(self, q: int, hidden: torch.Tensor, keep: bool = False) -> torch.Tensor:
        """One block after the committed rows; `keep` commits it (the context grows), else it is dropped."""
        start = self.caches[0].length
        positions = torch.arange(start, start + q)
        allowed = np.tril(np.ones((q, q), dtype=bool))
        with torch.no_grad():
            for stack, cache in zip(self.stacks, self.caches):
                hidden = LayerStack.forward.__wrapped__(stack, hidden, positions, allowed, cache)
                cache.commit_all() if keep else cache.truncate(cache.length)
            return hidden if self.tail is None else self.tail(hidden)


def eager_decode(side: Side, q: int, hidden: torch.Tensor) -> None:
    """The runtime's step on `side`'s own caches, committing the block (the context grows)."""
    start = side.caches[0].length
    allowed = np.tril(np.ones((q, q), dtype=bool))
    with torch.inference_mode():
        for stack, cache in zip(side.stacks, side.caches):
            hidden = stack(hidden, torch.arange(start, start + q), allowed, cache)
            cache.commit_all()
        if side.tail is not None:
            side.tail[1](side.tail[0](hidden))


def decode(sides, compiled, q: int, blocks: int) -> list[dict]:
    """Blocks of q rows committed one after another (each step's context one block longer, as in decoding),
    eager and compiled alternating; ms of every block, to show recompilation as the cache grows."""
    out = []
    for side, comp in zip(sides, compiled):
        if side.context != min(s.context for s in sides):
            continue
        times = {"eager": [], "compiled": []}
        for _ in range(blocks):
            hidden = side.block(q)
            t0 = time.perf_counter()
            eager_decode(side, q, hidden)
            times["eager"].append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            comp.ours(q, hidden, keep=True)
            times["compiled"].append((time.perf_counter() - t0) * 1e3)
        row = {"side": side.name, "start_context": side.context, "rows": q, "blocks": blocks}
        for name, ms in times.items():
            row[f"{name}_median_ms"] = round(statistics.median(ms), 2)
            row[f"{name}_max_ms"] = round(max(ms), 1)
        out.append(row)
        print(row, flush=True)
    return out


def first_calls(sides, compiled, rows) -> list[dict]:
    """Compile every (side, q) once: seconds of the first call and the outputs' largest difference."""
    out = []
    for side, comp in zip(sides, compiled):
        for q in rows:
            hidden = side.block(q)
            t0 = time.perf_counter()
            got = comp.ours(q, hidden)
            seconds = time.perf_counter() - t0
            ref = side.ours(q, hidden)
            row = {"side": side.name, "context": side.context, "rows": q, "first_call_s": round(seconds, 1),
                   "max_abs_diff": float((got - ref).abs().max())}
            if side.tail is not None:
                row["argmax_agree"] = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
            out.append(row)
            print(row, flush=True)
    return out


def time_both(sides, compiled, rows, repeats: int) -> dict:
    impls = {"eager": sides, "compiled": compiled}
    configs = [(i, q, name) for i in range(len(sides)) for q in rows for name in impls]
    times = {c: [] for c in configs}
    rng = random.Random(0)
    for round_ in range(repeats + 1):
        rng.shuffle(configs)
        for i, q, name in configs:
            hidden = sides[i].block(q)
            t0 = time.perf_counter()
            impls[name][i].ours(q, hidden)
            if round_:
                times[(i, q, name)].append((time.perf_counter() - t0) * 1e3)
    return times


def generations_ab(shards: Path, per_category: int, tokens: int, min_rows: int) -> dict:
    """Whole generations in one process (the cloud stack in-process, as local-only runs it), eager against
    compiled cloud, each pair back to back on one prompt, sequential and tree: decode tok/s and the tokens."""
    from splitinfer.bench.runtime import load_prompts
    from splitinfer.clients import open_client
    from splitinfer.model.shards import load_cloud, load_local

    local = load_local(shards / "local")
    clouds = {"eager": load_cloud(shards / "cloud"), "compiled": load_cloud(shards / "cloud")}
    started = time.perf_counter()
    clouds["compiled"].stack.compile_passes(min_rows)
    clouds["compiled"].stack.warm_up(max(min_rows, 2))
    compile_s = time.perf_counter() - started
    clients = {}
    for name, cloud in clouds.items():
        clients[name] = open_client(local_only=True, shards=shards, halves=(local, cloud))
    runs = []
    for prompt in load_prompts(None, per_category):
        for strategy in ("sequential", "tree"):
            for name, client in clients.items():
                g = client.generate(prompt["prompt"], max_new_tokens=tokens, strategy=strategy)
                runs.append({"prompt": prompt["id"], "strategy": strategy, "cloud": name,
                             "tokens_per_s": g.stats["tokens_per_s"], "token_ids": g.token_ids})
                print(runs[-1]["prompt"], strategy, name, round(g.stats["tokens_per_s"], 2), flush=True)
    return {"compile_s": round(compile_s, 1), "runs": runs, **ab_summary(runs)}


def ab_summary(runs: list[dict]) -> dict:
    """Median paired ratio compiled / eager tok/s per strategy, and whether every output matched."""
    by = {(r["prompt"], r["strategy"], r["cloud"]): r for r in runs}
    out = {}
    for strategy in ("sequential", "tree"):
        pairs = [(by[(p, strategy, "eager")], by[(p, strategy, "compiled")]) for p, s, c in by
                 if s == strategy and c == "eager"]
        out[strategy] = {
            "eager_tok_s_median": round(statistics.median(e["tokens_per_s"] for e, _ in pairs), 3),
            "compiled_tok_s_median": round(statistics.median(c["tokens_per_s"] for _, c in pairs), 3),
            "paired_ratio_median": round(statistics.median(c["tokens_per_s"] / e["tokens_per_s"] for e, c in pairs), 3),
            "identical": sum(e["token_ids"] == c["token_ids"] == by[(e["prompt"], "sequential", "eager")]["token_ids"]
                             for e, c in pairs),
            "pairs": len(pairs),
        }
    return {"summary": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--contexts", default="64,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu", type=int, default=0)
    parser.add_argument("--generations", type=int, default=0,
                        help="also whole generations in one process, eager against compiled cloud: prompts per "
                             "category (0: none)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens a generation")
    parser.add_argument("--compile-rows", type=int, default=4, help="the compiled cloud's least block rows")
    parser.add_argument("--steps", type=int, default=1, help="0: skip the per-step comparison")
    parser.add_argument("--decode-rows", type=int, default=4, help="rows of the growing-context blocks")
    parser.add_argument("--decode-blocks", type=int, default=40, help="growing-context blocks (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {args.cpu})
    inductor.freezing = True
    inductor.cpp.weight_prepack = True
    torch._dynamo.config.cache_size_limit = 64
    command = "python scripts/bench_compile.py " + shlex.join(sys.argv[1:])
    report = {"command": command, "torch": torch.__version__, "threads": 1, "cpu": args.cpu, "repeats": args.repeats}
    lines = ["# Eager against torch.compile (float32, one thread)", "", f"`{command}`", ""]
    if args.steps:
        lines += step_part(args, report)
    if args.generations:
        lines += generation_part(args, report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "compile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def step_part(args, report: dict) -> list[str]:
    """One step per side, row count and context, eager against compiled; fills `report`, returns its lines."""
    rows = tuple(int(x) for x in args.rows.split(","))
    sides = build_sides(args.shards, tuple(int(x) for x in args.contexts.split(",")), rows)
    compiled = [CompiledSide(side) for side in sides]
    first = first_calls(sides, compiled, rows)
    times = time_both(sides, compiled, rows, args.repeats)
    results = []
    for i, side in enumerate(sides):
        for q in rows:
            eager, comp = (statistics.median(times[(i, q, n)]) for n in ("eager", "compiled"))
            results.append({"side": side.name, "context": side.context, "rows": q, "eager_ms": round(eager, 2),
                            "compiled_ms": round(comp, 2), "ratio": round(comp / eager, 3)})
    grown = decode(sides, compiled, args.decode_rows, args.decode_blocks) if args.decode_blocks else []
    report.update(first_calls=first, results=results, decode=grown)
    by_key = {(f["side"], f["context"], f["rows"]): f for f in first}
    lines = [
        f"One decode step, one thread pinned to core {args.cpu}; medians of {args.repeats} shuffled repetitions "
        "after a warm-up, ms per step; first call: seconds to compile and run the first block of that row count; "
        "diff: largest absolute difference of the outputs (hidden states or logits).", "",
        *table(["side", "context", "rows", "eager", "compiled", "compiled / eager", "first call s", "diff"],
               [[r["side"], r["context"], r["rows"], r["eager_ms"], r["compiled_ms"], f"{r['ratio']}x",
                 by_key[(r["side"], r["context"], r["rows"])]["first_call_s"],
                 f"{by_key[(r['side'], r['context'], r['rows'])]['max_abs_diff']:.1e}"] for r in results]),
    ]
    if grown:
        lines += ["", f"Growing context: {args.decode_blocks} blocks of {args.decode_rows} rows committed one after "
                  "another from the shortest context, eager and compiled alternating (ms a block):", "",
                  *table(["side", "eager median", "eager max", "compiled median", "compiled max"],
                         [[g["side"], g["eager_median_ms"], g["eager_max_ms"], g["compiled_median_ms"],
                           g["compiled_max_ms"]] for g in grown])]
    return lines


def generation_part(args, report: dict) -> list[str]:
    ab = generations_ab(args.shards, args.generations, args.tokens, args.compile_rows)
    report["generations"] = ab
    rows = [[s, v["eager_tok_s_median"], v["compiled_tok_s_median"], f"{v['paired_ratio_median']}x",
             f"{v['identical']} of {v['pairs']}"] for s, v in ab["summary"].items()]
    return ["", f"Whole generations in one process (the cloud stack in-process, no network), {args.tokens} new "
            f"tokens, {args.generations} prompt(s) per category; the compiled cloud runs blocks of "
            f"{args.compile_rows}+ rows compiled (LayerStack.compile_passes; {ab['compile_s']} s to compile); each "
            "pair back to back on one prompt; decode tok/s medians and the median of the pairs' ratios; identical: "
            "both outputs equal to eager sequential decoding.", "",
            *table(["strategy", "eager tok/s", "compiled tok/s", "compiled / eager", "identical"], rows)]


if __name__ == "__main__":
    main()
