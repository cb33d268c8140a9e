"""Threats against the secret residual basis: the attackers' estimates of the basis, and the audit's rows."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from tiny import tiny_model

from splitinfer.errors import ConfigError
from splitinfer.privacy.attackers import TrainConfig
from splitinfer.privacy.audit import AuditConfig, run_audit
from splitinfer.privacy.basis import BasisConfig, apply_basis, linear_key, random_orthogonal
from splitinfer.privacy.corpus import CorpusConfig
from splitinfer.privacy.keyattacks import moment_alignment, weight_matching
from splitinfer.privacy.keyed import KeyedConfig, template_ids
from splitinfer.privacy.whiten import best_alignment


# What every audit row carries (audit.Audit._row), T0's rows included.
ROW_FIELDS = {"side", "depth", "threat", "attacker", "defence", "top1", "top1_ci", "top5", "top5_ci", "baseline_top1",
              "baseline_top1_ci", "baseline_top5", "majority_token", "ceiling", "train_type_coverage", "n_tokens",
              "n_documents", "exact_sequence", "canary_top1", "canary_tokens", "by_frequency", "eval_set",
              "outcomes_top1_hex"}


class CharTokenizer:
    """Characters folded into the tiny model's 96-token vocabulary (no chat template)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 96 for c in text]}


def test_weight_matching_recovers_the_basis_and_the_permutation():
    model = tiny_model("llama")
    keyed, secret, _ = apply_basis(model, BasisConfig(seed=4, key="orthogonal"))
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


def test_audit_rows_for_the_secret_basis_and_the_linear_key(tmp_path):
    config = AuditConfig(
        depths=(2,), tail_depths=(2,),
        corpus=CorpusConfig(sources=("stdlib",), max_documents=12, chunk_tokens=40, max_chunks_per_document=1),
        train=TrainConfig(hidden=32, epochs=1), a4_chunks=1, noise_sigmas=(), privatize=None, seq_attacker=False,
        utility_chunks=1, n_boot=20, basis=KeyedConfig(t5_pairs=(30, 300), metric_block=16), t0=False,
    )
    run_audit(config, tmp_path, model=tiny_model("llama"), tokenizer=CharTokenizer())
    saved = json.loads((tmp_path / "audit.json").read_text())
    keyed = [r for r in saved["results"] if r["threat"] in ("T3", "T4", "T5")]
    assert len(keyed) == len(saved["results"])  # --quick's shape: no T0 rows
    assert {r["defence"] for r in keyed} == {"secret basis", "secret linear key"}
    assert all(ROW_FIELDS <= set(r) for r in keyed)
    assert saved["eval_sets"]["test"] == keyed[0]["n_tokens"]
    for defence, extra in (("secret basis", "secret_basis"), ("secret linear key", "secret_linear_key")):
        rows = {(r["threat"], r["side"], r["attacker"]): r for r in keyed if r["defence"] == defence}
        assert {r["threat"] for r in rows.values()} == {"T3", "T4", "T5"}
        # The observer without the shard loses the exact match; the host with it gets everything back.
        assert rows[("T3", "input", "A4")]["top1"] < 0.5
        assert rows[("T4", "input", "A5 weight matching + A4")]["top1"] == 1.0
        assert rows[("T4", "output", "A5 weight matching + A4")]["top1"] == 1.0
        assert {a for t, s, a in rows if t == "T5" and a.startswith("A7")} == {"A7 N=30 + A2", "A7 N=30 + A4",
                                                                                "A7 N=300 + A2", "A7 N=300 + A4"}
        # A8 and A9 on the sessions' traffic (T3; the input side also with other sessions), and on traffic of
        # the attacker's own text, unpaired (T5); A4 after A9 on the most T3 traffic.
        a9 = [(t, s) for t, s, a in rows if a.startswith("A9 whitening")]
        t5 = [("T5", "input"), ("T5", "output")]
        assert sorted(a9) == sorted([("T3", "input")] * 3 + [("T3", "output")] * 2 + t5)
        a8 = [(t, s) for t, s, a in rows if a.startswith("A8 moment")]
        assert sorted(a8) == sorted([("T3", "input")] * 2 + [("T3", "output"), ("T5", "input"), ("T5", "output")])
        info = saved[extra]
        assert info["t4"]["permutation_recovered"] == 1.0 and info["t4"]["rotation_error"] < 1e-5
        # The rows are computed from public states times the key; the keyed model sends just that.
        assert info["basis"]["identity_error"] < 1e-4
    assert saved["secret_linear_key"]["t4"]["used_norm_factor"]
    assert (tmp_path / "audit.md").is_file()


def test_threats_run_alone_give_the_same_rows_as_in_the_whole_keyed_audit(tmp_path):
    """`--threats T3`: only the observer's rows, each the same as when T4 and T5 run beside it."""
    config = AuditConfig(
        depths=(2,), tail_depths=(2,),
        corpus=CorpusConfig(sources=("stdlib",), max_documents=12, chunk_tokens=40, max_chunks_per_document=1),
        train=TrainConfig(hidden=32, epochs=1), a4_chunks=1, noise_sigmas=(), privatize=None, seq_attacker=False,
        utility_chunks=1, n_boot=20, t0=False,
        basis=KeyedConfig(t5_pairs=(30,), keys=("linear",), metric_block=16, traffic_tokens=(100, 300)),
    )
    rows = {}
    for threats in (("T3", "T4", "T5"), ("T3",)):
        out = tmp_path / "-".join(threats)
        run_audit(replace(config, basis=replace(config.basis, threats=threats)), out, model=tiny_model("llama"),
                  tokenizer=CharTokenizer())
        rows[threats] = {(r["side"], r["attacker"]): r for r in json.loads((out / "audit.json").read_text())["results"]
                         if r["threat"] == "T3" or threats == ("T3",)}
    alone, together = rows[("T3",)], rows[("T3", "T4", "T5")]
    assert {r["threat"] for r in alone.values()} == {"T3"}
    assert alone.keys() == together.keys()
    assert all(alone[key]["outcomes_top1_hex"] == together[key]["outcomes_top1_hex"] for key in alone)
    # A9 on the sessions' traffic, then with each amount of other sessions' traffic; A4 after the largest.
    a9 = [r for (side, attacker), r in alone.items() if side == "input" and attacker.startswith("A9")]
    traffic = [r["traffic_tokens"] for r in a9 if r["attacker"].endswith("A2")]
    assert len(traffic) == 3 and traffic == sorted(traffic) and len(set(traffic)) == 3
    assert [r["traffic_tokens"] for r in a9 if r["attacker"].endswith("A4")] == [traffic[-1]]
    with pytest.raises(ConfigError):
        KeyedConfig(threats=("T6",))


def test_weight_matching_recovers_a_linear_key_through_the_norm_factor():
    model = tiny_model("llama")
    keyed, secret, _ = apply_basis(model, BasisConfig(seed=4, key="linear", metric_block=16))
    factor = torch.block_diag(*keyed.model.layers[3].post_attention_layernorm.factor.double()).numpy()
    r, record, match = weight_matching(model.model.layers[3], keyed.model.layers[3], factor)
    assert np.abs(r - secret.inverse.numpy()).max() < 1e-4
    assert (match == secret.neuron_perms[3].numpy()).all() and record["used_norm_factor"]
    # Without the factor the reading weights still give the rotation, but not the way back from h A.
    blind, _, _ = weight_matching(model.model.layers[3], keyed.model.layers[3])
    assert np.abs(blind - secret.inverse.numpy()).max() > 0.1


def _sequences(rng, n: int, d: int, mix: np.ndarray) -> np.ndarray:
    """Skewed sources with a distinct one-step memory per coordinate, in sequences of 100, mixed."""
    coef = np.linspace(0.1, 0.9, d)
    x = rng.gamma(2.0, 1.0, size=(n, d)) * np.linspace(1, 3, d)
    for t in range(1, n):
        if t % 100:
            x[t] += coef * x[t - 1]
    return x @ mix


def test_whitening_recovers_a_general_linear_key_from_unlabelled_traffic():
    rng = np.random.default_rng(0)
    d, n = 8, 40_000
    mix = np.random.default_rng(5).normal(size=(d, d))
    a, _ = linear_key(d, 8.0, 4, torch.Generator().manual_seed(1))
    a = a.numpy()
    bounds = [(s, s + 100) for s in range(0, n, 100)]
    anchors = _sequences(rng, 10, d, mix)
    own, traffic = _sequences(rng, n, d, mix), _sequences(rng, n, d, mix)  # independent samples
    public = {"x": own, "bounds": bounds, "other": None, "anchors": anchors}
    observed = {"x": traffic @ a, "bounds": bounds, "other": None, "anchors": anchors @ a}
    found, scores = best_alignment(public, observed)
    assert found.method == "lag1" and set(scores) == {"fobi", "lag1"}  # no other direction given: no cross
    error = np.linalg.norm(found(traffic @ a) - traffic) / np.linalg.norm(traffic)
    assert error < 0.05
    # Gaussian white noise has no statistic beyond the covariance: whitening leaves the rotation unknown.
    own, traffic = rng.normal(size=(n, d)), rng.normal(size=(n, d))
    public = {"x": own, "bounds": bounds, "other": None, "anchors": anchors}
    observed = {"x": traffic @ a, "bounds": bounds, "other": None, "anchors": anchors @ a}
    found, _ = best_alignment(public, observed)
    assert np.linalg.norm(found(traffic @ a) - traffic) / np.linalg.norm(traffic) > 0.5
