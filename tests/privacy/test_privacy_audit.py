"""End to end on a tiny model: the audit's schema, privatized shards, and the public-weights refusal."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from tiny import prepare_tiny, tiny_model

from splitinfer.errors import ConfigError
from splitinfer.local.client import check_local_weights
from splitinfer.model.manifest import local_weights_are_public, read_manifest
from splitinfer.model.shards import load_cloud, load_local
from splitinfer.privacy.attackers import TrainConfig
from splitinfer.privacy.audit import AuditConfig, quick_config, run_audit
from splitinfer.privacy.collect import collect
from splitinfer.privacy.corpus import Chunk, CorpusConfig, attacker_text, build_corpus
from splitinfer.privacy.defences import _classify_depth
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
        privatize=PrivatizeConfig(steps=2, batch_chunks=2, seq_len=24), utility_chunks=2, n_boot=50,
        # Three chosen-plaintext sizes, the smallest below one training batch (the set that once broke the
        # LR schedule), and an output-side cap below the largest.
        t2_tokens=(30, 200, 600), t2_output_tokens=200, t2_train=TrainConfig(hidden=32, epochs=2),
        basis=None,  # T3-T5 have their own test (test_keyed.py)
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
    t2 = {(r["side"], r["attacker"]): r for r in rows if r["threat"] == "T2"}
    assert {a for s, a in t2 if s == "input"} == {"A2 N=30", "A2 N=200", "A2 N=600", "A3 N=30", "A3 N=200", "A3 N=600"}
    assert {a for s, a in t2 if s == "output"} == {"A2 N=30", "A2 N=200", "A3 N=30", "A3 N=200"}  # capped
    assert all(r["chosen_plaintext_tokens"] == int(a.split("=")[1]) for (_, a), r in t2.items())
    own = saved["chosen_plaintext"]
    assert own["input_tokens"] >= 600 and not own["shares_documents_with_audit"]
    curve = {(t["a"], t["b"]) for t in saved["paired_tests"] if t["comparison"] == "chosen-plaintext tokens"}
    assert ("input/2/T2/A2 N=30/private weights", "input/2/T2/A2 N=600/private weights") in curve
    threat = {(t["a"], t["b"]) for t in saved["paired_tests"] if t["comparison"] == "threat"}
    assert ("output/2/T1/A2/private weights", "output/2/T2/A2 N=200/private weights") in threat
    ident = saved["depth_identification"]
    test = saved["corpus"]["test"]
    assert ident["chance"] == 0.5
    for name in ("row statistics", "whole vector"):
        # Every test row is classified once per depth, every test chunk is one session per depth.
        m = ident[name]
        assert (m["n_rows"], m["n_sessions"]) == (2 * test["tokens"], 2 * test["chunks"]), m


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
    agreement, perplexity = _utility_by_hand(model, private, text[:2])
    assert util["greedy_agreement"] == pytest.approx(agreement, abs=1e-9)
    assert util["perplexity"] == pytest.approx(perplexity, rel=1e-4)
    assert util["n_tokens"] == 64
    same = utility(model, model, text[:2])  # a model agrees with itself everywhere
    assert same["greedy_agreement"] == 1.0 and same["perplexity"] == pytest.approx(same["reference_perplexity"])


def _utility_by_hand(reference, model, chunks) -> tuple[float, float]:
    """Greedy agreement with `reference` over all positions and next-token perplexity, from HF's own forward."""
    agree = count = nll = 0.0
    with torch.no_grad():
        for tokens in chunks:
            ids = torch.tensor([tokens])
            ref, got = reference(ids).logits[0], model(ids).logits[0]
            agree += float((got.argmax(-1) == ref.argmax(-1)).sum())
            count += len(tokens)
            nll += float(torch.nn.functional.cross_entropy(got[:-1], ids[0, 1:], reduction="sum"))
    return agree / count, math.exp(nll / (count - len(chunks)))


def test_depth_classifier_known_answers():
    """Separable rows are told apart every time; rows identical at both depths are right exactly half the
    time, whatever the classifier learned (it gives one answer for one input)."""
    rng = np.random.default_rng(0)
    bounds = [(0, 20), (20, 40)]  # two 20-row test chunks per depth: two sessions each
    config = TrainConfig(hidden=16, epochs=40, lr=1e-2)
    apart = [{1: rng.normal(3, 1, (40, 8)), 2: rng.normal(-3, 1, (40, 8))} for _ in range(2)]
    train, test = ({k: v.astype(np.float32) for k, v in part.items()} for part in apart)
    assert _classify_depth(train, test, bounds, bounds, lambda x: x, config) == {
        "row_accuracy": 1.0, "n_rows": 80, "session_accuracy": 1.0, "n_sessions": 4}
    same = rng.normal(0, 1, (40, 8)).astype(np.float32)
    assert _classify_depth({1: same, 2: same}, {1: same, 2: same}, bounds, bounds, lambda x: x, config) == {
        "row_accuracy": 0.5, "n_rows": 80, "session_accuracy": 0.5, "n_sessions": 4}


def test_privatize_distillation_recovers_utility_and_leaves_cloud_layers_alone():
    model = tiny_model("llama")
    rng = np.random.default_rng(1)
    text = [rng.integers(0, 96, size=48).tolist() for _ in range(24)]
    held = [rng.integers(0, 96, size=48).tolist() for _ in range(4)]
    config = PrivatizeConfig(head_layers=2, tail_layers=2, scale=0.5, batch_chunks=4, seq_len=48, lr=1e-2, seed=3)
    untrained, _ = privatize_model(model, text, replace(config, steps=0))
    trained, record = privatize_model(model, text, replace(config, steps=100))
    assert record["head_loss"][1] < 0.2 * record["head_loss"][0] and record["tail_loss"][1] < 0.2 * record["tail_loss"][0]
    # Held-out greedy agreement with the original model (perplexity of random text says little here).
    before, after = utility(model, untrained, held), utility(model, trained, held)
    assert after["greedy_agreement"] > before["greedy_agreement"] + 0.1
    # Only the local layers moved: the cloud layers (2, 3) are bit-identical to the public model's.
    for i in (2, 3):
        for a, b in zip(model.model.layers[i].parameters(), trained.model.layers[i].parameters()):
            assert torch.equal(a, b)
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, trained.model.layers[0].mlp.up_proj.weight)
    assert len(model.model.layers) == len(trained.model.layers) == 6  # the layer swap was undone


def test_attacker_text_is_disjoint_from_the_audit_corpus():
    config = CorpusConfig(sources=("stdlib",), max_documents=20, chunk_tokens=64, max_chunks_per_document=1)
    corpus = build_corpus(CharTokenizer(), config)
    own = attacker_text(CharTokenizer(), config, 5_000, max_chunks_per_document=4)
    audit_docs = {c.source for c in corpus.train + corpus.test}
    assert sum(len(c.tokens) for c in own) >= 5_000
    assert not {c.source for c in own} & audit_docs and min(c.doc_id for c in own) >= 20
    assert max(sum(1 for c in own if c.doc_id == d) for d in {c.doc_id for c in own}) <= 4
    assert any(c.canary_len for c in own)
    # The audit's own corpus is what it was before the attacker's text existed (same seed, same split).
    assert [c.tokens for c in build_corpus(CharTokenizer(), config).test] == [c.tokens for c in corpus.test]


def test_collect_without_tail_depths_runs_the_head_only_and_matches_the_whole_model_pass():
    model = tiny_model("llama")
    chunks = [Chunk(0, "a", list(range(3, 40))), Chunk(1, "b", list(range(50, 70)))]
    whole = collect(model, chunks, (1, 2), (1,))
    head = collect(model, chunks, (1, 2))
    for k in (1, 2):
        assert np.array_equal(whole.inputs[k], head.inputs[k])
    assert np.array_equal(whole.tokens, head.tokens) and np.array_equal(whole.chunk, head.chunk)
    assert (head.greedy == -1).all() and not head.outputs
    assert len(model.model.layers) == 6


def test_audit_cli_takes_t2_tokens():
    import argparse

    from splitinfer.privacy import commands

    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    args = parser.parse_args(["audit", "--out", "x", "--t2-tokens", "1000,10000,100000"])
    assert commands._ints(args.t2_tokens) == (1_000, 10_000, 100_000)
    assert AuditConfig().t2_tokens == (1_000, 10_000, 100_000)
    quick = quick_config("s")
    # --quick is the secret basis's threats at the default split, inside 15 minutes: no T1/T2 there.
    assert quick.basis is not None and quick.depths == quick.tail_depths == (quick.defence_depth,)
    assert quick.privatize is None
    with pytest.raises(ConfigError):
        commands._ints("1000,x")


def test_audit_cli_threats_maps_to_the_keyed_preset():
    import argparse

    from splitinfer.privacy import commands
    from splitinfer.privacy.audit import keyed_config

    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())

    def config(*argv):
        return commands.audit_config(parser.parse_args(["audit", "--out", "x", *argv]))

    # --threats T3: the observer's rows alone, at the preset's size, with nothing else of the audit.
    t3 = config("--threats", "t3", "--keys", "linear")
    preset = keyed_config("shards/smollm2", ("T3",))
    assert t3 == replace(preset, basis=replace(preset.basis, keys=("linear",)))
    assert t3.basis.threats == ("T3",) and not t3.t0 and t3.privatize is None and t3.metadata is None
    assert t3.noise_sigmas == () and t3.depths == t3.tail_depths == (t3.defence_depth,)
    # Larger than --quick's evaluation set, more traffic than T5's pairs need.
    quick = quick_config("shards/smollm2")
    assert t3.corpus.max_documents > quick.corpus.max_documents and t3.a4_chunks > quick.a4_chunks
    assert max(t3.basis.traffic_tokens) > max(t3.basis.t5_pairs)
    # With --quick, the quick audit's sizes; options still apply on top.
    both = config("--quick", "--threats", "T3,T5", "--a4-chunks", "5")
    assert both.basis.threats == ("T3", "T5") and both.corpus == quick.corpus and both.a4_chunks == 5
    assert config().basis.threats == ("T3", "T4", "T5")
    for bad in (("--threats", "T6"), ("--threats", "T3", "--no-basis"), ("--threats", ",")):
        with pytest.raises(ConfigError):
            config(*bad)
