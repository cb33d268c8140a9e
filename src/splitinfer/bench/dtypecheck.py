"""`splitinfer bench dtype`: what a lower compute dtype (bfloat16) costs in quality and in exactness, untimed.

Two measurements through the project's split path (SplitClient, SplitSession and the cloud's session table;
the middle in this process, so no wire rounding), each side's dtype chosen on its own:

- **perplexity** of held-out text, teacher-forced: the first user turn and assistant reply of held-out
  ShareGPT conversations (2% by id, never trained on by the drafter; `make chat-data`), the reply's tokens
  scored, for every pair (local dtype, cloud dtype) of float32 and the dtype under test; beside it the share
  of scored positions whose top-1 token equals float32's.
- **exactness of speculation in that dtype**: on the benchmark prompts, each speculative strategy against
  sequential decoding in the same dtype (both sides). A tree verifies a block of rows in one pass, and a
  lower-precision kernel may round a row differently with the row count, so greedy outputs can part. For
  every generation that differs: the first different token, and the top-2 logit margin there, in the dtype
  under test and in float32 (prefill of the sequential context). float32 runs as the control.

Timing is not measured here (the machine may be shared); bf16 against fp32 tok/s is `bench spec` on shards
prepared in each dtype.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError
from ..options import Opt, add_options, described
from ..tables import table
from ..wire.dtypes import DTYPE_NAMES
from .parsers import add_shards_and_out, reporting


@dataclass(frozen=True)
class DtypeCheckOptions:
    """The defaults of `splitinfer bench dtype`."""

    dtype: str = "bfloat16"  # the compute dtype compared with float32
    conversations: int = 24  # held-out ShareGPT conversations scored for perplexity (`make chat-data`)
    max_tokens: int = 512  # tokens per scored conversation, prompt and reply (longer replies are cut)
    strategies: str = "tree-nohead,tree"  # comma-separated speculative strategies checked against sequential
    exact_dtypes: str = "float32,bfloat16"  # comma-separated dtypes the exactness check runs in (float32: the control)
    max_new_tokens: int = 128  # tokens per generation in the exactness check
    per_category: int = 3  # benchmark prompts from each category


class Clients:
    """In-process split clients by (local dtype, cloud dtype), each half loaded once per dtype."""

    def __init__(self, shards: Path):
        self.shards, self.halves, self.clients = shards, {}, {}

    def half(self, role: str, dtype: str):
        from ..model.shards import load_cloud, load_local

        if (role, dtype) not in self.halves:
            load = load_local if role == "local" else load_cloud
            self.halves[(role, dtype)] = load(self.shards / role, dtype=dtype)
        return self.halves[(role, dtype)]

    def get(self, local_dtype: str, cloud_dtype: str):
        from ..clients import open_client

        key = (local_dtype, cloud_dtype)
        if key not in self.clients:
            halves = (self.half("local", local_dtype), self.half("cloud", cloud_dtype))
            self.clients[key] = open_client(local_only=True, shards=self.shards, halves=halves)
        return self.clients[key]


def heldout_texts(count: int) -> tuple[list[dict], dict]:
    """The first `count` held-out ShareGPT conversations with an English first reply: [{"id", "user",
    "reply"}], and where they came from."""
    from ..drafter.chat import SHAREGPT_SOURCE, is_english, is_heldout, messages, read_sharegpt

    chosen, read = [], 0
    conversations, info = read_sharegpt(limit=max(count * 200, 1000))
    for conversation in conversations:
        read += 1
        turns = messages(conversation)
        if len(turns) >= 2 and is_heldout(str(conversation.get("id", ""))) and is_english(turns[1]["content"]):
            chosen.append({"id": conversation["id"], "user": turns[0]["content"], "reply": turns[1]["content"]})
            if len(chosen) == count:
                break
    return chosen, {**SHAREGPT_SOURCE, "conversations_read": read,
                    "heldout_rule": "drafter/chat.py is_heldout (2% by id)"}


def scored_ids(client, text: dict, max_tokens: int) -> tuple[list[int], int] | None:
    """(prompt + reply ids cut at max_tokens, where the reply starts), or None when the prompt takes more
    than half of max_tokens (too little reply left to score)."""
    prompt = client.encode_prompt(text["user"][:4000])
    if len(prompt) > max_tokens // 2:
        return None
    reply = list(client.local.tokenizer(text["reply"], add_special_tokens=False)["input_ids"])
    return (prompt + reply)[:max_tokens], len(prompt)


def teacher_forced(client, ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(negative log-likelihood of ids[start:], top-1 prediction before each of them) through the split."""
    import torch

    from ..local.session import ClientConfig, SplitSession

    session = SplitSession(client.local, client.make_middle(), ClientConfig(wire_dtype="float32"))
    try:
        logits = session.prefill(ids, logits_rows=len(ids))  # [len, vocab]
    finally:
        session.close()
    rows = logits[start - 1 : -1].float()
    targets = torch.tensor(ids[start:])
    nll = -torch.log_softmax(rows, dim=-1).gather(1, targets[:, None])[:, 0]
    return nll, rows.argmax(-1)


def perplexity(clients: Clients, dtype: str, texts: list[dict], max_tokens: int, log) -> list[dict]:
    """Per (local dtype, cloud dtype): tokens scored, mean NLL, perplexity, top-1 agreement with float32."""
    import torch

    reference = clients.get("float32", "float32")
    items = [x for x in (scored_ids(reference, t, max_tokens) for t in texts) if x is not None]
    combos = [("float32", "float32"), (dtype, "float32"), ("float32", dtype), (dtype, dtype)]
    top1_f32, rows = [], []
    for local_dtype, cloud_dtype in combos:
        client = clients.get(local_dtype, cloud_dtype)
        nlls, agree = [], 0
        for i, (ids, start) in enumerate(items):
            nll, top1 = teacher_forced(client, ids, start)
            nlls.append(nll)
            if (local_dtype, cloud_dtype) == combos[0]:
                top1_f32.append(top1)
            agree += int((top1 == top1_f32[i]).sum())
        nll = torch.cat(nlls)
        rows.append({"local": local_dtype, "cloud": cloud_dtype, "texts": len(items), "tokens": nll.numel(),
                     "mean_nll": round(float(nll.mean()), 5), "perplexity": round(math.exp(float(nll.mean())), 4),
                     "top1_agrees_with_float32": round(agree / nll.numel(), 5)})
        log(f"perplexity local {local_dtype:<8} cloud {cloud_dtype:<8} {rows[-1]['perplexity']:9.4f} "
            f"({rows[-1]['tokens']} tokens, top-1 = float32's {rows[-1]['top1_agrees_with_float32']:.4f})")
    return rows


def margin(client, ids: list[int]) -> float:
    """Top-1 minus top-2 logit after `ids` (prefill of the whole context), in the client's dtype."""
    from .speculative import margin_before

    return margin_before(client, ids, [], 0)


def exactness(clients: Clients, dtypes: list[str], strategies: list[str], prompts: list[dict], n: int, log) -> dict:
    """Per dtype: every strategy's generations against sequential's in that dtype, and each divergence."""
    out = {}
    for dtype in dtypes:
        client, f32 = clients.get(dtype, dtype), clients.get("float32", "float32")
        runs, divergences = [], []
        for p in prompts:
            ids = client.encode_prompt(p["prompt"], p.get("chat", True))
            sequential = client.generate(ids, n, strategy="sequential").token_ids
            for strategy in strategies:
                tokens = client.generate(ids, n, strategy=strategy).token_ids
                same = tokens == sequential
                runs.append({"prompt_id": p["id"], "strategy": strategy, "identical": same, "tokens": len(tokens)})
                if not same:
                    at = next((i for i, (a, b) in enumerate(zip(tokens, sequential)) if a != b),
                              min(len(tokens), len(sequential)))
                    context = ids + sequential[:at]
                    divergences.append({"prompt_id": p["id"], "strategy": strategy, "first_different_token": at,
                                        "sequential_token": sequential[at] if at < len(sequential) else None,
                                        "speculative_token": tokens[at] if at < len(tokens) else None,
                                        "margin": margin(client, context), "float32_margin": margin(f32, context)})
                log(f"exactness {dtype:<8} {strategy:<12} {p['id']:<16} {'same' if same else 'DIFFERS'}")
        out[dtype] = {"generations": len(runs), "identical": sum(r["identical"] for r in runs), "runs": runs,
                      "divergences": divergences}
    return out


def markdown(report: dict) -> str:
    o = report["options"]
    lines = [f"# {o['dtype']} against float32 on the CPU: perplexity and exactness (untimed)", "",
             f"`{report['command']}`", "", f"torch {report['torch']}; CPU flags: {' '.join(report['cpu_flags'])}.", "",
             f"## Perplexity of held-out text ({report['perplexity'][0]['texts']} held-out ShareGPT conversations, "
             f"first user turn + reply, reply tokens scored, at most {o['max_tokens']} tokens each)", ""]
    body = [[r["local"], r["cloud"], r["tokens"], r["mean_nll"], r["perplexity"], r["top1_agrees_with_float32"]]
            for r in report["perplexity"]]
    lines += table(["local side", "cloud side", "tokens", "mean NLL", "perplexity", "top-1 = float32's"], body,
                   "|---|---|---:|---:|---:|---:|")
    lines += ["", f"## Speculative decoding against sequential decoding in the same dtype ({len(report['prompts'])} "
              f"benchmark prompts, {o['max_new_tokens']} new tokens, greedy, both sides in the dtype)", ""]
    body = [[d, x["generations"], x["identical"], x["generations"] - x["identical"]]
            for d, x in report["exactness"].items()]
    lines += table(["dtype", "generations", "identical to sequential", "diverged"], body, "|---|---:|---:|---:|")
    found = [(d, v) for d, x in report["exactness"].items() for v in x["divergences"]]
    if found:
        lines += ["", "Each divergence: the first different token, and the top-2 logit margin of the sequential "
                  "context there in the dtype and in float32.", ""]
        body = [[d, v["strategy"], v["prompt_id"], v["first_different_token"], v["margin"], v["float32_margin"]]
                for d, v in found]
        lines += table(["dtype", "strategy", "prompt", "first different token", "margin", "float32 margin"], body,
                       "|---|---|---|---:|---:|---:|")
    return "\n".join(lines) + "\n"


def run(args, log=print) -> dict:
    import torch

    from .. import __version__
    from .runtime import load_prompts
    from .machine import cpu_flags

    torch.set_num_threads(1)  # as the benchmarks run each side; results do not depend on it

    shards = Path(args.shards)
    if not (shards / "local" / "manifest.json").exists():
        raise ConfigError(f"{shards} holds no prepared shards; run `splitinfer prepare --out {shards}` first.")
    clients = Clients(shards)
    texts, source = heldout_texts(args.conversations)
    options = {f: getattr(args, f) for f in DtypeCheckOptions.__dataclass_fields__}
    prompts = load_prompts(args.prompts, args.per_category)
    report = {
        "command": "splitinfer bench dtype " + shlex.join(sys.argv[3:]), "splitinfer": __version__,
        "torch": torch.__version__, "cpu_flags": cpu_flags(), "options": options, "text_source": source,
        "texts": [t["id"] for t in texts], "prompts": [p["id"] for p in prompts],
        "perplexity": perplexity(clients, args.dtype, texts, args.max_tokens, log),
        "exactness": exactness(clients, _names(args.exact_dtypes), _names(args.strategies), prompts,
                               args.max_new_tokens, log),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dtype.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "dtype.md").write_text(markdown(report))
    log(markdown(report))
    return report


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def register(sub) -> None:
    s = sub.add_parser("dtype", help="a compute dtype (bfloat16) against float32: perplexity of held-out text and "
                       "exactness of speculation in that dtype, untimed")
    add_shards_and_out(s, "dtype.json and dtype.md")
    add_options(s, DtypeCheckOptions, (
        Opt("dtype", choices=DTYPE_NAMES, help="the compute dtype compared with float32"),
        *described(DtypeCheckOptions, "conversations", "max_tokens", "strategies", "exact_dtypes", "max_new_tokens",
                   "per_category"),
    ))
    s.add_argument("--prompts", help="JSONL prompt file, or mt-bench (default: the packaged benchmark prompts)")
    s.set_defaults(func=reporting(run))
