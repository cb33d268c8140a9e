"""`splitinfer bench formats`: every weight format side by side in one run, against its bytes bound, plain
transformers float32, and float32's own text.

The model is prepared once per format (`prepare --weights FORMAT`, model/formats.py) into --shards-dir, and
then, in one process on one pinned core:

- **steps**: each side's compute for a block of q rows on c cached rows (the cloud's middle layers; the
  local head and tail layers, final norm and LM head), median ms, beside the side's bytes bound (its
  stored weights once plus the keys and values it reads, over this thread's measured bandwidth);
- **generations**: local-only sequential greedy decoding (the whole model in this process) in each format,
  plain transformers float32 greedy decoding with its own cache and, where `llama-cpp-python` is
  installed, llama.cpp on the same GGUF (one thread), decode ms per token, every configuration once per
  prompt per round in a shuffled order, medians of paired ratios;
- **quality**: perplexity of held-out text (the packaged held-out prompts, data/heldout.jsonl, read as plain
  text; int8's calibration reads data/prompts.jsonl, never these)
  and agreement with float32's greedy replies: identical replies, and where one differs, its first
  differing token and float32's top-1 minus top-2 logit there (a small margin is a near-tie, not an error);
- **exactness**: each format's tree (no draft head) output against its own sequential output.

JSON and a Markdown table with the command line go to OUT.
"""

from __future__ import annotations

import json
import os
from importlib import resources
import random
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from .. import kernels
from ..model.formats import WeightFormats
from ..tables import table
from .machine import bandwidth_gbps, cpu_flags, kernels_line
from .side import Side, real_inputs



@dataclass(frozen=True)
class FormatsBenchConfig:
    formats: tuple[str, ...] = ("float32", "bfloat16", "int8", "int4", "int4,lm_head=int8")  # --weights specs
    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # block rows q of the step timings
    contexts: tuple[int, ...] = (64, 512)  # cached rows before a timed block
    prompts: int = 5  # benchmark prompts generated from (bench/prompts.jsonl order)
    tokens: int = 64  # new tokens a generation
    repeats: int = 5  # timed rounds after one warm-up round
    cpu: int = 0  # core to pin to (-1: none)
    threads: int = 1  # torch threads
    shards_dir: str = "shards/formats"  # where each format's shards are prepared (`bench spec --shards` takes them)


def prepare_all(model: str | None, shards_dir: Path, specs: tuple[str, ...], log) -> dict[str, Path]:
    """{spec: SHARDS_DIR/<spec>}: the model read once and prepared in each format, the shipped draft head
    installed where one matches (as `prepare` does), so `bench spec --shards` can take these directories."""
    from ..model.commands import install_shipped_drafter
    from ..model.prepare import prepare
    from ..model.source import load_source

    source = load_source(model)
    dirs = {}
    for spec in specs:
        dirs[spec] = shards_dir / spec.replace(",", "+").replace("=", "-")
        prepare(source, dirs[spec], weights=WeightFormats.parse(spec))
        log(f"prepared {spec} in {dirs[spec]}; " + install_shipped_drafter(dirs[spec] / "local"))
    return dirs


def build_steps(dirs: dict[str, Path], config: FormatsBenchConfig) -> dict[tuple, Side]:
    """{(spec, side, context): bench/side.py's Side, without its anchor} on real activations (`real_inputs`)."""
    from ..model.shards import load_cloud, load_local

    steps = {}
    for spec, shards in dirs.items():
        local, cloud = load_local(shards / "local", verify=False), load_cloud(shards / "cloud", verify=False)
        embedded, activations = real_inputs(local, max(config.contexts) + max(config.rows))
        for context in config.contexts:
            steps[(spec, "cloud", context)] = Side("cloud", [cloud.stack], None, context, activations, False)
            steps[(spec, "local", context)] = Side("local", [local.head, local.tail], (local.norm, local.lm_head), context,
                                                   embedded, False)
    return steps


def time_steps(steps: dict[tuple, Side], rows: tuple[int, ...], repeats: int) -> dict[tuple, float]:
    """{(spec, side, context, q): median ms}, every configuration once a round, shuffled; round 0 dropped."""
    configs = [(key, q) for key in steps for q in rows]
    times: dict[tuple, list[float]] = {(*key, q): [] for key, q in configs}
    rng = random.Random(0)
    for round_ in range(repeats + 1):
        rng.shuffle(configs)
        for key, q in configs:
            ms = steps[key].timed(q)
            if round_:
                times[(*key, q)].append(ms)
    return {k: statistics.median(v) for k, v in times.items()}


def step_rows(steps, medians, gbps: float) -> list[dict]:
    rows = []
    for (spec, side, context, q), ms in sorted(medians.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0], kv[0][3])):
        streamed = steps[(spec, side, context)].streamed_bytes()
        bound = streamed / gbps / 1e6
        rows.append({"format": spec, "side": side, "context": context, "rows": q, "ms": round(ms, 3),
                     "bytes": streamed, "bound_ms": round(bound, 3),
                     "over_bound": round(ms / bound, 2)})
    return rows


def generations(dirs: dict[str, Path], prompts: dict[str, list[int]], config: FormatsBenchConfig, log,
                gguf: Path | None = None) -> dict:
    """Sequential local-only greedy decoding per format, transformers float32 and llama.cpp on the GGUF
    where it is installed: decode ms per token."""
    from ..model.shards import load_whole_hf
    from .anchors import decode_ms_per_token, greedy_llamacpp, greedy_transformers, llamacpp

    clients = {spec: _local_only(path) for spec, path in dirs.items()}
    whole = load_whole_hf(dirs["float32"])
    llm = llamacpp(gguf, log)
    names = list(clients) + ["transformers"] + (["llama.cpp"] if llm is not None else [])
    runs, texts = [], {}
    rng = random.Random(1)
    for round_ in range(config.repeats + 1):
        for pid, ids in prompts.items():
            rng.shuffle(names)
            timed = {}
            for name in names:
                if name == "transformers":
                    out, timed[name] = greedy_transformers(whole, ids, config.tokens)
                elif name == "llama.cpp":
                    out, timed[name] = greedy_llamacpp(llm, ids, config.tokens)
                else:
                    g = clients[name].generate(ids, config.tokens, strategy="sequential", stop_ids=set())
                    out, timed[name] = g.token_ids, decode_ms_per_token(g)
                texts[(name, pid)] = out
            if round_:
                runs.append({"prompt_id": pid, "round": round_, **{k: round(v, 3) for k, v in timed.items()}})
        log(f"generations: round {round_} of {config.repeats} done")
    summary = {}
    for name in clients:
        ms = statistics.median(r[name] for r in runs)
        paired = statistics.median(r["transformers"] / r[name] for r in runs)
        summary[name] = {"ms_per_token": round(ms, 2), "tok_s": round(1e3 / ms, 1),
                         "speedup_vs_transformers_f32": round(paired, 2)}
    for anchor in ("transformers", "llama.cpp"):
        if anchor in runs[0]:
            t = statistics.median(r[anchor] for r in runs)
            summary[anchor] = {"ms_per_token": round(t, 2), "tok_s": round(1e3 / t, 1)}
    if "llama.cpp" in runs[0]:
        for name in clients:
            summary[name]["x_llamacpp"] = round(statistics.median(r["llama.cpp"] / r[name] for r in runs), 2)
    return {"runs": runs, "summary": summary, "replies": {f"{n}|{p}": ids for (n, p), ids in texts.items()}}


def quality(dirs: dict[str, Path], prompts: dict[str, list[int]], replies: dict, tokenizer_text: list[str]) -> dict:
    """Perplexity of the held-out text and agreement with float32's greedy replies, per format."""
    from ..model.shards import load_cloud, load_local

    result = {}
    reference = _Whole(load_local(dirs["float32"] / "local"), load_cloud(dirs["float32"] / "cloud"))
    held_ids = [reference.local.tokenizer(t)["input_ids"] for t in tokenizer_text]
    for spec, path in dirs.items():
        model = _Whole(load_local(path / "local"), load_cloud(path / "cloud"))
        nll = [model.nll(ids) for ids in held_ids]
        tokens = sum(len(ids) - 1 for ids in held_ids)
        agree = []
        for pid, prompt in prompts.items():
            ref, got = replies[f"float32|{pid}"], replies[f"{spec}|{pid}"]
            first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
            entry = {"prompt_id": pid, "identical": ref == got, "first_divergence": first}
            if first is not None:
                top = reference.logits(prompt + ref[:first + 1])[len(prompt) - 1 + first].topk(2).values
                entry["float32_top2_margin"] = round(float(top[0] - top[1]), 4)
            agree.append(entry)
        result[spec] = {"perplexity": round(float(np.exp(sum(nll) / tokens)), 4), "heldout_tokens": tokens,
                        "identical_replies": f"{sum(a['identical'] for a in agree)} of {len(agree)}",
                        "replies": agree}
    base = result["float32"]["perplexity"]
    for spec in result:
        result[spec]["perplexity_vs_float32"] = round(result[spec]["perplexity"] / base - 1, 4)
    return result


class _Whole:
    """A prepared model's halves chained in one process: logits of every row of a sequence."""

    def __init__(self, local, cloud):
        self.local, self.cloud = local, cloud

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        n = len(ids)
        allowed, positions = np.tril(np.ones((n, n), bool)), torch.arange(n)
        hidden = self.local.embed(torch.tensor([ids]))
        for stack in (self.local.head, self.cloud.stack, self.local.tail):
            hidden = stack(hidden, positions, allowed, stack.new_cache())
        return self.local.logits(hidden)

    def nll(self, ids: list[int]) -> float:
        logp = torch.log_softmax(self.logits(ids)[:-1].double(), dim=-1)
        return float(-logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())


def _local_only(shards: Path):
    """The whole model of `shards` in this process, without a draft head (formats are compared on their own)."""
    from ..clients import open_client
    from ..local.config import ClientConfig

    return open_client(local_only=True, shards=shards, config=ClientConfig(drafter="off"), checks=False)


def exactness(dirs: dict[str, Path], prompts: dict[str, list[int]], replies: dict, tokens: int) -> dict:
    """Each format's tree (no draft head) reply against its own sequential reply, per prompt."""

    out = {}
    for spec, path in dirs.items():
        client = _local_only(path)
        same = [client.generate(ids, tokens, strategy="tree-nohead", stop_ids=set()).token_ids == replies[f"{spec}|{pid}"]
                for pid, ids in prompts.items()]
        out[spec] = f"{sum(same)} of {len(same)}"
    return out


def run(model: str | None, shards_dir: Path, config: FormatsBenchConfig, log=print) -> dict:
    from .runtime import load_prompts

    if config.cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {config.cpu})
    torch.set_num_threads(config.threads)
    dirs = prepare_all(model, shards_dir, config.formats, log)
    gbps = bandwidth_gbps()
    log(f"memory bandwidth, one thread: {gbps:.1f} GB/s")
    steps = build_steps(dirs, config)
    medians = time_steps(steps, config.rows, config.repeats)
    step_table = step_rows(steps, medians, gbps)
    del steps
    encoder = _local_only(dirs["float32"])
    prompts = {p["id"]: encoder.encode_prompt(p["prompt"], p.get("chat", True))
               for p in load_prompts(None, 1)[: config.prompts]}
    from ..model.source import default_model_path

    gguf = Path(model) if model else default_model_path()
    gen = generations(dirs, prompts, config, log, gguf)
    data = resources.files("splitinfer.data")
    heldout = [json.loads(line)["prompt"] for line in data.joinpath("heldout.jsonl").read_text().splitlines()
               if line.strip()]
    return {
        "command": "splitinfer " + shlex.join(sys.argv[1:]), "version": __version__, "config": asdict(config),
        "machine": {"cpu_flags": cpu_flags(), "kernels": kernels.report(), "bandwidth_gbps": round(gbps, 2),
                    "threads": config.threads, "pinned_cpu": config.cpu},
        "steps": step_table, "generations": gen["summary"], "generation_runs": gen["runs"],
        "quality": quality(dirs, prompts, gen["replies"], heldout),
        "tree_equals_sequential": exactness(dirs, prompts, gen["replies"], config.tokens),
    }


def markdown(report: dict) -> str:
    gen, quality_, exact = report["generations"], report["quality"], report["tree_equals_sequential"]
    lines = [f"Command: `{report['command']}`", "",
             f"One thread pinned to one core; bandwidth {report['machine']['bandwidth_gbps']} GB/s; "
             f"kernels: {kernels_line(report['machine'])}; "
             f"{report['config']['prompts']} prompts x {report['config']['tokens']} tokens, "
             f"{report['config']['repeats']} rounds (medians).", ""]
    rows = [[spec, gen[spec]["tok_s"], gen[spec]["ms_per_token"], gen[spec]["speedup_vs_transformers_f32"],
             gen[spec].get("x_llamacpp", ""), quality_[spec]["perplexity"],
             f"{quality_[spec]['perplexity_vs_float32']:+.2%}", quality_[spec]["identical_replies"], exact[spec]]
            for spec in exact]
    for anchor, title in (("transformers", "transformers float32"), ("llama.cpp", "llama.cpp, the GGUF as shipped")):
        if anchor in gen:
            rows.append([title, gen[anchor]["tok_s"], gen[anchor]["ms_per_token"], "", "", "", "", "", ""])
    lines += table(["weights", "local-only tok/s", "ms/token", "x transformers f32", "x llama.cpp", "perplexity",
                    "vs float32", "replies = float32's", "tree = sequential"], rows)
    lines += ["", "Steps (ms, median) against the bytes bound (stored weights + KV read / bandwidth):", ""]
    step = [[r["side"], r["context"], r["format"], r["rows"], r["ms"], r["bound_ms"], r["over_bound"]]
            for r in report["steps"]]
    lines += table(["side", "cached", "weights", "rows", "ms", "bound ms", "x bound"], step)
    return "\n".join(lines) + "\n"


def run_formats_bench(model: str | None, out: Path, shards_dir: Path, config: FormatsBenchConfig, log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    report = run(model, shards_dir, config, log)
    (out / "formats.json").write_text(json.dumps(report, indent=1))
    (out / "formats.md").write_text(markdown(report))
    return report
