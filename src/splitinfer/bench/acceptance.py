"""Per-token acceptance by draft depth and prompt category, for each draft source, on held-out prompts.

    splitinfer bench acceptance --shards shards/smollm2 --out docs/bench [--sources suffix,recycling,...]

The whole model runs in this process (local-only, float32, greedy). Each source drafts a tree of a fixed
size (--nodes, no cost model, so the figures do not depend on how fast this machine is) and the loop
verifies it. Under greedy decoding every generation is the model's own greedy continuation of the prompt
(checked against sequential decoding: a mismatch is an error), so each draft is judged against that
text exactly as teacher forcing on it would judge it; the drafting state a source holds is what it
learned from the same text up to that point.

For each depth d: tries = steps whose draft had a node at depth d below the accepted path's node at
depth d - 1 (that node tested), hits = steps that accepted depth d; acceptance = hits / tries. Pooled
tokens per step = emitted tokens / steps, as `bench spec` reports it. The prompts (data/heldout.jsonl) are
in neither the benchmark set nor the offline data that warm starts are built from.

Sources: the named ones below, and any strategy registered in decoding.strategies by its name (a learned
draft head joins that way; it then sizes its own trees, which the JSON records as `fixed_nodes: false`).
A named source may carry its own tree size, `name@nodes` (tree-warm@8,tree-warm@64): a node sweep is then
one run over one set of sequential references, each size a row of its own.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError
from ..options import Opt, add_options, defer
from ..tables import table
from .parsers import add_shards_and_out

# name -> what it measures; "tree" is the default strategy's merged tree
SOURCES = {
    "suffix": "suffix index over the prompt and the output so far",
    "suffix-memory": "the same, plus a memory of the earlier held-out replies of this run (what `api`/`chat` keep)",
    "recycling": "Token Recycling from an empty table",
    "recycling-warm": "Token Recycling from the shipped table (drafter recycling)",
    "suffix-replies": "suffix index, also over the replies shipped with the table",
    "tree": "suffix index + Token Recycling from an empty table",
    "tree-warm-noreplies": "suffix index + Token Recycling from the shipped table, without the replies shipped with it",
    "tree-warm": "suffix index over the text and the shipped replies + Token Recycling from the shipped table",
    "tree-warm-pooled": "tree-warm, the replies' occurrences pooled with the text's at every match length",
    "head": "the learned draft head alone, drafting every step (--head, default: the one installed in the shards)",
    "tree-warm-head": "tree-warm + the learned draft head, drafting every step",
}
NEEDS_HEAD = ("head", "tree-warm-head")
DEFAULT_SOURCES = "suffix,suffix-memory,recycling,recycling-warm,tree,tree-warm"
MAX_REPORTED_DEPTH = 12


def _strategy_factory(name: str, nodes: int, table, memory, head=None):
    """A function making a fresh strategy for one generation of source `name`."""
    from ..decoding.strategies import STRATEGIES, Tree, TreeConfig, make_strategy

    if name in NEEDS_HEAD and head is None:
        raise ConfigError(f"source {name!r} needs a draft head: install one with `splitinfer prepare`, pass --head, "
                          "or drop the source.")
    # Drafting with the head every step measures what it predicts, not whether it paid on this machine.
    head_only = TreeConfig(fixed_nodes=nodes, suffix_depth=0, recycling_nodes=0, head_explore_every=1)
    suffix_only = TreeConfig(fixed_nodes=nodes, recycling_nodes=0)
    recycling_only = TreeConfig(fixed_nodes=nodes, suffix_depth=0)
    both = TreeConfig(fixed_nodes=nodes)
    factories = {
        "suffix": lambda: Tree(suffix_only),
        "suffix-memory": lambda: Tree(suffix_only, memory=memory),
        "recycling": lambda: Tree(recycling_only),
        "recycling-warm": lambda: Tree(recycling_only, recycling_table=table),
        "suffix-replies": lambda: Tree(suffix_only, recycling_table=table),
        "tree": lambda: Tree(both),
        "tree-warm-noreplies": lambda: Tree(replace(both, reply_store=False), recycling_table=table),
        "tree-warm": lambda: Tree(both, recycling_table=table),
        "tree-warm-pooled": lambda: Tree(replace(both, replies_fallback=False), recycling_table=table),
        "head": lambda: Tree(head_only, head=head),
        "tree-warm-head": lambda: Tree(replace(both, head_explore_every=1), recycling_table=table, head=head),
    }
    if name in factories:
        if ("-warm" in name or name == "suffix-replies") and table is None:
            raise ConfigError(f"source {name!r} needs the shipped recycling table for this model, and none matches "
                              "its fingerprint; build one with `splitinfer drafter recycling` or drop the source.")
        return factories[name]
    if name in STRATEGIES:
        return lambda: make_strategy(name)
    raise ConfigError(f"unknown source {name!r}; choose among {', '.join([*SOURCES, *STRATEGIES])}.")


class DepthRecorder:
    """Wraps a strategy and records, per verified step, how deep the draft went and how deep it was accepted."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.prompt_logits_rows = inner.prompt_logits_rows
        self.uses_features = inner.uses_features
        self.feature_states = inner.feature_states
        self.drafts_ahead = inner.drafts_ahead
        self.steps: list[tuple[int, bool]] = []  # (accepted drafts, whether a child of the last accepted node was offered)

    def start(self, prompt, prompt_logits):
        self.inner.start(prompt, prompt_logits)

    def see_features(self, features):
        self.inner.see_features(features)

    def propose(self, history):
        return self.inner.propose(history)

    def predict(self, history, nodes):
        return self.inner.predict(history, nodes)

    def draft_ahead(self, history, draft):
        self.inner.draft_ahead(history, draft)

    def recall(self, draft):
        self.inner.recall(draft)

    def observe(self, tokens, parents, logits, path, emitted, step_ms):
        offered_deeper = any(parent == path[-1] for parent in parents[1:])
        self.steps.append((len(path) - 1, offered_deeper))
        self.inner.observe(tokens, parents, logits, path, emitted, step_ms)

    def report(self):
        return self.inner.report()


def depth_counts(steps: list[tuple[int, bool]], emitted: int) -> dict:
    """tries and hits per depth, steps and tokens, from one generation's steps and its emitted tokens
    after the first (the last step may have accepted past the token limit: only emitted tokens count)."""
    tries: dict[int, int] = defaultdict(int)
    hits: dict[int, int] = defaultdict(int)
    left = emitted
    for accepted, offered_deeper in steps:
        cut = accepted > left - 1  # decoding stopped inside this step's path: what followed was never tested
        accepted = min(accepted, max(left - 1, 0))
        left -= accepted + 1
        for d in range(1, accepted + 1):
            tries[d] += 1
            hits[d] += 1
        if offered_deeper and not cut:
            tries[accepted + 1] += 1
    return {"steps": len(steps), "tokens": emitted, "tries": dict(tries), "hits": dict(hits)}


def _merge(counts: list[dict]) -> dict:
    total = {"steps": 0, "tokens": 0, "tries": defaultdict(int), "hits": defaultdict(int)}
    for c in counts:
        total["steps"] += c["steps"]
        total["tokens"] += c["tokens"]
        for key in ("tries", "hits"):
            for d, n in c[key].items():
                total[key][int(d)] += n
    depths = sorted(d for d in total["tries"] if d <= MAX_REPORTED_DEPTH)
    return {
        "steps": total["steps"],
        "tokens": total["tokens"],
        "tokens_per_step": round(total["tokens"] / max(total["steps"], 1), 3),
        "acceptance_by_depth": {d: round(total["hits"][d] / total["tries"][d], 3) for d in depths},
        "tries_by_depth": {d: total["tries"][d] for d in depths},
    }


def _load_head(client, directory: Path | None):
    """The head in `directory` (checked against the model), or the one the client loaded from its shards."""
    if directory is None:
        return client.draft_head
    from ..model.drafthead import load_shard_head, read_head_info
    from ..model.manifest import model_identity

    if read_head_info(directory).get("model_fingerprint") != model_identity(client.local.manifest):
        raise ConfigError(f"the draft head in {directory} was trained for another model; pass a head for this one.")
    return load_shard_head(directory, client.local)


def source_spec(spec: str, nodes: int) -> tuple[str, int]:
    """'name' or 'name@N' -> (name, draft nodes per step); `nodes` is the run's size for a bare name."""
    name, at, size = spec.partition("@")
    if not at:
        return name, nodes
    if not size.isdigit() or int(size) < 1:
        raise ConfigError(f"source {spec!r}: the size after @ is a number of draft nodes, at least 1 (tree-warm@32).")
    if name not in SOURCES:
        raise ConfigError(f"source {spec!r}: only the named sources ({', '.join(SOURCES)}) take a size; "
                          "a registered strategy sizes its own trees.")
    return name, int(size)


def measure(shards: Path, prompts: list[dict], sources: list[str], nodes: int, max_new_tokens: int,
            table_dir: Path | None = None, head_dir: Path | None = None) -> dict:
    """Per source (a name or name@nodes, `source_spec`): per-generation counts and their summaries per
    category and over all prompts.

    table_dir: the recycling table the -warm sources start from (default: the one shipped for the model);
    head_dir: the draft head of the head sources (default: the one installed in the shards)."""
    from ..decoding.warm import RecyclingTable, SuffixMemory
    from ..clients import open_client

    client = open_client(local_only=True, shards=shards)
    table = RecyclingTable.load(table_dir) if table_dir is not None else client.recycling_table
    head = _load_head(client, head_dir)
    stop = client.stop_ids() if client.local.tokenizer is not None else set()
    encoded = {p["id"]: list(p["prompt"]) if isinstance(p["prompt"], list) else client.encode_prompt(p["prompt"], p.get("chat", True))
               for p in prompts}
    truth = {pid: client.generate(ids, max_new_tokens=max_new_tokens, strategy="sequential", stop_ids=stop).token_ids
             for pid, ids in encoded.items()}
    results = {}
    for spec in sources:
        name, size = source_spec(spec, nodes)
        make = _strategy_factory(name, size, table, SuffixMemory(), head)
        per_prompt = {}
        for p in prompts:
            recorder = DepthRecorder(make())
            out = client.generate(encoded[p["id"]], max_new_tokens=max_new_tokens, strategy=recorder, stop_ids=stop)
            if out.token_ids != truth[p["id"]]:
                raise AssertionError(f"source {spec} changed the greedy output of {p['id']}: speculation must not")
            if name == "suffix-memory":
                recorder.inner.memory.add(out.token_ids)
            per_prompt[p["id"]] = {"category": p["category"], **depth_counts(recorder.steps, len(out.token_ids) - 1)}
            print(f"{spec:<15} {p['id']:<18} {per_prompt[p['id']]['tokens'] / max(len(recorder.steps), 1):.2f} tok/step",
                  file=sys.stderr)
        categories = sorted({p["category"] for p in prompts})
        results[spec] = {
            "description": SOURCES.get(name, "registered strategy (sizes its own trees)"),
            "fixed_nodes": name in SOURCES,
            "nodes": size if name in SOURCES else None,
            "all": _merge(list(per_prompt.values())),
            "by_category": {c: _merge([v for v in per_prompt.values() if v["category"] == c]) for c in categories},
            "per_prompt": per_prompt,
        }
    return results


def markdown(report: dict) -> str:
    sources = report["sources"]
    categories = sorted({c for s in sources.values() for c in s["by_category"]})
    depths = range(1, 9)
    lines = [f"# Acceptance by draft depth and category: {report['model']}", "", f"Command: `{report['command']}`", "",
             f"{report['setup']}", "", "Emitted tokens per step, pooled:", ""]
    lines += table(["source", "all", *categories], [
        [name, s["all"]["tokens_per_step"], *(s["by_category"][c]["tokens_per_step"] for c in categories)]
        for name, s in sources.items()])
    lines += ["", "Per-token acceptance at depth d given depth d - 1 accepted (all prompts; tries in brackets):", ""]
    lines += table(["source", *(f"d={d}" for d in depths)], [
        [name, *(f"{s['all']['acceptance_by_depth'][d]} ({s['all']['tries_by_depth'][d]})"
                 if d in s["all"]["acceptance_by_depth"] else "-" for d in depths)] for name, s in sources.items()])
    for c in categories:
        lines += ["", f"{c}: acceptance by depth", ""]
        lines += table(["source", *(f"d={d}" for d in depths[:4])], [
            [name, *(s["by_category"][c]["acceptance_by_depth"].get(d, "-") for d in depths[:4])]
            for name, s in sources.items()])
    lines += ["", "Sources:", ""] + [f"- {name}: {s['description']}" for name, s in sources.items()]
    return "\n".join(lines) + "\n"


def run(args) -> dict:
    import torch

    from ..launch import pin_self
    from .runtime import load_prompts

    if args.nodes < 1 or args.max_new_tokens < 2:
        raise ConfigError("--nodes must be at least 1 and --max-new-tokens at least 2.")
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    for spec in sources:
        source_spec(spec, args.nodes)  # a bad size is refused before the references are generated
    prompt_file = args.prompts or str(Path(__file__).parent.parent / "data" / "heldout.jsonl")
    prompts = load_prompts(prompt_file, args.per_category)
    pin_self(0)
    shards = Path(args.shards)
    report = {
        "command": "splitinfer bench acceptance " + " ".join(shlex.quote(a) for a in sys.argv[3:]),
        "model": json.loads((shards / "local" / "manifest.json").read_text())["model_id"],
        "setup": f"Local-only, float32, greedy, one thread; {len(prompts)} prompts "
        f"({args.prompts or 'the packaged data/heldout.jsonl'}), "
        f"{args.max_new_tokens} new tokens; drafts of exactly {args.nodes} nodes per step for the named sources "
        "given without a size, N for name@N. "
        f"torch {torch.__version__}.",
        "nodes": args.nodes,
        "max_new_tokens": args.max_new_tokens,
        "prompts": [p["id"] for p in prompts],
        "recycling_table": args.recycling_table or "shipped",
        "head": args.head or "installed in the shards",
        "sources": measure(shards, prompts, sources, args.nodes, args.max_new_tokens,
                           Path(args.recycling_table) if args.recycling_table else None,
                           Path(args.head) if args.head else None),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.json").write_text(json.dumps(report, indent=1))
    (out / "acceptance.md").write_text(markdown(report))
    print(markdown(report))
    return report


@dataclass(frozen=True)
class AcceptanceOptions:
    """The defaults of `splitinfer bench acceptance`."""

    per_category: int = 3  # prompts taken from each category
    sources: str = DEFAULT_SOURCES  # comma-separated sources or strategy names; a named source may take its own size, name@nodes
    nodes: int = 16  # draft nodes per step for the named sources given without @nodes
    max_new_tokens: int = 96  # tokens per generation


def _options(s: argparse.ArgumentParser) -> None:
    add_shards_and_out(s, "acceptance.json and acceptance.md")
    s.add_argument("--prompts", help="JSONL prompt file, or mt-bench for MT-Bench's first turns (`make chat-data`; default: the packaged "
                   "held-out prompts)")
    add_options(s, AcceptanceOptions, (
        Opt("per_category", help="prompts taken from each category"),
        Opt("sources", help="comma-separated sources or strategy names; a named source may take its own size, name@nodes"),
        Opt("nodes", help="draft nodes per step for the named sources given without @nodes"),
        Opt("max_new_tokens"),
    ))
    s.add_argument("--recycling-table", help="folder of a recycling table for the -warm sources (default: the shipped one)")
    s.add_argument("--head", help="folder of a draft head for the head sources (default: the one installed in the shards)")


def register(sub) -> None:
    s = sub.add_parser("acceptance", help="per-token acceptance by draft depth and category, per draft source")
    defer(s, _options)
    s.set_defaults(func=cmd_bench_acceptance)


def cmd_bench_acceptance(args) -> int:
    run(args)
    return 0
