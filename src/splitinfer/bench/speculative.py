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

This module runs the benchmark and records the runs; spec_summary.py turns them into numbers,
spec_report.py into Markdown, and spec_readme.py splices the headline table into a README.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from .. import __version__
from ..launch import cloud_server, pin_self, wan_proxy
from ..local.client import Generation, SplitClient
from ..clients import open_client
from ..local.session import AUTO_IN_FLIGHT, MAX_IN_FLIGHT, ClientConfig, SplitSession
from ..decoding.strategies import STRATEGIES
from ..errors import ConfigError
from ..model.shards import load_whole_hf
from ..wire.padding import PadSetting, parse_pad_settings
from .runtime import load_prompts
from .spec_readme import replace_results
from .spec_report import markdown
from .spec_summary import summarize
from .anchors import greedy_transformers


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
    """Top-1 minus top-2 logit of the local model (float32 wire) before tokens[step] (for divergence reports)."""
    session = SplitSession(client.local, client.make_middle(), ClientConfig(wire_dtype="float32"))
    top = session.prefill(prompt_ids + tokens[:step])[-1].topk(2).values
    session.close()
    return round(float(top[0] - top[1]), 5)


def run_speculative_bench(args) -> dict:
    """The benchmark on one shards directory (args.shards): its report, written to args.out."""
    return run_interleaved([args])[0]


def run_interleaved(each: list) -> list[dict]:
    """The benchmark on several shards directories at once (`each`: one args namespace a directory, with its own
    shards, out and readme; prompts, strategies and the rest from the first): every directory's server and clients
    stay up, and each prompt runs on every directory before the next prompt starts, so a machine whose speed
    drifts during the run moves them alike. Their reports, in order."""
    first = each[0]
    rtts = [float(x) for x in str(first.rtt_ms).split(",") if x.strip()]
    strategies = [s.strip() for s in first.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ConfigError(f"unknown strategy {', '.join(unknown)}; choose among {', '.join(STRATEGIES)}.")
    if "sequential" not in strategies:
        strategies.insert(0, "sequential")
    prompts = load_prompts(first.prompts, first.per_category)
    depths = parse_depths(str(first.in_flight))
    pin_self(0)
    done = []
    with ExitStack() as stack:
        for args in each:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            local = open_client(local_only=True, shards=Path(args.shards))
            reference = prompt_lookup_reference(Path(args.shards), prompts, local, first.max_new_tokens)
            print("prompt lookup (transformers, local):", {k: v["accepted_per_step"] for k, v in reference.items()},
                  file=sys.stderr)
            measured = stack.enter_context(measuring(args, Path(args.shards), prompts, strategies, rtts, local, depths))
            done.append((args, local, reference, measured))
        for rep in range(first.repeats):
            for p in prompts:
                for *_, (_, _, run_prompt) in done:
                    run_prompt(rep, p)
    others = [str(args.shards) for args in each]
    return [_report(args, prompts, strategies, rtts, depths, local, reference, runs, local_runs,
                    [o for o in others if o != str(args.shards)])
            for args, local, reference, (runs, local_runs, _) in done]


def _report(args, prompts: list[dict], strategies: list[str], rtts: list[float], depths: list[int],
            local: SplitClient, reference: dict, runs: list[dict], local_runs: list[dict], others: list[str]) -> dict:
    """One directory's report from its runs: written as OUT/speculative.json and .md (and into --readme)."""
    shards, out = Path(args.shards), Path(args.out)
    divergences = find_divergences(runs, local)
    device = args.cloud_device or "cpu"
    pass_ms = args.cloud_pass_ms or 0
    if pass_ms:
        device += f", every pass padded to at least {pass_ms:g} ms (the fast-cloud scenario)"
    if args.cloud_compile_rows:
        device += f", blocks of {args.cloud_compile_rows}+ rows through torch.compile (serve --compile-rows)"
    manifest = json.loads((shards / "local" / "manifest.json").read_text())
    dtype = manifest["dtype"]
    table = local.recycling_table
    replies = (f" and its suffix lookup also searches the {table.manifest.get('reply_tokens')} reply tokens shipped with it"
               if table is not None and table.replies is not None else "")
    warm = (f"tree's Token Recycling starts from the shipped table ({table.manifest.get('table_tokens')} tokens, data "
            f"{str(table.manifest.get('data_sha256'))[:12]}){replies}" if table is not None else "no recycling table for this model")
    beside = (f", and so does every configuration of {', '.join(others)} (their servers up beside this one)"
              if others else "")
    report = {
        "command": "splitinfer bench spec " + " ".join(shlex.quote(a) for a in sys.argv[3:]),
        "splitinfer": __version__,
        "torch": torch.__version__,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "setup": f"client: this process, core 0, 1 thread; cloud server: child process, core 1, 1 thread, {device}; "
        f"WAN emulator: child process on core 1; {args.wire_dtype} wire; greedy; fresh drafting state per generation "
        "(the client's measured step costs, and what its draft head is worth, are shared by its generations); "
        f"local-only: the whole model in this process, core 0, 1 thread, sequential greedy, {dtype}; every "
        f"configuration runs on a prompt before the next prompt starts{beside}; {warm}",
        "interleaved_with": others,
        "model": manifest["model_id"],
        "dtype": dtype,  # the shards' compute dtype (both sides and local-only)
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
        "pad_rows": [s.key for s in pad_settings(args)],  # wire/padding.py's PadSetting names
        "pad_prompt_rows": args.pad_prompt_rows,  # with every padded configuration
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


def label(strategy: str, depth: int, pad: PadSetting = PadSetting()) -> str:
    """A configuration's name in the tables: the strategy, its padding (`+padN`, then PadSetting's `+sS+hH+tT`)
    and its blocks in flight when more than one (`@Dauto` when the controller chose them)."""
    name = f"{strategy}+pad{pad.key}" if pad.rows else strategy
    if depth == AUTO_IN_FLIGHT:
        return f"{name}@Dauto"
    return name if depth == 1 else f"{name}@D{depth}"


def pad_settings(args) -> list[PadSetting]:
    """--pad-rows: comma-separated PadSetting names (0 for none, which always runs), e.g. 0,33,33+s64."""
    return list(dict.fromkeys([PadSetting(), *parse_pad_settings(args.pad_rows)]))


def _client_config(args, depth: int, pad: PadSetting) -> ClientConfig:
    """A configuration's client settings: a padded one also pads prompts where asked."""
    prompts = args.pad_prompt_rows if pad.rows else 0
    return ClientConfig(wire_dtype=args.wire_dtype, in_flight=depth, pad_prompt_rows=prompts, **pad.client_fields())


@contextmanager
def measuring(args, shards: Path, prompts: list[dict], strategies: list[str], rtts: list[float], local: SplitClient,
              depths: list[int] = (1,)):
    """Yields (split runs, local-only runs, run_prompt) with the cloud server, WAN emulators and clients of `shards`
    up and warmed: run_prompt(rep, p) runs local-only, its transformers anchor, then every configuration on prompt
    p, adding to the two lists, so a machine whose speed drifts during the run slows every configuration alike.
    Sequential decoding has nothing to send ahead, so it runs with one block in flight only."""
    runs: list[dict] = []
    local_runs: list[dict] = []
    extra = ("--device", args.cloud_device) if args.cloud_device else ()
    if args.cloud_pass_ms:
        extra += ("--min-pass-ms", str(args.cloud_pass_ms))
    compile_rows = args.cloud_compile_rows
    if compile_rows:
        extra += ("--compile-rows", str(compile_rows))
    with ExitStack() as stack:
        url, _ = stack.enter_context(cloud_server(shards / "cloud", cpu=1, threads=1, extra=extra,
                                                  ready_timeout_s=3600.0 if compile_rows else 120.0))
        targets = {rtt: (url if rtt == 0 else stack.enter_context(wan_proxy(url, rtt, cpu=1))) for rtt in rtts}
        pads = pad_settings(args)  # sequential runs unpadded
        clients = {(rtt, d, pad): open_client(shard=shards / "local", server=target, allow_public_weights=True,
                                              config=_client_config(args, d, pad))
                   for rtt, target in targets.items() for d in sorted(set(depths) | {1}) for pad in pads}
        args.wire_dtype = next(iter(clients.values())).config.wire_dtype  # the shard's unless --wire-dtype
        # sequential sends one row a step whatever the text, so it has nothing to pad and no blocks ahead
        configs = [(s, rtt, d, pad) for rtt in rtts for d in sorted(set(depths) | {1}) for pad in pads for s in strategies
                   if s != "sequential" or (d == 1 and not pad.rows)]
        local.generate(prompts[0]["prompt"], max_new_tokens=16, strategy="sequential")
        whole = load_whole_hf(shards)  # plain transformers on the same core and thread: the anchor
        greedy_transformers(whole, local.encode_prompt(prompts[0]["prompt"]), 16)
        for strategy, rtt, d, pad in configs:
            clients[(rtt, d, pad)].generate(prompts[0]["prompt"], max_new_tokens=16, strategy=strategy)
        turns = args.turns

        def run_prompt(rep: int, p: dict) -> None:
            for q, result in zip(turn_rows(p, turns), generations(local, p, args.max_new_tokens, "sequential", turns)):
                local_runs.append(_record("local-only", 0.0, rep, q, result))
                local_runs.append(transformers_record(whole, rep, q, result))
            for strategy, rtt, d, pad in configs:
                for q, result in zip(turn_rows(p, turns), generations(clients[(rtt, d, pad)], p, args.max_new_tokens,
                                                                      strategy, turns)):
                    runs.append(_record(label(strategy, d, pad), rtt, rep, q, result, d))

        yield runs, local_runs, run_prompt


def turn_rows(p: dict, turns: int) -> list[dict]:
    """The benchmark rows of a prompt: itself, and with `turns` 2 its second turn as "<id>/2"."""
    if turns < 2 or len(p.get("turns", ())) < 2:
        return [p]
    return [p, p | {"id": f"{p['id']}/2", "prompt": p["turns"][1], "category": f"{p['category']}, turn 2"}]


def generations(client: SplitClient, p: dict, max_new_tokens: int, strategy: str, turns: int) -> list:
    """One generation, or with a second turn both turns of one conversation (api/chat.py's ChatSession: the
    second turn prefills only its own tokens; drafting may search the first reply, as in `api`)."""
    if len(turn_rows(p, turns)) == 1:
        return [client.generate(p["prompt"], max_new_tokens=max_new_tokens, chat=p.get("chat", True), strategy=strategy)]
    from ..api.chat import ChatSession

    results = []
    with ChatSession(client, strategy=strategy) as chat:
        for text in p["turns"][:2]:
            turn = chat.say(text, max_new_tokens)
            prompt = chat.conversation.history[: turn.prompt_tokens]
            results.append(Generation(turn.text, prompt, turn.token_ids, turn.finish_reason, turn.logprobs, turn.stats,
                                      turn.steps))
    return results


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
        "cover_exchanges": sum(s["kind"] == "cover" for s in result.steps),  # ClientConfig.pad_steps
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
