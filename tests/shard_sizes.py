"""A prepared shard's weight bytes from a model's config alone: each tensor's parameter count times its bytes.

What docs/deploy.md quotes for a 7B model, and what tests/test_deploy_guide.py checks against the shards the
guide prepares (model/formats.py says how each format stores a weight; model/keyed_norm.py the keyed norms).
Llama/Mistral layouts without biases only.
"""

from __future__ import annotations

from pathlib import Path

from splitinfer.privacy.basis import BasisConfig

BYTES = {"float32": 4, "bfloat16": 2}
KEY_BLOCK = BasisConfig().metric_block  # `privatize --basis`: its norms' factor blocks (divide d here)


def linear_bytes(rows: int, cols: int, fmt: str) -> int:
    """A [rows, cols] linear's bytes: int8 adds a float32 scale per row and a float32 smoothing factor per column."""
    return rows * cols + 4 * (rows + cols) if fmt == "int8" else rows * cols * BYTES[fmt]


def norm_bytes(cfg: dict, key_block: int) -> int:
    """An RMSNorm's float32 gain, or under `privatize --basis` its factor: [d / block, block, block] (no gain)."""
    return cfg["hidden_size"] * (key_block or 1) * 4


def layer_bytes(cfg: dict, fmt: str, key_block: int = 0) -> int:
    """One Llama/Mistral decoder layer (no biases): seven linears in `fmt` and two RMSNorms."""
    assert not (cfg.get("attention_bias") or cfg.get("mlp_bias")), "biases are not counted here"
    d, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or d // heads
    q, kv = heads * head_dim, (cfg.get("num_key_value_heads") or heads) * head_dim
    linears = [(q, d), (kv, d), (kv, d), (d, q), (inter, d), (inter, d), (d, inter)]
    return sum(linear_bytes(rows, cols, fmt) for rows, cols in linears) + 2 * norm_bytes(cfg, key_block)


def shard_bytes(cfg: dict, local_layers: int, formats: dict, key_block: int = 0) -> tuple[int, int]:
    """(local, cloud) weight bytes of prepared shards (`key_block`: privatized with a linear key of that block):
    the float32 embedding and final norm, the local layers and the LM head (stored apart from a tied embedding
    only when quantized) local, the rest cloud."""
    d, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    separate_head = formats["lm_head"] != "float32" or not cfg.get("tie_word_embeddings", False)
    head = linear_bytes(vocab, d, formats["lm_head"]) if separate_head else 0
    layers_bytes = local_layers * layer_bytes(cfg, formats["local"], key_block)
    local = vocab * d * 4 + layers_bytes + head + norm_bytes(cfg, key_block)
    return local, (layers - local_layers) * layer_bytes(cfg, formats["cloud"], key_block)


def tensor_bytes(shard: Path) -> int:
    """The bytes of a shard's tensors (its file, less the safetensors header)."""
    from safetensors import safe_open

    with safe_open(shard / "weights.safetensors", "pt") as f:
        return sum(f.get_tensor(key).nbytes for key in f.keys())
