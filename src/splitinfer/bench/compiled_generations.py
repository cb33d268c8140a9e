"""`bench compile --generations`: whole generations in one process (the cloud stack in-process, as local-only
runs it, no network), eager against a cloud whose blocks of `--compile-rows` rows and more run compiled
(LayerStack.compile_passes), each pair back to back on one prompt, sequential and tree: decode tok/s, the
median of the pairs' ratios, and whether both outputs equal eager sequential decoding's."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from ..tables import table

STRATEGIES = ("sequential", "tree")


def generations_ab(shards: Path, per_category: int, tokens: int, min_rows: int, log) -> dict:
    from ..clients import open_client
    from ..model.shards import load_cloud, load_local
    from .runtime import load_prompts

    local = load_local(shards / "local")
    clouds = {"eager": load_cloud(shards / "cloud"), "compiled": load_cloud(shards / "cloud")}
    started = time.perf_counter()
    clouds["compiled"].stack.compile_passes(min_rows)
    clouds["compiled"].stack.warm_up(max(min_rows, 2))
    compile_s = time.perf_counter() - started
    clients = {name: open_client(local_only=True, shards=shards, halves=(local, cloud))
               for name, cloud in clouds.items()}
    runs = []
    for prompt in load_prompts(None, per_category):
        for strategy in STRATEGIES:
            for name, client in clients.items():
                g = client.generate(prompt["prompt"], max_new_tokens=tokens, strategy=strategy)
                runs.append({"prompt": prompt["id"], "strategy": strategy, "cloud": name,
                             "tokens_per_s": g.stats["tokens_per_s"], "token_ids": g.token_ids})
                log(f"{prompt['id']} {strategy} {name} {g.stats['tokens_per_s']:.2f}")
    return {"compile_s": round(compile_s, 1), "runs": runs, "summary": ab_summary(runs)}


def ab_summary(runs: list[dict]) -> dict:
    """Median paired ratio compiled / eager tok/s per strategy, and how many outputs matched."""
    by = {(r["prompt"], r["strategy"], r["cloud"]): r for r in runs}
    out = {}
    for strategy in STRATEGIES:
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
    return out


def generation_part(args, report: dict, log) -> list[str]:
    ab = generations_ab(Path(args.shards), args.generations, args.tokens, args.compile_rows, log)
    report["generations"] = ab
    rows = [[s, v["eager_tok_s_median"], v["compiled_tok_s_median"], f"{v['paired_ratio_median']}x",
             f"{v['identical']} of {v['pairs']}"] for s, v in ab["summary"].items()]
    return ["", f"Whole generations in one process (the cloud stack in-process, no network), {args.tokens} new "
            f"tokens, {args.generations} prompt(s) per category; the compiled cloud runs blocks of "
            f"{args.compile_rows}+ rows compiled (LayerStack.compile_passes; {ab['compile_s']} s to compile); each "
            "pair back to back on one prompt; decode tok/s medians and the median of the pairs' ratios; identical: "
            "both outputs equal to eager sequential decoding.", "",
            *table(["strategy", "eager tok/s", "compiled tok/s", "compiled / eager", "identical"], rows)]
