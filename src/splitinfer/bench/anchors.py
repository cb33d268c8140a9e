"""Whole greedy generations timed against plain transformers: the anchor every local-only speed claim quotes.

`greedy_transformers` decodes with transformers' own model and cache, `greedy_llamacpp` with llama.cpp on
the same GGUF (the optional `llama-cpp-python`); `generations` runs it beside a
splitinfer client prompt by prompt (bench step --e2e-prompts); `decode_ms_per_token` reads a splitinfer
generation's decode time the way transformers' is timed (after the first token, which the prefill makes).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from torch import nn

from ..model.shards import load_whole_hf


def greedy_transformers(model: nn.Module, prompt_ids: list[int], tokens: int) -> tuple[list[int], float]:
    """Plain transformers greedy decoding with its own cache: (generated ids, ms per token after the first)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids]), cache=cache, use_cache=True, logits_to_keep=1).logits
        out = [int(logits[0, -1].argmax())]
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            logits = model(torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
        ms = (time.perf_counter() - t0) * 1e3 / max(tokens - 1, 1)
    return out, ms


def e2e(shards: Path, config, log) -> dict:
    """Local-only sequential generation against transformers greedy on the first benchmark prompts."""
    from ..clients import open_client
    from ..local.config import ClientConfig
    from .runtime import load_prompts

    client = open_client(local_only=True, shards=shards, config=ClientConfig(drafter="off"))
    prompts = load_prompts(None, 1)[: config.e2e_prompts]
    ids = {p["id"]: client.encode_prompt(p["prompt"], p.get("chat", True)) for p in prompts}
    return generations(client, load_whole_hf(shards), ids, config.e2e_tokens, config.repeats // 2 + 2, log)


def generations(client, whole: nn.Module, prompts: dict[str, list[int]], tokens: int, repeats: int, log) -> dict:
    """Both paths on every prompt, interleaved, after one warm-up round; medians of ms per token."""
    runs = []
    for rep in range(repeats + 1):
        for name, ids in prompts.items():
            ref, ref_ms = greedy_transformers(whole, ids, tokens)
            g = client.generate(ids, tokens, strategy="sequential", stop_ids=set())
            ours_ms = decode_ms_per_token(g)
            if rep:
                runs.append({"prompt_id": name, "repeat": rep, "transformers_ms": round(ref_ms, 3),
                             "splitinfer_ms": round(ours_ms, 3), "identical": g.token_ids == ref})
                log(f"e2e {name:<14} transformers {ref_ms:6.1f} ms/token  splitinfer {ours_ms:6.1f}")
    t = statistics.median(r["transformers_ms"] for r in runs)
    s = statistics.median(r["splitinfer_ms"] for r in runs)
    # The ratio is the median of paired ratios: each pair ran back to back on one prompt, so a machine whose
    # speed drifts between pairs moves both sides of a pair alike.
    paired = statistics.median(r["splitinfer_ms"] / r["transformers_ms"] for r in runs)
    return {"tokens": tokens, "prompts": list(prompts), "runs": runs, "transformers_ms_per_token": round(t, 2),
            "splitinfer_ms_per_token": round(s, 2), "ratio": round(paired, 3),
            "identical": f"{sum(r['identical'] for r in runs)} of {len(runs)}"}


def decode_ms_per_token(g) -> float:
    """Decode wall time per token after the first (which comes out of the prefill), as transformers' is timed."""
    return g.stats["decode_s"] * 1e3 / max(len(g.token_ids) - 1, 1)


# -- the report ----------------------------------------------------------------------------------------


def llamacpp(gguf: Path | None, log):
    """llama.cpp on the same GGUF, one thread (the optional `llama-cpp-python`), or None with the reason logged."""
    if gguf is None or gguf.suffix != ".gguf":
        log("llama.cpp: skipped (the model is not a GGUF file)")
        return None
    try:
        from llama_cpp import Llama
    except ImportError:
        log("llama.cpp: skipped (llama-cpp-python is not installed; see docs/benchmarks.md for its build)")
        return None
    return Llama(model_path=str(gguf), n_threads=1, n_threads_batch=1, n_ctx=2048, verbose=False)


def greedy_llamacpp(llm, ids: list[int], tokens: int) -> tuple[list[int], float]:
    """llama.cpp greedy decoding: (generated ids, ms per token after the first, which comes out of the prefill)."""
    out, start = [], None
    for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if start is None:
            start = time.perf_counter()
        out.append(int(token))
        if len(out) == tokens:
            break
    return out, (time.perf_counter() - start) * 1e3 / max(tokens - 1, 1)
