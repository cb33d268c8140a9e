"""Every figure a user reads is one a stored run holds: README.md and the pages of docs/ against notes/.

Three checks, so that a rerun which leaves a page behind, or a figure typed by hand, fails here:

- FIGURES, the table below: a quoted passage of a page with `{}` where its figures stand, the stored JSON
  they come from (under notes/), and for each figure the keys that lead to it and how the page rounds it;
- the generated blocks (the README's `bench spec` table, docs/privacy.md's threat table) equal what their
  generators write from the same JSON;
- no figure goes unchecked: every decimal number in a page's prose, and every whole number written as a
  ratio, a percentage or a rate (`3x`, `100%`, `25 tok/s`), is one of FIGURES or one of SETTINGS (a setting,
  a definition or a design constant, not a measurement). Code, commands, links and generated blocks are
  not prose.

Keys: a string or an integer indexes; a dict picks the list items whose fields equal it (several items
then go on together); "min", "max" and "count" reduce them. `Q(a, b)` is the quotient of two such paths,
`D(a, b)` their difference. A form is Python's format spec (`.1f`, `.0%`, `+.2%`, `,.0f`), `1-` before one
writes one minus the value (`1-.0%`: "13%" of positions changed where 87% agree), `s` a stored string ("4 of
15"), and `""` the stored value as it is. A third element scales the value (bytes to GB).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
NOTES = ROOT / "notes"


@dataclass(frozen=True)
class Q:
    """The quotient of two paths into the same run."""
    num: tuple
    den: tuple


@dataclass(frozen=True)
class D:
    """The difference of two paths into the same run (a - b)."""
    a: tuple
    b: tuple


@dataclass(frozen=True)
class Figure:
    page: str
    text: str  # the passage as the page writes it (line breaks free), `{}` for each figure
    run: str  # the stored JSON, relative to notes/; "plan:CONFIG" is `splitinfer bench plan`'s arithmetic
    values: tuple  # per `{}`: (path or Q, form)


# -- the stored runs, by the names the table uses ----------------------------------------------------------
README_RUN = "bench/readme/speculative.json"
AT80 = ("summary", "rows", {"rtt_ms": 80.0})
LOCAL_ONLY = ("summary", "local_only")
FORMATS = "bench/formats/formats.json"
SPEC_FORMATS = "bench/spec-formats/formats.json"
HELDOUT_FORMATS = "bench/spec-formats-heldout/formats.json"
STEP_INT8 = "bench/step-int8-rows/step.json"
H200 = "bench/gpu-h200/device-step.json"
AUDIT = "privacy/audit.json"
EXACTNESS = "bench/exactness/exactness.json"
PROJECTION_AMX = "bench/paper-projection-amx/projection.json"
TREE_INT8 = ("rows", {"strategy": "tree", "trusted": "this CPU, int8, 2 thread(s)"})


def exact_row(weights: str, wire: str, key: str) -> tuple:
    return ("rows", {"weights": weights, "wire": wire}, key)


def tree80(key: str) -> tuple:
    return (*AT80, {"strategy": "tree"}, key)


def cloud_step(context: int, rows: int, key: str) -> tuple:
    return ("rows", {"side": "cloud", "context": context, "rows": rows}, key)


def gpu_step(context: int, rows: int, key: str) -> tuple:
    return ("rows", {"context": context, "rows": rows}, key)


def audit(threat: str, defence: str, side: str, attacker: str | None = None, key: str = "top1", depth: int = 2,
          reduce: str | None = None) -> tuple:
    """A privacy audit's row (or, with reduce, the min or max over the rows that match)."""
    match = {"threat": threat, "defence": defence, "side": side, **({"depth": depth} if depth else {}),
             **({"attacker": attacker} if attacker else {})}
    return ("results", match, key, *([reduce] if reduce else []))


def padded(strategy: str, rtt: float, key: str = "tokens_per_s_whole_set") -> tuple:
    return ("summary", "rows", {"strategy": strategy, "rtt_ms": rtt}, key)


def spec_format(name: str, mode: str, key: str = "tokens_per_s_whole_set") -> tuple:
    return ("formats", name, "summary", "rows", mode, key)


FIGURES = (
    # README.md: the summary near the top and the "How fast" section quote the same run
    Figure("README.md", "the default strategy `tree` ran at **{} tok/s, {}x split sequential decoding ({} tok/s)**",
           README_RUN, ((tree80("tokens_per_s_whole_set"), ".1f"), (tree80("speedup_whole_set"), ".2f"),
                        ((*AT80, {"strategy": "sequential"}, "tokens_per_s_whole_set"), ".1f"))),
    Figure("README.md", "in int8 ({} ms a tree step of {} rows, synthetic", PROJECTION_AMX,
           ((TREE_INT8 + ("local_ms",), ""), (TREE_INT8 + ("rows",), ""))),
    Figure("README.md", "CUDA graph replayed it ({} ms;", PROJECTION_AMX, ((TREE_INT8 + ("cloud_ms",), ""),)),
    Figure("README.md", "the tree would reach {} tok/s at an 80 ms round trip, the round trip {} of each step, against "
           "the paper's {} measured", PROJECTION_AMX,
           ((TREE_INT8 + ("tokens_per_s", "80"), ""), (TREE_INT8 + ("rtt_efficiency", "80"), ""),
            (("paper", "measured", "lookahead", 1), ""))),
    Figure("README.md", "That path's cloud step is {}x to {}x slower", "bench/kernel-ab/int8/kernel_ab.json",
           ((("rows", {"kernel": "none", "side": "cloud"}, "x_off", "min"), ".1f"),
            (("rows", {"kernel": "none", "side": "cloud"}, "x_off", "max"), ".1f"))),
    Figure("README.md", "int8 there still runs local-only at {}x float32", "bench/weights-auto/smollm2-no-kernels/formats.json",
           ((Q(("generations", "int8", "tok_s"), ("generations", "float32", "tok_s")), ".1f"),)),
    Figure("README.md", "no network, ran at **{} tok/s**: on this machine the split is much slower than local, at {}x",
           README_RUN, (((*LOCAL_ONLY, "tokens_per_s_whole_set"), ".1f"), (tree80("vs_local_only_whole_set"), ".2f"))),
    Figure("README.md", "the default strategy `tree` ran at {} tok/s ({}), {}x split sequential decoding ({} tok/s); "
           "`tree-nohead` (the same tree, never drafting with the learned head) ran at {} tok/s", README_RUN,
           ((tree80("tokens_per_s_whole_set"), ".1f"), (tree80("tokens_per_s_whole_set"), ""),
            (tree80("speedup_whole_set"), ".2f"), ((*AT80, {"strategy": "sequential"}, "tokens_per_s_whole_set"), ""),
            ((*AT80, {"strategy": "tree-nohead"}, "tokens_per_s_whole_set"), ".1f"))),
    Figure("README.md", "(local-only) ran at {} tok/s ({}) and plain transformers float32 greedy decoding at {}:",
           README_RUN, (((*LOCAL_ONLY, "tokens_per_s_whole_set"), ".1f"), ((*LOCAL_ONLY, "tokens_per_s_whole_set"), ""),
                        ((*LOCAL_ONLY, "transformers", "tokens_per_s_whole_set"), ".1f"))),
    Figure("README.md", "Split sequential decoding equalled local-only in {} prompts", README_RUN,
           (((*LOCAL_ONLY, "identical_to_split_sequential", "80"), "s"),)),
    Figure("README.md", "with a float32 wire had split sequential equal to local-only in {} prompts",
           "bench/readme-wire-float32/speculative.json", (((*LOCAL_ONLY, "identical_to_split_sequential", "0"), "s"),)),
    Figure("README.md", "the tree ran {}x faster in int8 than in float32 ({} against {} tok/s; these prompts accept "
           "fewer drafted tokens than the table's, {} a step", SPEC_FORMATS,
           ((Q(spec_format("int8", "tree@80"), spec_format("float32", "tree@80")), ".2f"),
            (spec_format("int8", "tree@80"), ".1f"), (spec_format("float32", "tree@80"), ".1f"),
            (spec_format("int8", "tree@80", "emitted_per_step"), ".2f"))),
    Figure("README.md", "these prompts accept fewer drafted tokens than the table's, 2.37 a step against {}),",
           README_RUN, ((tree80("mean_accepted_pooled"), ".2f"),)),
    Figure("README.md", "the round trip {} of a step ([run](notes/bench/spec-formats/formats.md))", SPEC_FORMATS,
           ((spec_format("int8", "tree@80", "rtt_efficiency"), ".2f"),)),
    Figure("README.md", "on the held-out prompts {}x over the set and {}x the median prompt", HELDOUT_FORMATS,
           ((Q(spec_format("int8", "tree@80"), spec_format("float32", "tree@80")), ".2f"),
            (("paired", "int8", "tree@80", "median"), ".2f"))),
    Figure("README.md", "int8 ran {}x llama.cpp on the same GGUF", FORMATS,
           ((("generations", "int8", "x_llamacpp"), ".2f"),)),
    Figure("README.md", "int8 over the float16 wire cost {} perplexity and its greedy replies equalled float32's in "
           "{} of {} prompts", EXACTNESS,
           ((exact_row("int8", "float16", "perplexity_vs_reference"), "+.2%"),
            (exact_row("int8", "float16", "identical_replies"), ""), (exact_row("int8", "float16", "prompts"), ""))),
    Figure("README.md", "a one-row cloud step took {} ms, {}x its weights' bytes at the measured bandwidth plus its "
           "attention; eight rows {} ms, {}x", STEP_INT8,
           ((cloud_step(64, 1, "splitinfer_ms"), ".2f"), (cloud_step(64, 1, "x_weights_attention"), ".2f"),
            (cloud_step(64, 8, "splitinfer_ms"), ".2f"), (cloud_step(64, 8, "x_weights_attention"), ".2f"))),
    Figure("README.md", "timed the 28-layer cloud step at {} ms replayed as a CUDA graph, {}x its bytes bound, and a "
           "64-row tree step at {} ms. In that run `serve` ran the step eager, {} ms", H200,
           ((gpu_step(64, 1, "graph_ms"), ".1f"), (Q(gpu_step(64, 1, "graph_ms"), gpu_step(64, 1, "bound_ms")), ".1f"),
            (gpu_step(64, 64, "graph_ms"), ".1f"), (gpu_step(64, 1, "eager_ms"), ".1f"))),
    Figure("docs/compared.md", "splitinfer's default int8 ran at {}x the tok/s of llama.cpp", FORMATS,
           ((("generations", "int8", "x_llamacpp"), ".2f"),)),
    Figure("README.md", "Mistral 7B at k = m = 2 in float16 needs {} GB of local and {} GB of cloud weights",
           "plan:mistral-7b-v0.1", ((("local_weight_bytes",), ".2f", 1e-9), (("cloud_weight_bytes",), ".1f", 1e-9))),
    Figure("README.md", "it recovered {} of prompt tokens in the stored audit at every split depth measured", AUDIT,
           ((("results", {"threat": "T0", "defence": "none", "side": "input", "attacker": "A4"}, "top1", "min"),
             ".0%"),)),
)

PRIVACY = "docs/privacy.md"
QUICK = "privacy/quick/audit.json"
T3 = "privacy/t3/audit.json"  # the linear key's T3 rows at full size (notes/privacy/t3/README.md)
T3_BEST = ("T3", "secret linear key", "input", "A9 whitening + fobi (29448 tokens of traffic) + A2")
T3_OUTPUT = ("T3", "secret linear key", "output", "A9 whitening + cross (19378 tokens of traffic) + A4")
METADATA = "privacy/metadata-steps/audit.json"
PADDING = "bench/padding-steps/speculative.json"
A4_T0 = ("T0", "none")
FULL_PADDING = "padding 33 rows, prompts 256, steps 64, hold 120 ms, think 60 ms"
FIGURES += (
    Figure(PRIVACY, "every prompt token ({} of {} test tokens at 1, 2, 4, 6 and 8 local layers)", AUDIT,
           ((audit(*A4_T0, "input", "A4", depth=0, reduce="min"), ".0%"),
            (audit(*A4_T0, "input", "A4", "n_tokens", depth=0, reduce="max"), ","))),
    Figure(PRIVACY, "essentially every generated token ({}-{} of {} at 1-8 tail layers)", AUDIT,
           ((audit(*A4_T0, "output", "A4", depth=0, reduce="min"), ".1f", 100),
            (audit(*A4_T0, "output", "A4", depth=0, reduce="max"), ".0%"),
            (audit(*A4_T0, "output", "A4", "n_tokens", depth=0, reduce="max"), ","))),
    Figure(PRIVACY, "the deployment learns to read {} of prompt tokens", AUDIT,
           ((audit("T2", "private weights", "input", "A2 N=100000"), ".0%"),)),
    Figure(PRIVACY, "but lets inner products through ({} of prompt tokens)", QUICK,
           ((audit("T3", "secret basis", "input", reduce="max"), ".0%"),)),
    Figure(PRIVACY, "and cost {} of decode speed (measured under load)", "privacy/basis_check_linear.json",
           ((Q(("decode_tok_s_median", "keyed"), ("decode_tok_s_median", "public")), "1-.1%"),)),
    Figure(PRIVACY, "a keyed norm in the cloud's layers; decode {} slower", "privacy/basis_check_linear.json",
           ((Q(("decode_tok_s_median", "keyed"), ("decode_tok_s_median", "public")), "1-.1%"),)),
    Figure("docs/deploy.md", "(same outputs, decode {} slower in its stored check)", "privacy/basis_check_linear.json",
           ((Q(("decode_tok_s_median", "keyed"), ("decode_tok_s_median", "public")), "1-.1%"),)),
    Figure(PRIVACY, "at most {} of decode speed", "privacy/basis_check_linear.json",
           ((Q(("decode_tok_s_median", "keyed"), ("decode_tok_s_median", "public")), "1-.1%"),)),
    Figure(PRIVACY, "the very documents in the traffic (it reads {})", QUICK,
           ((audit("T5", "secret linear key", "input", "A9 whitening + cross (its own text unpaired, 2688 tokens) + A2"),
             ".0%"),)),
    Figure(PRIVACY, "the host still recovers {} at 1-8 local layers", AUDIT,
           ((audit(*A4_T0, "input", "A4", depth=0, reduce="min"), ".0%"),)),
    Figure(PRIVACY, "the head took {} ms at k = 1 and {} ms at k = 8", AUDIT,
           ((("depth_costs", {"side": "input", "depth": 1}, "local_ms_per_token"), ".1f"),
            (("depth_costs", {"side": "input", "depth": 8}, "local_ms_per_token"), ".1f"))),
    Figure(PRIVACY, "the known-weights attacker still reads {} (sigma 0.1) and {} (0.5)", AUDIT,
           ((audit("T0", "noise sigma=0.1", "input", "A4"), ".1%"), (audit("T0", "noise sigma=0.5", "input", "A4"), ".1%"))),
    Figure(PRIVACY, "greedy output changes at {} and {} of positions", AUDIT,
           ((("defences", {"defence": "noise sigma=0.1"}, "utility", "greedy_agreement"), "1-.0%"),
            (("defences", {"defence": "noise sigma=0.5"}, "utility", "greedy_agreement"), "1-.0%"))),
    Figure(PRIVACY, "on the output side ({} -> {}); an attacker pushing 10^5 tokens of its own text through them reads {}",
           AUDIT, ((audit(*A4_T0, "output", "A4"), ".0%"), (audit("T1", "private weights", "output", "A4"), ".0%"),
                   (audit("T2", "private weights", "input", "A2 N=100000"), ".1%"))),
    Figure(PRIVACY, "perplexity {} -> {}, greedy agreement {}", AUDIT,
           ((("defences", {"defence": "private weights"}, "utility", "reference_perplexity"), ".2f"),
            (("defences", {"defence": "private weights"}, "utility", "perplexity"), ".2f"),
            (("defences", {"defence": "private weights"}, "utility", "greedy_agreement"), ".1%"))),
    Figure(PRIVACY, "(perplexity {} -> {}, {} greedy agreement)", AUDIT,
           ((("defences", {"defence": "private weights"}, "utility", "reference_perplexity"), ".1f"),
            (("defences", {"defence": "private weights"}, "utility", "perplexity"), ".1f"),
            (("defences", {"defence": "private weights"}, "utility", "greedy_agreement"), ".0%"))),
    Figure(PRIVACY, "a reader without the cloud shard: {} of prompt tokens (prior {}); the host: {}", QUICK,
           ((audit("T3", "secret basis", "input", "A6 inner products (24 anchors)"), ".1%"),
            (audit("T3", "secret basis", "input", "A6 inner products (24 anchors)", "baseline_top1"), ".1%"),
            (audit("T4", "secret basis", "input"), ".0%"))),
    Figure("docs/deploy.md", "not one that collects the deployment's traffic (it read {} of prompt tokens in the "
           "stored audit)", T3, ((audit(*T3_BEST), ".1%"),)),
    Figure(PRIVACY, "the same reader, once it aligns the deployment's traffic: {} of prompt tokens (prior {})", T3,
           ((audit(*T3_BEST), ".1%"), (audit(*T3_BEST, "baseline_top1"), ".1%"))),
    Figure(PRIVACY, "the host: {}; 10^3 known (text, activation) pairs undo it", QUICK,
           ((audit("T4", "secret linear key", "input"), ".0%"),)),
    # the boundary the full-size run measured: the best attacker on either side, with its interval and the prior's
    Figure(PRIVACY, "on {} tokens of traffic, then a learned decoder), read **{} of prompt tokens [{}, {}] against a "
           "prior of {} [{}, {}]: {} points over it**; on generated tokens the best reached {} against {}.", T3,
           ((audit(*T3_BEST, "traffic_tokens"), ","), (audit(*T3_BEST), ".1%"),
            ((*audit(*T3_BEST, "top1_ci"), 0), ".1%"), ((*audit(*T3_BEST, "top1_ci"), 1), ".1%"),
            (audit(*T3_BEST, "baseline_top1"), ".1%"), ((*audit(*T3_BEST, "baseline_top1_ci"), 0), ".1%"),
            ((*audit(*T3_BEST, "baseline_top1_ci"), 1), ".1%"),
            (D(audit(*T3_BEST), audit(*T3_BEST, "baseline_top1")), ".1f", 100),
            (audit(*T3_OUTPUT), ".1%"), (audit(*T3_OUTPUT, "baseline_top1"), ".1%"))),
    Figure(PRIVACY, "up to {} tokens of other sessions' traffic: {} minutes for one key's T3 on one core", T3,
           ((("config", "basis", "traffic_tokens", -1), ","), (("wall_seconds",), ".0f", 1 / 60))),
    Figure(PRIVACY, "a reader from the rows ({})", AUDIT,
           ((("depth_identification", "split_range", "whole vector", "row_accuracy"), ".1%"),)),
    Figure(PRIVACY, "from nothing measurable to {}x the speed at 80 ms", PADDING,
           ((Q(padded("tree+pad33+s64+h120+t60", 80.0), padded("tree", 80.0)), ".2f"),)),
    Figure(PRIVACY, "| unpadded | {} | {} | - | {} |", PADDING,
           ((padded("tree", 0.0), ""), (padded("tree", 80.0), ""), (padded("tree", 80.0, "median_bytes_per_step"), ",.0f"))),
    *(Figure(PRIVACY, f"| {label} | {{}} | {{}} | {bold}{{}}x{bold} | {{}} |", PADDING,
             ((padded(strategy, 0.0), ""), (padded(strategy, 80.0), ""),
              (Q(padded(strategy, 80.0), padded("tree", 80.0)), form),
              (padded(strategy, 80.0, "median_bytes_per_step"), ",.0f")))
      for label, strategy, bold, form in (("`33` (sizes and prompts)", "tree+pad33", "", ".2f"),
                                          ("`33+s64` (+ steps)", "tree+pad33+s64", "**", ".3f"),
                                          ("`33+s64+h120+t60` (+ timing)", "tree+pad33+s64+h120+t60", "**", ".3f"),
                                          ("sequential, unpadded", "sequential", "", ".3f"))),
    Figure(PRIVACY, "[notes/bench/padding](../notes/bench/padding/README.md), {}x at 0 ms and {}x at 80 ms)",
           "bench/padding/speculative.json",
           ((Q(padded("tree+pad33", 0.0), padded("tree", 0.0)), ".3f"),
            (Q(padded("tree+pad33", 80.0), padded("tree", 80.0)), ".3f"))),
    Figure(PRIVACY, "only bytes: {} a decode step", PADDING, ((padded("tree+pad33", 80.0, "median_bytes_per_step"), ",.0f"),)),
    Figure(PRIVACY, "the padded tree runs below sequential decoding ({}x of it at 80 ms)", PADDING,
           ((Q(padded("tree+pad33+s64", 80.0), padded("sequential", 80.0)), ".2f"),)),
    Figure(PRIVACY, "Timing floors cost a further {} at 80 ms", PADDING,
           ((Q(padded("tree+pad33+s64+h120+t60", 80.0), padded("tree+pad33+s64", 80.0)), "1-.0%"),)),
    # half a decode step's bytes (one message) at 100 Mbit/s, in ms
    Figure(PRIVACY, "at 100 Mbit/s each padded message takes about {} ms to send", PADDING,
           ((padded("tree+pad33", 80.0, "median_bytes_per_step"), ".1f", 0.5 * 8 / 100e6 * 1e3),)),
    Figure(PRIVACY, "but they hide little: the category still {} (chance {}) and a known document {}", METADATA,
           ((audit("T6", "padding 33 rows, prompts 256", "category", depth=0, reduce="max"), ".1%"),
            (audit("T6", "padding 33 rows, prompts 256", "category", key="baseline_top1", depth=0, reduce="max"), ".0%"),
            (audit("T6", "padding 33 rows, prompts 256", "document", depth=0, reduce="max"), ".1%"))),
    Figure(PRIVACY, "bring the measured attackers to within {} points of chance", METADATA,
           ((D(audit("T6", FULL_PADDING, "category", depth=0, reduce="max"),
               audit("T6", FULL_PADDING, "category", key="baseline_top1", depth=0, reduce="max")), ".1f", 100),)),
    Figure(PRIVACY, "points of chance, at {}-{}x of the unpadded rate", PADDING,
           ((Q(padded("tree+pad33+s64+h120+t60", 80.0), padded("tree", 80.0)), ".2f"),
            (Q(padded("tree+pad33+s64", 80.0), padded("tree", 80.0)), ".2f"))),
)

BENCH = "docs/benchmarks.md"
# `prepare --weights auto` on the files users download: (the table's row label, its run under notes/bench/weights-auto)
AUTO_ROWS = (("SmolLM2-135M (Q4_1), splitinfer's", "smollm2"),
             ("SmolLM2-135M (Q4_1), none: FBGEMM's int8 product", "smollm2-no-kernels"),
             ("Gemma 3 270M (Q4_K_M), splitinfer's", "gemma3"))
FORMAT_ROWS = (("float32", "float32"), ("bfloat16", "bfloat16"), ("**int8 (the default for this GGUF)**", "int8"),
               ("int4", "int4"), ("int4,lm_head=int8 (the blocks as shipped)", "int4,lm_head=int8"),
               ("int4,cloud=int8,lm_head=int8", "int4,cloud=int8,lm_head=int8"))
SHIPPED_BLOCKS = "local=int4,cloud=int4,lm_head=int8"


def seq(rtt: float, key: str = "tokens_per_s_whole_set") -> tuple:
    return (*("summary", "rows"), {"rtt_ms": rtt, "strategy": "sequential"}, key)


def tree(rtt: float, key: str) -> tuple:
    return (*("summary", "rows"), {"rtt_ms": rtt, "strategy": "tree"}, key)


FIGURES += (
    Figure(BENCH, "| the whole model in one process (local-only) | {} | - | - |", README_RUN,
           (((*LOCAL_ONLY, "tokens_per_s_whole_set"), ""),)),
    Figure(BENCH, "| split on one machine, no added round trip: sequential | {} | - | {}x |", README_RUN,
           ((seq(0.0), ""), (seq(0.0, "vs_local_only_whole_set"), ""))),
    Figure(BENCH, "| split on one machine, no added round trip: `tree` | {} | {}x | {}x |", README_RUN,
           ((tree(0.0, "tokens_per_s_whole_set"), ""), (tree(0.0, "speedup_whole_set"), ""),
            (tree(0.0, "vs_local_only_whole_set"), ""))),
    Figure(BENCH, "| split over an emulated 80 ms round trip: sequential | {} | - | {}x |", README_RUN,
           ((seq(80.0), ""), (seq(80.0, "vs_local_only_whole_set"), ""))),
    Figure(BENCH, "| split over an emulated 80 ms round trip: `tree` | {} | {}x | {}x |", README_RUN,
           ((tree(80.0, "tokens_per_s_whole_set"), ""), (tree(80.0, "speedup_whole_set"), ""),
            (tree(80.0, "vs_local_only_whole_set"), ""))),
    Figure(BENCH, "At 80 ms the tree commits {} tokens a round trip and the round trip is {} of its step", README_RUN,
           ((tree(80.0, "mean_accepted_pooled"), ""), (tree(80.0, "rtt_efficiency"), ""))),
    Figure(BENCH, "differ from local-only's where two logits nearly tie ({} prompts equal here)", README_RUN,
           (((*LOCAL_ONLY, "identical_to_split_sequential", "80"), "s"),)),
    *(Figure(BENCH, f"\n| {label} | {{}} | {{}} | {{}} |", FORMATS,  # at a line's start: the table above has these labels
             ((("generations", name, "tok_s"), ""), (("generations", name, "speedup_vs_transformers_f32"), ""),
              (("generations", name, "x_llamacpp"), "")))
      for label, name in FORMAT_ROWS if "default" not in label),
    Figure(BENCH, "| **int8 (the default for this GGUF)** | **{}** | **{}** | **{}** |", FORMATS,
           ((("generations", "int8", "tok_s"), ""), (("generations", "int8", "speedup_vs_transformers_f32"), ""),
            (("generations", "int8", "x_llamacpp"), ""))),
    *(Figure(BENCH, f"| {weights} | {wire} | {{}} | {{}} | {{}} | {{}} of {{}} | {{}} of {{}} |", EXACTNESS,
             ((exact_row(weights, wire, "perplexity_vs_reference"), "+.2%"),
              (exact_row(weights, wire, "top1_agreement"), ".2%"), (exact_row(weights, wire, "top1_along_replies"), ".2%"),
              (exact_row(weights, wire, "identical_replies"), ""), (exact_row(weights, wire, "prompts"), ""),
              (exact_row(weights, wire, "tree_equals_sequential"), ""), (exact_row(weights, wire, "prompts"), "")))
      for weights in ("float32", "bfloat16", "int8", "int4", "int4,lm_head=int8")
      for wire in ("float32", "float16", "bfloat16")),
    Figure(BENCH, "int8, the default, with the float16 wire: {} perplexity, {} of the held-out top-1s, {} of {} "
           "replies equal to the reference's", EXACTNESS,
           ((exact_row("int8", "float16", "perplexity_vs_reference"), "+.2%"),
            (exact_row("int8", "float16", "top1_agreement"), ".2%"), (exact_row("int8", "float16", "identical_replies"), ""),
            (exact_row("int8", "float16", "prompts"), ""))),
    Figure(BENCH, "Perplexity and top-1 agreement are measured on the {} tokens of the held-out text", EXACTNESS,
           ((exact_row("float32", "float32", "heldout_tokens"), ""),)),
    *(Figure(BENCH, f"| {label} | {{}} | {{}} | {{}} | {{}} | {{}} | {{}} |", f"bench/weights-auto/{run}/formats.json",
             ((("generations", "float32", "tok_s"), ""), (("generations", "int8", "tok_s"), ""),
              (Q(("generations", "int8", "tok_s"), ("generations", "float32", "tok_s")), ".2f"),
              (("quality", "int8", "perplexity_vs_float32"), "+.2%"), (("quality", "int8", "identical_replies"), "s"),
              (("tree_equals_sequential", "int8"), "s")))
      for label, run in AUTO_ROWS),
    Figure(BENCH, "Plain transformers float32 ran at {} tok/s and llama.cpp (its Python binding, one thread, the "
           "same GGUF) at {} in the same run", FORMATS,
           ((("generations", "transformers", "tok_s"), ""), (("generations", "llama.cpp", "tok_s"), ""))),
    Figure(BENCH, "The blocks as shipped run one process faster ({} against {} tok/s).", FORMATS,
           ((("generations", "int4,lm_head=int8", "tok_s"), ""), (("generations", "int8", "tok_s"), ""))),
    Figure(BENCH, "| float32 | {} | {} | - | {} | {} |", SPEC_FORMATS,
           ((spec_format("float32", "sequential@80"), ""), (spec_format("float32", "tree@80"), ""),
            (spec_format("float32", "tree@80", "emitted_per_step"), ""),
            (spec_format("float32", "tree@80", "rtt_efficiency"), ""))),
    Figure(BENCH, "| int4,lm_head=int8 (as shipped) | {} | {} | {}x ({}x) | {} | {} |", SPEC_FORMATS,
           ((spec_format(SHIPPED_BLOCKS, "sequential@80"), ""), (spec_format(SHIPPED_BLOCKS, "tree@80"), ""),
            (Q(spec_format(SHIPPED_BLOCKS, "tree@80"), spec_format("float32", "tree@80")), ".2f"),
            (("paired", SHIPPED_BLOCKS, "tree@80", "median"), ""),
            (spec_format(SHIPPED_BLOCKS, "tree@80", "emitted_per_step"), ""),
            (spec_format(SHIPPED_BLOCKS, "tree@80", "rtt_efficiency"), ""))),
    Figure(BENCH, "| **int8 (the default)** | {} | {} | **{}x ({}x)** | {} | {} |", SPEC_FORMATS,
           ((spec_format("int8", "sequential@80"), ""), (spec_format("int8", "tree@80"), ""),
            (Q(spec_format("int8", "tree@80"), spec_format("float32", "tree@80")), ".2f"),
            (("paired", "int8", "tree@80", "median"), ""),
            (spec_format("int8", "tree@80", "emitted_per_step"), ""),
            (spec_format("int8", "tree@80", "rtt_efficiency"), ""))),
    Figure(BENCH, "the default's tree ran {}x float32 over the set and {}x the median prompt", HELDOUT_FORMATS,
           ((Q(spec_format("int8", "tree@80"), spec_format("float32", "tree@80")), ".2f"),
            (("paired", "int8", "tree@80", "median"), ".2f"))),
    Figure(BENCH, "cached rows): {} ms at one row and {} ms at eight, {}x and {}x its weights' bytes", STEP_INT8,
           ((cloud_step(64, 1, "splitinfer_ms"), ""), (cloud_step(64, 8, "splitinfer_ms"), ""),
            (cloud_step(64, 1, "x_weights_attention"), ""), (cloud_step(64, 8, "x_weights_attention"), ""))),
    Figure(BENCH, "the local side (2 + 2 layers, final norm, LM head) {} ms at one row", STEP_INT8,
           ((("rows", {"side": "local", "context": 64, "rows": 1}, "splitinfer_ms"), ""),)),
    Figure(BENCH, "the local side holds {} GB of weights and the cloud {} GB", "plan:mistral-7b-v0.1",
           ((("local_weight_bytes",), ".2f", 1e-9), (("cloud_weight_bytes",), ".1f", 1e-9))),
    Figure(BENCH, "two threads): {} ms a step in float32, {} in bfloat16, {} in int8, {} in int4",
           "bench/trusted-7b/trusted-half.json",
           tuple((("rows", {"side": "local", "format": f, "threads": 2, "context": 64, "rows": 1}, "splitinfer_ms"), "")
                 for f in ("float32", "bfloat16", "int8", "int4"))),
    *(Figure(BENCH, text, f"bench/threads-7b/{run}/step.json",
             ((("rows", {"side": "local", "context": 64, "rows": 1}, "splitinfer_ms"), ""),))
      for text, run in (("two threads): {} ms a step in int8", "mistral-int8-2t"),
                        ("in int8 ({} with the build before", "mistral-int8-2t-before"),
                        ("{} in int4, and", "mistral-int4-2t"), ("{} in int8 in Llama-3.1-8B's shape", "llama-int8-2t"))),
    *(Figure(BENCH, text, f"bench/amx-7b/{run}/step.json",
             tuple((("rows", {"side": "local", "context": ctx, "rows": q}, key), "") for ctx, q, key in keys))
      for text, run, keys in (
          ("int8 {} ms a step at one row and {} at sixteen against a bytes bound of {} ms", "mistral-int8-2t",
           ((64, 1, "splitinfer_ms"), (64, 16, "splitinfer_ms"), (64, 16, "bound_ms"))),
          ("compute bound at tdpbusd's measured peak: {} ms at sixteen rows", "mistral-int8-2t",
           ((64, 16, "compute_bound_ms"),)),
          ("in Llama-3.1-8B's shape {} and {} against {}.", "llama-int8-2t",
           ((64, 1, "splitinfer_ms"), (64, 16, "splitinfer_ms"), (64, 16, "bound_ms"))),
          ("sixteen rows the attention is what remains: {} ms against {}.", "mistral-int8-2t",
           ((2048, 16, "splitinfer_ms"), (2048, 16, "bound_ms"))))),
    *(Figure(BENCH, text, f"bench/row-work-7b/{run}/step.json",
             tuple((("rows", {"side": "local", "context": ctx, "rows": q}, key), "") for ctx, q, key in keys))
      for text, run, keys in (
          ("../notes/bench/row-work-7b/README.md)): {}\n  ms at one row and {} at sixteen against {}", "mistral-int8-2t",
           ((64, 1, "splitinfer_ms"), (64, 16, "splitinfer_ms"), (64, 16, "bound_ms"))),
          ("and {} and {} against {} in Llama-3.1-8B's shape,\n  within 1.3", "llama-int8-2t",
           ((64, 1, "splitinfer_ms"), (64, 16, "splitinfer_ms"), (64, 16, "bound_ms"))),
          ("sixteen rows\n  {} ms against {}, the attention's", "mistral-int8-2t",
           ((2048, 16, "splitinfer_ms"), (2048, 16, "bound_ms"))))),
    Figure(BENCH, "one layer's call at sixteen rows and 2,048 cached tokens {} ms before, {} after",
           "bench/attention-spans/attention_ab.json",
           ((("rows", {"context": 2048, "rows": 16}, "before_ms"), ""), (("rows", {"context": 2048, "rows": 16}, "after_ms"), ""))),
    Figure(BENCH, "and the step {} ms against a bytes bound of {}.", "bench/attention-spans/mistral-int8-2t/step.json",
           ((("rows", {"side": "local", "context": 2048, "rows": 16}, "splitinfer_ms"), ""),
            (("rows", {"side": "local", "context": 2048, "rows": 16}, "bound_ms"), ""))),
    *(Figure(BENCH, text, f"bench/lm-head-7b/{run}/step.json", ((("rows", {"rows": q}, "splitinfer_ms"), ""),))
      for text, run, q in (("`, [notes/bench/lm-head-7b](../notes/bench/lm-head-7b/README.md)) took {} ms at one row",
                            "llama-int8-head4-2t", 1),
                           ("at one row against {} with the int8 head", "llama-int8-2t", 1),
                           ("with the int8 head, and {} against", "llama-int8-head4-2t", 16),
                           ("against {} at sixteen: its product runs on VNNI", "llama-int8-2t", 16))),
    Figure(BENCH, "the AVX-512 VNNI path took {} times as long at one row and {} times at sixteen",
           "bench/amx-7b/kernel-ab/kernel_ab.json",
           ((("rows", {"kernel": "amx", "rows": 1}, "x_off"), ""), (("rows", {"kernel": "amx", "rows": 16}, "x_off"), ""))),
    Figure(BENCH, "{} ms a tree step in int8, {} tok/s at 80 ms", "bench/paper-projection-amx/projection.json",
           ((("rows", {"strategy": "tree", "trusted": "this CPU, int8, 2 thread(s)"}, "local_ms"), ""),
            (("rows", {"strategy": "tree", "trusted": "this CPU, int8, 2 thread(s)"}, "tokens_per_s", "80"), ""))),
    Figure(BENCH, "at 80 ms the tree would reach {} tok/s (trusted half in bfloat16 or int4) against the paper's {} "
           "measured", "bench/paper-projection/projection.json",
           ((("rows", {"strategy": "tree", "trusted": "this CPU, bfloat16, 2 thread(s)"}, "tokens_per_s", "80"), ""),
            (("paper", "measured", "lookahead", 1), ""))),
    Figure(BENCH, "the cloud half only (28 layers in bfloat16, {} GB)", H200, ((("weight_bytes",), ".1f", 1e-9),)),
    Figure(BENCH, "against the bytes bound at the measured {} GB/s", H200, ((("bandwidth_gbps",), ",.0f"),)),
    *(Figure(BENCH, f"| {context:,} | {rows} | {{}} | {{}} | {{}} |", H200,
             ((gpu_step(context, rows, "eager_ms"), ".2f"), (gpu_step(context, rows, "graph_ms"), ".2f"),
              (gpu_step(context, rows, "bound_ms"), ".2f")))
      for context in (64, 2048) for rows in (1, 64)),
    Figure(BENCH, "As a graph, 64 rows cost {}x one", H200,
           ((Q(gpu_step(64, 64, "graph_ms"), gpu_step(64, 1, "graph_ms")), ".1f"),)),
)

SOAK = "bench/soak/4-60min-capped/soak.json"
FIGURES += (
    Figure("docs/security.md", "With all of them the measured attackers are within {} points of chance", METADATA,
           ((D(audit("T6", FULL_PADDING, "category", depth=0, reduce="max"),
               audit("T6", FULL_PADDING, "category", key="baseline_top1", depth=0, reduce="max")), ".1f", 100),)),
    Figure("docs/security.md", "passed: {} requests, every one equal to its solo run, {} failed, and the servers' "
           "resident memory rose {} and {} MiB a minute", SOAK,
           ((("counts", "completed"), ","), (("counts", "failed"), ""),
            (("fits", "server 0", "rss_mib", "slope_per_min"), ".3f"),
            (("fits", "server 1", "rss_mib", "slope_per_min"), ".3f"))),
)

# Numbers in prose that are settings, definitions or design constants, not measurements: (page, passage).
SETTINGS = (
    ("docs/api.md", "OpenAI's default 1.0 samples"),
    ("docs/deploy.md", "with Python 3.10+"),
    ("docs/quickstart.md", "OpenAI's default 1.0 samples"),
    (PRIVACY, "(sigma 0.1) and"),
    (PRIVACY, "(0.5)"),
    (PRIVACY, "are within the 10% at 80 ms"),
    (PRIVACY, "far over the 10% that a recommendation needs"),
    (BENCH, "kept perplexity within 1% of float32"),
    (BENCH, "within 1.3 times of the bound"),  # the issue's target
    (BENCH, "in Llama-3.1-8B's shape"),  # a model's name
    ("docs/security.md", "(TLS 1.2 or newer"),
    ("docs/security.md", "each delay jittered to 50-100%"),
    ("docs/design.md", "and at 4.5k tokens of context"),  # what the tests cover
    ("docs/design.md", "cut below a path probability of 0.01"),  # design constants
    ("docs/design.md", "padded rows at most 1.5x the real rows"),
    ("docs/design.md", "not one padded to 17 x 512 rows"),
)


# -- reading a page and a run -----------------------------------------------------------------------------
NUMBER = r"\d+ of \d+|[+-]?\d[\d,]*(?:\.\d+)?%?"
# A figure in prose: a decimal number, or a whole number written as a ratio, a percentage or a rate.
TOKEN = re.compile(r"(?<![\w.,/])\d+(?:,\d{3})*(?:\.\d+(?![.\d])|(?=\s?(?:x\b|%|tok/s)))")
NOT_PROSE = (r"```.*?```", r"`[^`\n]*`", r"<!--.*?-->", r"\]\([^)]*\)",
             r"<!-- bench-spec results.*?<!-- end of bench-spec results -->",
             r"<!-- threat-table:begin -->.*?<!-- threat-table:end -->",
             r"<!-- trusted-half:start -->.*?<!-- trusted-half:end -->")
PAGES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
# written from the CLI by scripts/config_reference.py, which test_docs.py checks is current
GENERATED_PAGES = tuple(p for p in PAGES if Path(p).name.startswith("configuration"))



def passage(text: str, figures: bool = True) -> re.Pattern:
    """A passage as a pattern: line breaks and runs of spaces free, each `{}` a number."""
    parts = []
    for i, literal in enumerate(text.split("{}")):
        if i:
            parts.append(f"({NUMBER})")
        parts.append(r"\s+".join(re.escape(word) for word in literal.split(" ")))
    return re.compile("".join(parts))


def load(run: str):
    if run.startswith("plan:"):
        from splitinfer.bench.plan import load_config, plan

        return plan(load_config(run.removeprefix("plan:"))[1])
    return json.loads((NOTES / run).read_text())


def follow(data, path):
    if isinstance(path, Q):
        return follow(data, path.num) / follow(data, path.den)
    if isinstance(path, D):
        return follow(data, path.a) - follow(data, path.b)
    items, many = [data], False
    for key in path:
        if key in ("min", "max", "count"):
            items, many = [{"min": min, "max": max, "count": len}[key](items)], False
        elif isinstance(key, dict):
            pool = items if many else [x for item in items for x in item]  # a list's items, or those already picked
            items = [x for x in pool if all(x.get(k) == v for k, v in key.items())]
            assert items, f"no item has {key}"
            many = True
        else:
            items = [item[key] for item in items]
    assert len(items) == 1 or not many, f"{path} leads to {len(items)} values; reduce them with min, max or count"
    return items[0]


def written(value, form: str, scale: float = 1.0) -> str:
    if form == "s":
        return str(value)
    if form.startswith("1-"):
        value, form = 1 - value, form[2:]
    value = value * scale if scale != 1.0 else value
    return format(value, form) if form else str(value)


# -- the checks ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f"{f.page}:{f.text[:40]}")
def test_every_quoted_figure_is_its_stored_runs(figure):
    text = (ROOT / figure.page).read_text()
    found = list(passage(figure.text).finditer(text))
    assert found, f"{figure.page} no longer says {figure.text!r}: fix the page or this table"
    data = load(figure.run)
    expected = [written(follow(data, v[0]), v[1], *v[2:]) for v in figure.values]
    for match in found:
        quoted = list(match.groups())
        assert len(quoted) == len(expected), f"{figure.text!r} has {len(quoted)} figures and {len(expected)} values"
        assert quoted == expected, (
            f"{figure.page}: {match.group(0)!r} quotes {quoted}, the stored run {figure.run} says {expected}")


def prose_tokens(page: str) -> list[tuple[int, str]]:
    """(offset, figure) of every figure in a page's prose."""
    text = (ROOT / page).read_text()
    hidden = [m.span() for pattern in NOT_PROSE for m in re.finditer(pattern, text, re.S)]
    return [(m.start(), m.group(0)) for m in TOKEN.finditer(text) if not any(a <= m.start() < b for a, b in hidden)]


@pytest.mark.parametrize("page", [p for p in PAGES if p not in GENERATED_PAGES])
def test_no_figure_goes_unchecked(page):
    text = (ROOT / page).read_text()
    covered: list[tuple[int, int]] = []
    for figure in (f for f in FIGURES if f.page == page):
        for match in passage(figure.text).finditer(text):
            covered += [match.span(i + 1) for i in range(len(figure.values))]
    for setting in (s for s in SETTINGS if s[0] == page):
        spans = [m.span() for m in passage(setting[1]).finditer(text)]
        assert spans, f"{page} no longer says {setting[1]!r}: remove it from SETTINGS"
        covered += spans
    loose = [f"{page}:{text[:at].count(chr(10)) + 1}: {figure} ({' '.join(text[at - 50:at + 20].split())})"
             for at, figure in prose_tokens(page) if not any(a <= at < b for a, b in covered)]
    assert not loose, ("figures no stored run vouches for; tie each to its JSON in FIGURES (or, for a setting, "
                       "list it in SETTINGS):\n" + "\n".join(loose))


def test_the_readmes_table_is_the_stored_runs(tmp_path):
    from splitinfer.bench.spec_readme import replace_results

    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    replace_results(readme, load(README_RUN), tmp_path / "notes/bench/readme/speculative.md")
    assert readme.read_text() == (ROOT / "README.md").read_text(), (
        "the README's bench-spec table is not what `bench spec --readme` writes from notes/bench/readme/speculative.json")


def test_the_privacy_threat_table_is_the_stored_audits():
    from splitinfer.privacy.table import BEGIN, END, threat_table

    audits = ("notes/privacy/audit.json", "notes/privacy/t3/audit.json", "notes/privacy/quick/audit.json",
              "notes/privacy/metadata-steps/audit.json")
    table = threat_table([(path, json.loads((ROOT / path).read_text())) for path in audits])
    page = (ROOT / "docs/privacy.md").read_text()
    assert page.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") == table, (
        "docs/privacy.md's threat table is not what `splitinfer privacy table` writes from " + ", ".join(audits))
