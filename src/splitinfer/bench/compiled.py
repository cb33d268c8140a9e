"""`splitinfer bench compile`: does torch.compile make a decode step faster on this CPU? Eager against compiled,
per step and per generation.

For each side of the split (bench/side.py's `Side`: the cloud's middle layers; the local head and tail layers
with the final norm and LM head), each context and each block of q rows: the step as splitinfer runs it (eager,
inference mode) against a copy of the same layers whose every block takes the compiled pass
(LayerStack.compile_passes: inductor, dynamic shapes, freezing; what `serve --compile-rows` turns on) and whose
local norm and LM head go through `torch.compile` (weight prepacking: the CPU recipe), on its own caches filled
with the same context. Both run the same real
activations, in a shuffled order every round after a warm-up round (bench/harness.py); medians reported, with
the compile time of the first block of each row count and the largest difference between the outputs.
`--decode-blocks` also commits blocks one after another (the context growing, as in decoding) to show
recompilation; `--generations` times whole generations, eager against a compiled cloud (compiled_generations.py).

The compiled copy runs under no_grad, not inference mode: inductor's freezing cannot take inference tensors
("Cannot set version_counter for inference tensor"), so its inputs are cloned out of inference mode first.
Writes OUT/compile.json and OUT/compile.md.
"""

from __future__ import annotations

import copy
import functools
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch._dynamo
import torch._inductor.config as inductor
from torch import nn

from ..launch import pinned
from ..tables import table
from .harness import command_line, rounds, write
from .side import Side, plain_linear, build_sides


def plain_linears(module: nn.Module) -> nn.Module:
    """Every RowsLinear replaced by a plain nn.Linear on the same weights: inductor packs the weights itself."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and type(child) is not nn.Linear:
                setattr(parent, name, plain_linear(child))
    return plain_linear(module) if isinstance(module, nn.Linear) else module


class CompiledSide:
    """A copy of `side`'s layers whose every block runs compiled (LayerStack.compile_passes, as `serve
    --compile-rows 1` runs them) and whose local tail (norm and LM head) runs through `torch.compile`, with
    caches of its own filled with the same context."""

    def __init__(self, side: Side):
        self.side = side
        self.stacks = [copy.deepcopy(stack) for stack in side.stacks]
        for stack in self.stacks:
            stack.compile_passes(1)
        self.tail = None
        if side.tail is not None:
            norm, head = (plain_linears(copy.deepcopy(m)) for m in side.tail)
            self.tail = torch.compile(lambda h: head(norm(h)), dynamic=True)
        self.caches = [stack.new_cache() for stack in self.stacks]
        prompt = side.inputs[:, : side.context].clone()
        allowed = np.tril(np.ones((side.context, side.context), dtype=bool))
        for stack, cache in zip(self.stacks, self.caches):
            prompt = stack(prompt, torch.arange(side.context), allowed, cache)
            cache.commit_all()

    def ours(self, q: int, hidden: torch.Tensor, keep: bool = False) -> torch.Tensor:
        """One block after the committed rows; `keep` commits it (the context grows), else it is dropped."""
        start = self.caches[0].length
        positions = torch.arange(start, start + q)
        allowed = np.tril(np.ones((q, q), dtype=bool))
        hidden = hidden.clone()  # not an inference tensor: the compiled pass runs under no_grad
        for stack, cache in zip(self.stacks, self.caches):
            hidden = stack(hidden, positions, allowed, cache)
            cache.commit_all() if keep else cache.truncate(cache.length)
        if self.tail is None:
            return hidden
        with torch.no_grad():
            return self.tail(hidden)


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


def decode(sides: list[Side], compiled: list[CompiledSide], q: int, blocks: int, log) -> list[dict]:
    """Blocks of q rows committed one after another (each step's context one block longer, as in decoding),
    eager and compiled alternating; ms of every block, to show recompilation as the cache grows."""
    out = []
    shortest = min(s.context for s in sides)
    for side, comp in ((s, c) for s, c in zip(sides, compiled) if s.context == shortest):
        times = {"eager": [], "compiled": []}
        for _ in range(blocks):
            hidden = side.block(q)
            for name, step in (("eager", lambda: eager_decode(side, q, hidden)),
                               ("compiled", lambda: comp.ours(q, hidden, keep=True))):
                t0 = time.perf_counter()
                step()
                times[name].append((time.perf_counter() - t0) * 1e3)
        row = {"side": side.name, "start_context": side.context, "rows": q, "blocks": blocks}
        for name, ms in times.items():
            row[f"{name}_median_ms"] = round(statistics.median(ms), 2)
            row[f"{name}_max_ms"] = round(max(ms), 1)
        out.append(row)
        log(str(row))
    return out


def first_calls(sides: list[Side], compiled: list[CompiledSide], rows: tuple[int, ...], log) -> list[dict]:
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
            log(str(row))
    return out


def time_both(sides: list[Side], compiled: list[CompiledSide], rows: tuple[int, ...], repeats: int) -> dict:
    """{(side index, q, 'eager'|'compiled'): [ms, ...]}, every configuration once a round, shuffled."""
    impls = {"eager": sides, "compiled": compiled}
    inputs = {(i, q): side.block(q) for i, side in enumerate(sides) for q in rows}
    calls = {(i, q, name): functools.partial(impls[name][i].ours, q, inputs[(i, q)])
             for i in range(len(sides)) for q in rows for name in impls}
    return {key: [t * 1e3 for t in ts] for key, ts in rounds(calls, repeats, shuffle=random.Random(0)).items()}


def step_part(args, report: dict, log) -> list[str]:
    """One step per side, row count and context, eager against compiled; fills `report`, returns its lines."""
    rows = tuple(int(x) for x in args.rows.split(","))
    sides = build_sides(Path(args.shards), tuple(int(x) for x in args.contexts.split(",")), (*rows, args.decode_rows))
    compiled = [CompiledSide(side) for side in sides]
    first = first_calls(sides, compiled, rows, log)
    times = time_both(sides, compiled, rows, args.repeats)
    results = []
    for i, side in enumerate(sides):
        for q in rows:
            eager, comp = (statistics.median(times[(i, q, n)]) for n in ("eager", "compiled"))
            results.append({"side": side.name, "context": side.context, "rows": q, "eager_ms": round(eager, 2),
                            "compiled_ms": round(comp, 2), "ratio": round(comp / eager, 3)})
    grown = decode(sides, compiled, args.decode_rows, args.decode_blocks, log) if args.decode_blocks else []
    report.update(first_calls=first, results=results, decode=grown)
    by_key = {(f["side"], f["context"], f["rows"]): f for f in first}
    lines = [
        f"One decode step, one thread pinned to core {args.cpu}; medians of {args.repeats} shuffled rounds "
        "after a warm-up round, ms per step; first call: seconds to compile and run the first block of that row "
        "count; diff: largest absolute difference of the outputs (hidden states or logits).", "",
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


def run(args, log=print) -> dict:
    from .compiled_generations import generation_part

    inductor.freezing = True
    inductor.cpp.weight_prepack = True
    torch._dynamo.config.cache_size_limit = 64
    report = {"cpu": args.cpu, "repeats": args.repeats}
    lines = []
    with pinned(args.cpu, 1):  # the record's provenance is taken inside
        if args.steps:
            lines += step_part(args, report, log)
        if args.generations:
            lines += generation_part(args, report, log)
        write(Path(args.out), "compile", report, lines, title="Eager against torch.compile (float32, one thread)",
              command=command_line(args), log=log)
    return report
