"""`splitinfer bench exactness`: what the wire and the weight format change, against float32 local-only
(the whole model in float32 in one process), untimed.

Two promises are kept apart. Speculation is exact: a tree's reply equals sequential decoding's of the same
split, token for token, in every configuration (checked here on every prompt). The split itself is not
float32 local-only: the wire rounds the hidden states twice a step (float16 by default) and a weight format
other than float32 changes the weights. For every (format, wire) pair this measures by how much:

- **perplexity** of held-out text (the packaged data/heldout.jsonl, which int8's calibration never reads),
  teacher-forced through the split's own session, and the share of its positions whose top-1 token equals
  the reference's;
- **greedy replies** on the benchmark prompts: identical to the reference's or not; where not, the first
  differing token and the reference's top-1 minus top-2 logit there (a near-tie, not an error); and along
  the reference's replies, teacher-forced, the share of their tokens this configuration also ranks first;
- **tree = sequential** in that configuration.

Every pair runs in this process through the client's session and the cloud's session table (inprocess.py);
a wire other than none passes each step and result through the wire's own encoding, the bytes a server
receives and sends. Each format is prepared once into --shards-dir (`prepare --weights FORMAT`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from ..errors import ConfigError
from ..options import add_options, described
from ..tables import table
from ..wire.dtypes import DTYPE_NAMES
from . import harness
from .parsers import reporting


@dataclass(frozen=True)
class ExactnessOptions:
    """The defaults of `splitinfer bench exactness`."""

    formats: str = "float32;bfloat16;int8;int4;int4,lm_head=int8"  # semicolon-separated `prepare --weights` specs
    wires: str = "float32,float16"  # comma-separated wire dtypes (the shard's own is the default a client uses)
    per_category: int = 3  # benchmark prompts from each category (bench/prompts.jsonl)
    tokens: int = 64  # new tokens a greedy reply
    strategy: str = "tree"  # the speculative strategy checked against sequential in every configuration
    shards_dir: str = "shards/formats"  # where each format's shards are prepared


def split_client(shards: Path, halves, wire: str):
    """A client on `halves` whose hidden states cross `wire`'s encoding both ways, with the shard's draft head."""
    from ..clients import open_client

    return open_client(local_only=True, shards=shards, halves=halves, checks=False, wire=wire)


def teacher_forced(client, ids: list[int]):
    """(negative log-likelihood of ids[1:], the top-1 token before each) through the client's own session."""
    import torch

    from ..local.session import SplitSession

    session = SplitSession(client.local, client.make_middle(), client.config)
    try:
        rows = session.prefill(ids, logits_rows=len(ids))[:-1].double()
    finally:
        session.close()
    nll = -torch.log_softmax(rows, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return nll, rows.argmax(-1)


class Reference:
    """float32 local-only: held-out NLL and top-1 per text, greedy reply per prompt."""

    def __init__(self, client, texts: list[list[int]], prompts: dict[str, list[int]], tokens: int):
        self.client = client
        self.scored = [teacher_forced(client, ids) for ids in texts]
        self.replies = {pid: client.generate(ids, tokens, strategy="sequential", stop_ids=set()).token_ids
                        for pid, ids in prompts.items()}


def measure(client, reference: Reference, texts, prompts, options: ExactnessOptions) -> dict:
    """One configuration against the reference."""
    import torch

    from .speculative import margin_before

    nll, agree = [], 0
    for ids, (_, ref_top) in zip(texts, reference.scored):
        got, top = teacher_forced(client, ids)
        nll.append(got)
        agree += int((top == ref_top).sum())
    nll = torch.cat(nll)
    ref_nll = torch.cat([n for n, _ in reference.scored])
    replies, tree_same, along = [], 0, 0
    for pid, ids in prompts.items():
        ref = reference.replies[pid]
        along += int((teacher_forced(client, ids + ref)[1][len(ids) - 1:] == torch.tensor(ref)).sum())
        got = client.generate(ids, options.tokens, strategy="sequential", stop_ids=set()).token_ids
        tree = client.generate(ids, options.tokens, strategy=options.strategy, stop_ids=set()).token_ids
        tree_same += tree == got
        first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        entry = {"prompt_id": pid, "identical": got == ref, "first_divergence": first, "tree_equals_sequential": tree == got}
        if first is not None:
            entry["reference_margin"] = margin_before(reference.client, ids, ref, first)
        replies.append(entry)
    perplexity = math.exp(float(nll.mean()))
    return {
        "heldout_tokens": nll.numel(), "perplexity": round(perplexity, 4),
        "perplexity_vs_reference": round(perplexity / math.exp(float(ref_nll.mean())) - 1, 5),
        "top1_agreement": round(agree / nll.numel(), 5),
        "identical_replies": sum(r["identical"] for r in replies), "replies": replies,
        "reply_tokens": sum(len(r) for r in reference.replies.values()),
        "top1_along_replies": round(along / sum(len(r) for r in reference.replies.values()), 5),
        "tree_equals_sequential": tree_same, "prompts": len(prompts),
    }


def run(args, log=print) -> dict:
    import torch

    from ..clients import open_client
    from ..inprocess import load_halves
    from .formats import prepare_all
    from .runtime import load_prompts

    options = ExactnessOptions(**{f: getattr(args, f) for f in ExactnessOptions.__dataclass_fields__})
    formats = [f for f in options.formats.split(";") if f]
    wires = [w.strip() for w in options.wires.split(",") if w.strip()]
    if "float32" not in formats:
        raise ConfigError("bench exactness measures against float32 local-only: include float32 in --formats.")
    unknown = [w for w in wires if w not in DTYPE_NAMES]
    if unknown:
        raise ConfigError(f"unknown wire dtype {', '.join(unknown)}; choose among {', '.join(DTYPE_NAMES)}.")
    torch.set_num_threads(1)  # results do not depend on it; the machine may be shared
    dirs = prepare_all(args.model, Path(options.shards_dir), tuple(formats), log)
    reference_client = open_client(local_only=True, shards=dirs["float32"], checks=False)
    heldout = resources.files("splitinfer.data").joinpath("heldout.jsonl").read_text().splitlines()
    texts = [reference_client.local.tokenizer(json.loads(line)["prompt"])["input_ids"] for line in heldout if line.strip()]
    prompts = {p["id"]: reference_client.encode_prompt(p["prompt"], p.get("chat", True))
               for p in load_prompts(None, options.per_category)}
    reference = Reference(reference_client, texts, prompts, options.tokens)
    rows = []
    for spec in formats:
        halves = load_halves(dirs[spec])
        for wire in wires:
            row = {"weights": spec, "wire": wire,
                   **measure(split_client(dirs[spec], halves, wire), reference, texts, prompts, options)}
            log(f"{spec:<24} wire {wire:<9} perplexity {row['perplexity_vs_reference']:+.3%}, top-1 "
                f"{row['top1_agreement']:.2%}, replies {row['identical_replies']}/{row['prompts']}, tree = sequential "
                f"{row['tree_equals_sequential']}/{row['prompts']}")
            rows.append(row)
    record = {"options": asdict(options), "model": args.model or "the embedded SmolLM2-135M-Instruct",
              "reference": {"weights": "float32", "wire": "none (one process)",
                            "perplexity": round(math.exp(float(_mean_nll(reference))), 4)},
              "prompts": list(prompts), "rows": rows}
    harness.write(Path(args.out), "exactness", record, markdown(record),
                  title="What the wire and the weight format change, against float32 local-only",
                  command=harness.command_line(args), log=log)
    return record


def _mean_nll(reference: Reference) -> float:
    import torch

    return torch.cat([n for n, _ in reference.scored]).mean()


def markdown(record: dict) -> list[str]:
    rows = record["rows"]
    n = rows[0]["prompts"] if rows else 0
    lines = [f"Reference: float32 weights, the whole model in one process (perplexity {record['reference']['perplexity']} "
             f"on {rows[0]['heldout_tokens'] if rows else 0} held-out tokens); {n} benchmark prompts x "
             f"{record['options']['tokens']} greedy tokens; tree = `{record['options']['strategy']}`.", ""]
    body = [[r["weights"], r["wire"], f"{r['perplexity_vs_reference']:+.2%}", f"{r['top1_agreement']:.2%}",
             f"{r['top1_along_replies']:.2%}", f"{r['identical_replies']} of {n}", _margins(r),
             f"{r['tree_equals_sequential']} of {n}"] for r in rows]
    lines += table(["weights", "wire", "perplexity vs reference", "top-1 = reference's (held-out)",
                    "top-1 = reference's (its replies)", "replies = reference's", "reference's margin where a reply parts (min, median)",
                    "tree = sequential"], body)
    return lines


def _margins(row: dict) -> str:
    found = sorted(r["reference_margin"] for r in row["replies"] if "reference_margin" in r)
    return f"{found[0]}, {found[len(found) // 2]}" if found else "-"


def register(sub) -> None:
    s = sub.add_parser("exactness", help="what the wire dtype and each weight format change against float32 "
                       "local-only (perplexity, top-1 and reply agreement), and tree = sequential in each, untimed")
    s.add_argument("--model", help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--out", required=True, help="directory for exactness.json and exactness.md")
    add_options(s, ExactnessOptions, described(ExactnessOptions, *ExactnessOptions.__dataclass_fields__))
    s.set_defaults(func=reporting(run))
