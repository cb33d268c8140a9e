"""What a secret residual basis costs on a prepared model: same greedy tokens, perplexity, tok/s.

Compares a public OUT directory with its keyed copy (`privatize --basis`): greedy generation of a few chat
prompts through the split runtime (in process, float32: must be identical; over a WebSocket with a float16
wire: where it diverges from the float32 reference, with the reference's top-1 minus top-2 logit margin
there), held-out perplexity of both in float32 on the audit corpus, and decode tok/s of both, measured
alternately so machine load hits both alike. It writes nothing but the returned dict.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash function is in two sentences.",
    "List three uses of copper.",
    "My account number is 4417-2290 and my PIN is 8812. Summarise this message.",
)


def _margin(model, prompt_ids: list[int], tokens: list[int], at: int) -> float:
    """Top-1 minus top-2 logit of the public model at generated position `at`."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + tokens[:at]])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _generate(client, prompt: str, new_tokens: int):
    started = time.perf_counter()
    got = client.generate(prompt, max_new_tokens=new_tokens, strategy="sequential", stop_ids=set())
    return got, len(got.token_ids) / (time.perf_counter() - started)


def compare(public: Path, keyed: Path, new_tokens: int = 32, prompts: tuple[str, ...] = PROMPTS) -> dict:
    from ..cloud.server import ServerThread
    from ..clients import open_client
    from ..local.session import ClientConfig
    from ..model.shards import load_cloud, load_whole_hf

    reference = load_whole_hf(public)
    clients = {"public": open_client(local_only=True, shards=public), "keyed": open_client(local_only=True, shards=keyed)}
    records, rates, references = [], {"public": [], "keyed": []}, {}
    for prompt in prompts:
        got = {}
        for name in ("public", "keyed"):
            got[name], rate = _generate(clients[name], prompt, new_tokens)
            rates[name].append(rate)
        ref = references[prompt] = got["public"]
        diff = _first_difference(ref.token_ids, got["keyed"].token_ids)
        record = {"prompt": prompt, "tokens": len(ref.token_ids), "float32_identical": diff is None}
        if diff is not None:
            record["float32_first_difference"] = diff
            record["float32_margin"] = _margin(reference, ref.prompt_token_ids, ref.token_ids, diff)
        records.append(record)
    config = ClientConfig(wire_dtype="float16")
    for name, shards in (("public", public), ("keyed", keyed)):
        with ServerThread(load_cloud(shards / "cloud")) as server:
            client = open_client(shards / "local", server.url, config, allow_public_weights=True, checks=False)
            for record, prompt in zip(records, prompts):
                got, _ = _generate(client, prompt, new_tokens)
                ref = references[prompt]
                diff = _first_difference(ref.token_ids, got.token_ids)
                entry = {"identical_to_float32": diff is None}
                if diff is not None:
                    entry["first_difference"] = diff
                    entry["margin"] = _margin(reference, ref.prompt_token_ids, ref.token_ids, diff)
                record[f"float16_wire_{name}"] = entry
    return {
        "public": str(public), "keyed": str(keyed), "new_tokens": new_tokens, "prompts": records,
        "decode_tok_s_median": {k: sorted(v)[len(v) // 2] for k, v in rates.items()},
        "perplexity": _perplexity(reference, keyed),
    }


def _perplexity(reference, keyed: Path) -> dict:
    """Held-out perplexity of both models in float32 on the audit's test chunks (the same text)."""
    from transformers import AutoTokenizer

    from ..model.shards import load_whole_hf
    from .corpus import CorpusConfig, build_corpus
    from .privatize import utility

    tokenizer = AutoTokenizer.from_pretrained(keyed / "local", local_files_only=True)
    corpus = build_corpus(tokenizer, CorpusConfig(max_documents=40, max_chunks_per_document=2))
    return utility(reference, load_whole_hf(keyed), [c.tokens for c in corpus.test[:6]])
