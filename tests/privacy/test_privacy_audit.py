"""End to end on a tiny model: the audit's schema, privatized shards, and the public-weights refusal."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny import prepare_tiny, tiny_model

from splitinfer.errors import ConfigError
from splitinfer.local.client import check_local_weights
from splitinfer.model.shards import load_cloud, load_local, local_weights_are_public, read_manifest
from splitinfer.privacy.attackers import TrainConfig
from splitinfer.privacy.audit import AuditConfig, run_audit
from splitinfer.privacy.corpus import CorpusConfig, build_corpus
from splitinfer.privacy.privatize import PrivatizeConfig, privatize_model, utility, write_private_shard


class CharTokenizer:
    """Characters folded into the tiny model's 96-token vocabulary."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 96 for c in text]}


def test_corpus_splits_by_document_and_marks_canaries():
    corpus = build_corpus(CharTokenizer(), CorpusConfig(sources=("stdlib",), max_documents=30, chunk_tokens=64, canary_fraction=0.5))
    train_docs = {c.doc_id for c in corpus.train}
    test_docs = {c.doc_id for c in corpus.test}
    assert train_docs and test_docs and not (train_docs & test_docs)
    canaries = [c for c in corpus.train + corpus.test if c.canary_len]
    assert canaries
    text = "".join(chr(t) for t in canaries[0].tokens[: canaries[0].canary_len])
    assert "PIN" in text or len(text) == 64  # the canary sentence (possibly cut at the chunk end)


def test_tiny_audit_writes_the_schema_and_a4_recovers_all(tmp_path):
    config = AuditConfig(
        depths=(1, 2), tail_depths=(1, 2),
        corpus=CorpusConfig(sources=("stdlib",), max_documents=14, chunk_tokens=48, max_chunks_per_document=1),
        train=TrainConfig(hidden=32, epochs=1), a4_chunks=2, noise_sigmas=(0.3,),
        privatize=PrivatizeConfig(steps=2, batch_chunks=2, seq_len=24), t2_tokens=(100,), utility_chunks=2, n_boot=50,
    )
    result = run_audit(config, tmp_path, model=tiny_model("llama"), tokenizer=CharTokenizer())
    saved = json.loads((tmp_path / "audit.json").read_text())
    assert (tmp_path / "audit.md").is_file()
    rows = saved["results"]
    required = {"side", "depth", "threat", "attacker", "defence", "top1", "top1_ci", "top5", "baseline_top1",
                "ceiling", "n_tokens", "n_documents"}
    assert all(required <= set(r) for r in rows)
    assert {r["threat"] for r in rows} == {"T0", "T1", "T2"}
    a4 = [r for r in rows if r["attacker"] == "A4" and r["threat"] == "T0" and r["defence"] == "none"]
    assert {(r["side"], r["depth"]) for r in a4} == {("input", 1), ("input", 2), ("output", 1), ("output", 2)}
    assert all(r["top1"] == 1.0 for r in a4)
    for r in rows:
        assert r["top1_ci"][0] <= r["top1"] <= r["top1_ci"][1] + 1e-9
    depth_tests = [t for t in saved["paired_tests"] if t["comparison"] == "depth"]
    assert depth_tests and all({"a", "b", "n01", "n10", "p_value"} <= set(t) for t in depth_tests)
    assert len(result["results"]) == len(rows)
    ident = saved["depth_identification"]
    assert ident["chance"] == 0.5 and 0.0 <= ident["whole vector"]["row_accuracy"] <= 1.0


def test_privatize_pins_new_hashes_keeps_cloud_and_client_refuses_stock(tmp_path):
    model, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    stock = read_manifest(shards / "local", "local")
    assert local_weights_are_public(stock)
    with pytest.raises(ConfigError, match="allow-public-weights"):
        check_local_weights(stock, allow_public_weights=False)
    assert check_local_weights(stock, allow_public_weights=True) is True

    rng = np.random.default_rng(0)
    text = [rng.integers(0, 96, size=32).tolist() for _ in range(6)]
    private, record = privatize_model(model, text, PrivatizeConfig(steps=2, batch_chunks=2, seq_len=32, seed=7))
    assert record["layers"] == [0, 1, 4, 5]
    out = write_private_shard(private, shards, tmp_path / "private", record)
    manifest = read_manifest(out / "local", "local")
    assert not local_weights_are_public(manifest)
    assert check_local_weights(manifest, allow_public_weights=False) is False
    assert manifest["files"]["weights.safetensors"] != stock["files"]["weights.safetensors"]
    assert (out / "cloud" / "weights.safetensors").read_bytes() == (shards / "cloud" / "weights.safetensors").read_bytes()
    local = load_local(out / "local")  # verifies the pinned hashes
    assert local.fingerprint == load_cloud(out / "cloud").fingerprint
    util = utility(model, private, text[:2])
    assert 0.0 <= util["greedy_agreement"] <= 1.0 and util["perplexity"] > 1.0
