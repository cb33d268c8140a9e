"""Threats against the secret residual basis: the attackers' estimates of the basis, and the audit's rows."""

from __future__ import annotations

import json

import numpy as np
import torch
from tiny import tiny_model

from splitinfer.privacy.attackers import TrainConfig
from splitinfer.privacy.audit import AuditConfig, run_audit
from splitinfer.privacy.basis import BasisConfig, apply_basis, random_orthogonal
from splitinfer.privacy.corpus import CorpusConfig
from splitinfer.privacy.keyed import KeyedConfig, moment_alignment, template_ids, weight_matching


class CharTokenizer:
    """Characters folded into the tiny model's 96-token vocabulary (no chat template)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 96 for c in text]}


def test_weight_matching_recovers_the_basis_and_the_permutation():
    model = tiny_model("llama")
    keyed, secret, _ = apply_basis(model, BasisConfig(seed=4))
    r, record, match = weight_matching(model.model.layers[3], keyed.model.layers[3])
    assert np.abs(r - secret.q.numpy().T).max() < 1e-5
    assert (match == secret.neuron_perms[3].numpy()).all()
    assert record["weight_residual"] < 1e-6


def test_moment_alignment_finds_a_rotation_when_the_statistics_are_distinct():
    rng = np.random.default_rng(0)
    d, n = 8, 50_000
    q = random_orthogonal(d, torch.Generator().manual_seed(1)).numpy()
    # Two independent samples (the attacker's text, the observed traffic) with distinct variances and a
    # skew along every axis: the case where moments pin the basis down.
    scale = np.linspace(1, 3, d)[None]
    own, traffic = (rng.gamma(2.0, 1.0, size=(n, d)) * scale for _ in range(2))
    assert np.abs(moment_alignment(own, traffic @ q) - q.T).max() < 0.1
    # Isotropic samples: nothing to align on, and the estimate is far from Q^T.
    own, traffic = rng.normal(size=(n, d)), rng.normal(size=(n, d))
    assert np.abs(moment_alignment(own, traffic @ q) - q.T).max() > 0.3


def test_template_ids_fall_back_without_a_chat_template():
    assert template_ids(CharTokenizer())[:12] == [ord(c) % 96 for c in "<|im_start|>"]


def test_audit_rows_for_the_secret_basis(tmp_path):
    config = AuditConfig(
        depths=(2,), tail_depths=(2,),
        corpus=CorpusConfig(sources=("stdlib",), max_documents=12, chunk_tokens=40, max_chunks_per_document=1),
        train=TrainConfig(hidden=32, epochs=1), a4_chunks=1, noise_sigmas=(), privatize=None, seq_attacker=False,
        utility_chunks=1, n_boot=20, basis=KeyedConfig(t5_pairs=(30, 300)),
    )
    run_audit(config, tmp_path, model=tiny_model("llama"), tokenizer=CharTokenizer())
    saved = json.loads((tmp_path / "audit.json").read_text())
    rows = {(r["threat"], r["side"], r["attacker"]): r for r in saved["results"]}
    t0_fields = set(next(r for r in saved["results"] if r["threat"] == "T0"))
    keyed = [r for r in saved["results"] if r["threat"] in ("T3", "T4", "T5")]
    assert {r["threat"] for r in keyed} == {"T3", "T4", "T5"}
    per_attacker = {"train_seconds", "epochs_run", "capped", "a4", "a4_max_candidates"}
    assert all(t0_fields - per_attacker <= set(r) for r in keyed)
    assert all(r["defence"] == "secret basis" for r in keyed)
    # The observer without the shard loses the exact match; the host with it gets everything back.
    assert rows[("T3", "input", "A4")]["top1"] < 0.5
    assert rows[("T4", "input", "A5 weight matching + A4")]["top1"] == 1.0
    assert rows[("T4", "output", "A5 weight matching + A4")]["top1"] == 1.0
    assert {a for t, s, a in rows if t == "T5"} == {"A7 N=30 + A2", "A7 N=30 + A4", "A7 N=300 + A2", "A7 N=300 + A4"}
    basis = saved["secret_basis"]
    assert basis["t4"]["permutation_recovered"] == 1.0 and basis["t4"]["rotation_error"] < 1e-5
    assert (tmp_path / "audit.md").is_file()
