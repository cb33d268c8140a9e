"""bench/dtypecheck.py: the teacher-forced score is the model's own likelihood, and the report holds every
dtype pair's perplexity and every divergence of speculation from sequential decoding in a dtype."""

from __future__ import annotations

import argparse
import json
import math

import torch

from splitinfer.bench import dtypecheck
from splitinfer.model.prepare import prepare
from splitinfer.model.source import SourceModel

from tiny import char_tokenizer, prepare_tiny, tiny_model

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71]


def test_teacher_forced_scoring_is_the_models_own_likelihood(tmp_path):
    model, shards = prepare_tiny(tmp_path, "llama", 2, 1)
    clients = dtypecheck.Clients(shards)
    ids = PROMPT + [5, 6, 7, 8, 9]
    nll, top1 = dtypecheck.teacher_forced(clients.get("float32", "float32"), ids, len(PROMPT))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(PROMPT) - 1 : -1]
    expected = -torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[len(PROMPT) :])[:, None])[:, 0]
    torch.testing.assert_close(nll, expected, rtol=1e-4, atol=1e-4)
    assert top1.tolist() == logits.argmax(-1).tolist()
    low, _ = dtypecheck.teacher_forced(clients.get("bfloat16", "bfloat16"), ids, len(PROMPT))
    assert low.dtype == torch.float32 and not torch.equal(low, nll)  # bfloat16 rounds: the check sees it
    assert clients.get("bfloat16", "bfloat16") is clients.get("bfloat16", "bfloat16")


def test_the_report(tmp_path, monkeypatch):
    model = tiny_model("llama")
    shards = tmp_path / "shards"
    prepare(SourceModel("tiny-llama", model.config, model, char_tokenizer()), shards, 2, 1, "float32")
    texts = [{"id": "t1", "user": "Say something.", "reply": "Something about the weather, and more of it."},
             {"id": "t2", "user": "x" * 400, "reply": "a prompt over half of max_tokens is left out"}]
    monkeypatch.setattr(dtypecheck, "heldout_texts", lambda n: (texts[:n], {"source": "test"}))
    args = argparse.Namespace(shards=str(shards), out=str(tmp_path / "out"), dtype="bfloat16", conversations=2,
                              max_tokens=128, strategies="tree-nohead", exact_dtypes="float32,bfloat16",
                              max_new_tokens=8, per_category=1, prompts=None)
    threads = torch.get_num_threads()
    try:
        report = dtypecheck.run(args, log=lambda _: None)
    finally:
        torch.set_num_threads(threads)  # run() pins one thread, as the benchmarks run; later tests keep their own
    assert json.loads((tmp_path / "out" / "dtype.json").read_text())["perplexity"] == report["perplexity"]
    rows = report["perplexity"]
    assert [(r["local"], r["cloud"]) for r in rows] == [("float32", "float32"), ("bfloat16", "float32"),
                                                         ("float32", "bfloat16"), ("bfloat16", "bfloat16")]
    assert all(r["texts"] == 1 and r["tokens"] > 10 and math.isfinite(r["perplexity"]) for r in rows)
    assert rows[0]["top1_agrees_with_float32"] == 1.0
    prompts = len(report["prompts"])
    for dtype in ("float32", "bfloat16"):
        x = report["exactness"][dtype]
        assert x["generations"] == prompts and x["identical"] + len(x["divergences"]) == prompts
    assert report["exactness"]["float32"]["identical"] == prompts  # float32 trees are exact: the control
    text = (tmp_path / "out" / "dtype.md").read_text()
    assert "| bfloat16 | bfloat16 |" in text and "| float32 | " in text
