"""Shards hold what their side may hold; the cloud process never has an embedding or LM-head weight."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

from splitinfer.errors import ModelError
from splitinfer.model.shards import load_cloud, load_local

from tiny import prepare_tiny


def shard_keys(path):
    with safe_open(str(path / "weights.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("head,tail", [(1, 1), (2, 3)])
def test_cloud_shard_holds_only_middle_layers(tmp_path, head, tail):
    _, shards = prepare_tiny(tmp_path, "llama", head, tail)
    keys = shard_keys(shards / "cloud")
    layers = {int(k.split(".")[2]) for k in keys}
    assert layers == set(range(head, 6 - tail))
    assert all(k.startswith("model.layers.") for k in keys)
    local_keys = shard_keys(shards / "local")
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= local_keys
    assert {int(k.split(".")[2]) for k in local_keys if k.startswith("model.layers.")} == set(range(head)) | set(
        range(6 - tail, 6)
    )
    assert not keys & local_keys
    manifest = json.loads((shards / "cloud" / "manifest.json").read_text())
    assert manifest["split"]["cloud_layers"] == [head, 6 - tail]
    assert manifest["cloud_fingerprint"] == json.loads((shards / "local" / "manifest.json").read_text())["cloud_fingerprint"]


def test_tied_embedding_is_written_once_and_retied(tmp_path):
    model, shards = prepare_tiny(tmp_path, "qwen2", 2, 2)  # qwen2 tiny config ties embeddings
    assert "lm_head.weight" not in shard_keys(shards / "local")
    local = load_local(shards / "local")
    # Re-tied from the one stored copy: the LM head is the embedding matrix, and computes the model's logits.
    assert torch.equal(local.lm_head.weight, local.embed.weight)
    assert torch.equal(local.lm_head.weight, model.lm_head.weight)
    hidden = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.lm_head(model.model.norm(hidden))[0]
    # The loaded LM head is model/rows.py's linear: the same dot products, possibly in another order.
    torch.testing.assert_close(local.logits(hidden), expected, rtol=1e-5, atol=1e-5)


def test_cloud_process_never_allocates_vocabulary_weights(tmp_path):
    """In a fresh process that loads and runs the cloud half, no tensor has the vocabulary dimension."""
    _, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    script = textwrap.dedent(
        f"""
        import gc, torch
        from splitinfer.model.shards import load_cloud
        half = load_cloud({str(shards / "cloud")!r})
        cache = half.stack.new_cache()
        import numpy as np
        half.stack(torch.zeros(1, 3, 64), torch.arange(3), np.tril(np.ones((3, 3), bool)), cache)
        names = [n for n, _ in half.stack.named_parameters()]
        assert names and all(n.startswith("layers.") for n in names), names
        vocab = [tuple(o.shape) for o in gc.get_objects()
                 if isinstance(o, torch.Tensor) and o.device.type != "meta" and 96 in o.shape]
        print("VOCAB", vocab)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "VOCAB []" in out.stdout


def test_damaged_shard_is_refused(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    weights = shards / "cloud" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="does not match its manifest"):
        load_cloud(shards / "cloud")
    with pytest.raises(ModelError, match="cloud shard is needed"):
        load_cloud(shards / "local")


def test_split_must_leave_layers_on_both_sides(tmp_path):
    with pytest.raises(ModelError, match="at least one"):
        prepare_tiny(tmp_path, "llama", 3, 3)
    with pytest.raises(ModelError, match="at least one local layer"):
        prepare_tiny(tmp_path, "llama", 0, 2)


def test_whole_model_reassembles_from_both_shards(tmp_path):
    from splitinfer.model.shards import load_whole_hf

    model, shards = prepare_tiny(tmp_path, "qwen2", 2, 2)  # tied embeddings
    whole = load_whole_hf(shards)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(whole(ids).logits, model(ids).logits)
