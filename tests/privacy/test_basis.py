"""The secret residual basis computes the public model's function in other coordinates (privacy/basis.py)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import hf_greedy, prepare_tiny, tiny_model

from splitinfer.cli import main
from splitinfer.errors import ConfigError
from splitinfer.clients import open_client
from splitinfer.model.keyed_norm import KeyedRMSNorm
from splitinfer.model.manifest import read_manifest
from splitinfer.model.shards import load_cloud, load_whole_hf
from splitinfer.privacy.basis import BasisConfig, apply_basis, metric_block, write_basis_shards

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_keyed_model_is_the_public_function_in_a_rotated_basis(family):
    model = tiny_model(family)
    keyed, secret, record = apply_basis(model, BasisConfig(seed=3, key="orthogonal"))
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        public = model(ids, output_hidden_states=True)
        rotated = keyed(ids, output_hidden_states=True)
    assert torch.allclose(public.logits, rotated.logits, atol=1e-4)
    assert hf_greedy(model, PROMPT, 24) == hf_greedy(keyed, PROMPT, 24)
    for h, h_keyed in zip(public.hidden_states[1:-1], rotated.hidden_states[1:-1]):
        # What crosses the wire is h Q: not h itself, and Q is orthogonal.
        assert torch.allclose((h.double() @ secret.q).float(), h_keyed, atol=1e-4)
        assert (h - h_keyed).abs().max() > 0.1
    assert torch.allclose(secret.q @ secret.q.T, torch.eye(64, dtype=torch.float64), atol=1e-10)
    # Every stream norm's gain was folded away; the heads and neurons were shuffled.
    assert all(bool((layer.input_layernorm.weight == 1).all()) for layer in keyed.model.layers)
    assert bool((keyed.model.norm.weight == 1).all()) and not keyed.config.tie_word_embeddings
    assert any(not torch.equal(p, torch.arange(len(p))) for p in secret.neuron_perms)
    assert any(not torch.equal(p, torch.arange(len(p))) for p in secret.head_perms)
    assert model.config.tie_word_embeddings == (family == "qwen2")  # the public model is left as it was
    assert record["permute_heads"] and record["permute_neurons"]


def test_two_deployments_get_different_bases():
    model = tiny_model("llama")
    a, _, _ = apply_basis(model, BasisConfig(seed=1, key="orthogonal"))
    b, _, _ = apply_basis(model, BasisConfig(seed=2, key="orthogonal"))
    assert not torch.allclose(a.model.layers[3].mlp.up_proj.weight, b.model.layers[3].mlp.up_proj.weight)


def test_unsupported_family_is_refused():
    with pytest.raises(ConfigError, match="residual basis"):
        apply_basis(tiny_model("gemma3"))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_basis_shards_generate_the_public_tokens(tmp_path, family):
    model, shards = prepare_tiny(tmp_path, family, 2, 2)
    keyed, secret, record = apply_basis(model, BasisConfig(seed=5, key="orthogonal"))
    out, _ = write_basis_shards(keyed, secret, shards, tmp_path / "keyed", record)
    local, public = read_manifest(out / "local", "local"), read_manifest(shards / "local", "local")
    assert local["residual_basis"]["method"].startswith("orthogonal")
    assert local["split"] == public["split"]
    assert load_cloud(out / "cloud").fingerprint != public["cloud_fingerprint"]  # a cloud shard per deployment
    got = open_client(local_only=True, shards=out).generate(PROMPT, max_new_tokens=24, stop_ids=set())
    assert got.token_ids == hf_greedy(model, PROMPT, 24)


def test_privatize_basis_cli(tmp_path, capsys):
    _, shards = prepare_tiny(tmp_path, "mistral", 1, 2)
    out = tmp_path / "keyed"
    assert main(["privacy", "privatize", "--shards", str(shards), "--out", str(out), "--basis", "--seed", "9"]) == 0
    assert "secret residual basis" in capsys.readouterr().out
    manifest = json.loads((out / "local" / "manifest.json").read_text())
    assert manifest["residual_basis"]["self_check_max_logit_difference"] < 1e-3
    # The CLI turns a ConfigError into one line on stderr and a non-zero exit.
    both = ["privacy", "privatize", "--shards", str(shards), "--out", str(tmp_path / "x"), "--basis", "--text", str(shards)]
    assert main(both) != 0
    assert "--basis needs no --text" in capsys.readouterr().err
    assert main(["privacy", "privatize", "--shards", str(shards), "--out", str(tmp_path / "y")]) != 0
    assert "pass the organisation's own text with --text" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_linear_key_computes_the_public_function_and_hides_inner_products(family):
    model = tiny_model(family)
    config = BasisConfig(seed=6, key="linear", condition=8.0, metric_block=16)
    keyed, secret, record = apply_basis(model, config)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        public = model(ids, output_hidden_states=True)
        carried = keyed(ids, output_hidden_states=True)
    assert torch.allclose(public.logits, carried.logits, atol=1e-4)
    assert hf_greedy(model, PROMPT, 24) == hf_greedy(keyed, PROMPT, 24)
    a = secret.a
    assert abs(torch.linalg.cond(a).item() - 8.0) < 1e-6 and record["condition_measured"] == 8.0
    for h, h_keyed in zip(public.hidden_states[1:-1], carried.hidden_states[1:-1]):
        assert torch.allclose((h.double() @ a).float(), h_keyed, atol=1e-4)
        # Not an orthogonal change of basis: row norms and inner products between rows move.
        gram, gram_keyed = h[0] @ h[0].T, h_keyed[0] @ h_keyed[0].T
        assert ((gram - gram_keyed).abs().max() / gram.abs().max()) > 0.05
    norms = [m for m in keyed.modules() if isinstance(m, KeyedRMSNorm)]
    assert len(norms) == 2 * model.config.num_hidden_layers + 1
    assert norms[0].factor.shape == (4, 16, 16)
    # |h A F| = |h|: the factor measures the public norm; it is the key up to an orthogonal matrix only.
    f = torch.block_diag(*secret.factor)
    assert torch.allclose((a @ f) @ (a @ f).T, torch.eye(64, dtype=torch.float64), atol=1e-10)


def test_linear_key_shards_load_with_keyed_norms_and_plain_shards_without(tmp_path):
    model, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    keyed, secret, record = apply_basis(model, BasisConfig(seed=8, key="linear", metric_block=16))
    out, _ = write_basis_shards(keyed, secret, shards, tmp_path / "keyed", record)
    cloud = load_cloud(out / "cloud")
    assert all(isinstance(layer.input_layernorm, KeyedRMSNorm) for layer in cloud.stack.layers)
    assert not any(isinstance(m, KeyedRMSNorm) for m in load_cloud(shards / "cloud").stack.modules())
    assert read_manifest(out / "local", "local")["residual_basis"]["method"].startswith("linear key")
    got = open_client(local_only=True, shards=out).generate(PROMPT, max_new_tokens=24, stop_ids=set())
    assert got.token_ids == hf_greedy(model, PROMPT, 24)
    whole = load_whole_hf(out)
    assert isinstance(whole.model.norm, KeyedRMSNorm)
    with torch.no_grad():
        assert torch.allclose(whole(torch.tensor([PROMPT])).logits, model(torch.tensor([PROMPT])).logits, atol=1e-4)


def test_basis_config_refuses_a_bad_key():
    with pytest.raises(ConfigError, match="--key must be one of"):
        BasisConfig(key="affine")
    with pytest.raises(ConfigError, match="condition number"):
        BasisConfig(key="linear", condition=0.5)


def test_metric_block_tiles_the_stream():
    assert metric_block(576, 64) == 64 and metric_block(960, 64) == 64 and metric_block(100, 64) == 50
    assert metric_block(97, 64) == 1
