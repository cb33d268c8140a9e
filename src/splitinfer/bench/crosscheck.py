"""Split greedy decoding against plain transformers' greedy decoding of the same model, prompt by prompt.

    python -m splitinfer.bench.crosscheck --model MODEL.gguf --shards SHARDS --out result.json

The reference is the whole model as `prepare` read it (transformers' own `generate`, float32, CPU); the
split side is the prepared shards with the cloud middle behind a WebSocket in this process, decoding
sequentially on each wire dtype. Both generate a fixed number of tokens (no stop token), so every prompt
compares the same length. Where a split run departs from the reference, the result records the step and
the reference's top-1 minus top-2 logit there: a small margin says the two paths differ by rounding only.
A wire dtype the server refuses (Gemma's activations overflow float16) is recorded as an error.
This module measures; it decides nothing (the Gemma 3 test asserts on what it returns).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import __version__
from ..cloud.server import ServerThread
from ..errors import ProtocolError
from ..clients import open_client
from ..local.session import ClientConfig
from ..model.shards import load_cloud
from ..model.source import SourceModel, load_source
from ..options import Opt, add_options
from .runtime import load_prompts


def reference_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()


def margin_at(model: torch.nn.Module, prompt_ids: list[int], tokens: list[int], step: int) -> float:
    """Top-1 minus top-2 logit of the reference model before tokens[step]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens[:step]])).logits[0, -1]
    top = logits.float().topk(2).values
    return round(float(top[0] - top[1]), 5)


def compare(model: torch.nn.Module, prompt_ids: list[int], expected: list[int], got: list[int]) -> dict:
    """Where `got` departs from `expected`, and the reference's margin at that step."""
    step = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    if step is None and len(got) == len(expected):
        return {"equal": True}
    step = min(len(got), len(expected)) if step is None else step
    return {"equal": False, "first_divergence": step, "margin": margin_at(model, prompt_ids, expected, step)}


def crosscheck(
    source: SourceModel, shards: Path, prompts: list[dict], max_new_tokens: int, wire_dtypes: tuple[str, ...]
) -> dict:
    """`source`: the whole model that `prepare` wrote `shards` from."""
    model = source.model
    results = []
    with ServerThread(load_cloud(shards / "cloud")) as server:
        clients = {
            dtype: open_client(shards / "local", server.url, ClientConfig(wire_dtype=dtype), allow_public_weights=True,
                                checks=False)
            for dtype in wire_dtypes
        }
        encoder = next(iter(clients.values()))
        for prompt in prompts:
            ids = encoder.encode_prompt(prompt["prompt"], prompt.get("chat", True))
            started = time.perf_counter()
            expected = reference_greedy(model, ids, max_new_tokens)
            row = {"id": prompt["id"], "prompt_tokens": len(ids), "reference_s": round(time.perf_counter() - started, 2)}
            for dtype, client in clients.items():
                try:
                    got = client.generate(ids, max_new_tokens=max_new_tokens, stop_ids=set(), strategy="sequential")
                except ProtocolError as exc:  # e.g. activations beyond float16's range, refused by the server
                    row[dtype] = {"equal": False, "error": str(exc)}
                    continue
                row[dtype] = compare(model, ids, expected, got.token_ids)
            row["text"] = source.tokenizer.decode(expected) if source.tokenizer is not None else None
            print(json.dumps({k: v for k, v in row.items() if k != "text"}), file=sys.stderr)
            results.append(row)
    summary = {
        dtype: {
            "equal": sum(r[dtype]["equal"] for r in results),
            "prompts": len(results),
            "errors": sum("error" in r[dtype] for r in results),
            "max_divergence_margin": max((r[dtype]["margin"] for r in results if "margin" in r[dtype]), default=None),
        }
        for dtype in wire_dtypes
    }
    return {
        "model": source.model_id,
        "model_type": source.config.model_type,
        "split": json.loads((shards / "local" / "manifest.json").read_text())["split"],
        "max_new_tokens": max_new_tokens,
        "summary": summary,
        "prompts": results,
    }


@dataclass(frozen=True)
class CrosscheckOptions:
    """The defaults of `python -m splitinfer.bench.crosscheck`."""

    max_new_tokens: int = 64  # greedy tokens per prompt
    wire_dtypes: str = "float32,bfloat16,float16"  # comma-separated wire dtypes to compare
    per_category: int = 1000  # prompts per category (more than any category holds: all of them)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the model file or directory that `prepare` read")
    parser.add_argument("--shards", required=True, help="the directory `prepare --out` wrote")
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    add_options(parser, CrosscheckOptions, (
        Opt("max_new_tokens"), Opt("wire_dtypes"), Opt("per_category", help="prompts per category (default: all)"),
    ))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    prompts = load_prompts(None, args.per_category)
    result = crosscheck(
        load_source(args.model), Path(args.shards), prompts, args.max_new_tokens, tuple(args.wire_dtypes.split(","))
    )
    result["command"] = "python -m splitinfer.bench.crosscheck " + shlex.join(argv if argv is not None else sys.argv[1:])
    result["environment"] = {
        "splitinfer": __version__,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
