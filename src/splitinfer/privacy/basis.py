"""A secret residual basis per deployment: the same function, computed in coordinates only the client knows.

The residual stream of a pre-norm decoder is only ever read through RMSNorm (which sees its length, and
so is blind to an orthogonal change of basis once its gain is moved into the next linear layer) and
written by o_proj and down_proj. So for a random orthogonal Q (d x d) the model with

    embedding E Q;  per layer  W_{q,k,v} diag(g_in) Q,  Q^T W_o,  W_{gate,up} diag(g_post) Q,  Q^T W_down;
    final norm gain ones;  LM head W_lm diag(g_final) Q;  every RMSNorm gain on the stream set to ones

carries h Q wherever the public model carries h, and computes the same logits (float32: the same greedy
tokens). On top, each layer's attention heads (kv heads together with their query groups, so GQA holds)
and MLP neurons are permuted at random: the cloud layers are then no longer the public tensors even up
to Q. The runtime is untouched: the transformed model is an ordinary HF model of the same architecture
(untied: the LM head and the embedding no longer share a matrix).

What it protects, and from whom, is measured by the audit (threats T3-T5, docs/privacy.md): a party that
sees activations but not the cloud shard faces h Q instead of h; the host holding the cloud shard can
recover Q by matching its weights against the public ones. This module knows HF Llama-style models and
nothing about shards or the wire; `write_basis_shards` hands the result to model.shards.prepare.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError

# Pre-norm decoders whose every stream read is an RMSNorm with a plain gain (Gemma's (1 + w) gains and
# sandwich norms after o_proj/down_proj are not foldable this way).
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class BasisConfig:
    permute_heads: bool = True  # permute attention heads per layer (kv heads with their query groups)
    permute_neurons: bool = True  # permute MLP neurons per layer
    seed: int | None = None  # the secret; None draws one from the OS (never written anywhere)


@dataclass
class Basis:
    """The secret of one deployment (held in memory only: the local shard's weights imply it anyway)."""

    q: torch.Tensor  # [d, d] float64 orthogonal: public state h becomes h @ q
    head_perms: list[torch.Tensor]  # per layer: [n_kv] new kv head j holds old kv head perm[j]
    neuron_perms: list[torch.Tensor]  # per layer: [intermediate] new neuron j is old neuron perm[j]


def secret_seed(seed: int | None) -> int:
    if seed is not None:
        return seed
    return int.from_bytes(np.random.SeedSequence().entropy.to_bytes(16, "little")[:8], "little")


def random_orthogonal(d: int, generator: torch.Generator) -> torch.Tensor:
    """A Haar-random [d, d] orthogonal matrix (QR of a Gaussian, signs fixed by R's diagonal), float64."""
    q, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None]


def check_supported(model: nn.Module) -> None:
    kind = getattr(model.config, "model_type", "?")
    if kind not in SUPPORTED:
        raise ConfigError(
            f"a secret residual basis needs a pre-norm decoder with plain RMSNorm gains ({', '.join(SUPPORTED)}); "
            f"this model is {kind!r}. Use a supported family or leave out --basis."
        )


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _query_order(kv_perm: torch.Tensor, group: int, generator: torch.Generator) -> torch.Tensor:
    """Query heads in the order their kv heads were permuted; within a group, a random order too."""
    order = [int(kv) * group + int(i) for kv in kv_perm for i in torch.randperm(group, generator=generator)]
    return torch.tensor(order)


def _rows(perm: torch.Tensor, size: int) -> torch.Tensor:
    """Row indices that move blocks of `size` rows into the order `perm`."""
    return (perm[:, None] * size + torch.arange(size)[None]).reshape(-1)


def _set(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    linear.weight.data = weight.to(linear.weight.dtype).contiguous()
    if bias is not None:
        linear.bias.data = bias.to(linear.bias.dtype).contiguous()


def _fold_attention(attn: nn.Module, gain: torch.Tensor, q: torch.Tensor, config, perm: torch.Tensor | None,
                    generator: torch.Generator) -> None:
    """W_{q,k,v} <- W diag(g) Q (rows permuted by head), W_o <- Q^T W_o (columns permuted), bias_o <- b Q."""
    hd, group = _head_dim(config), config.num_attention_heads // config.num_key_value_heads
    kv_rows = q_rows = None
    if perm is not None:
        kv_rows = _rows(perm, hd)
        q_rows = _rows(_query_order(perm, group, generator), hd)
    for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
        lin = getattr(attn, name)
        w = lin.weight.double() * gain[None] @ q  # [out, d]
        b = lin.bias.double() if lin.bias is not None else None
        if rows is not None:
            w, b = w[rows], (b[rows] if b is not None else None)
        _set(lin, w, b)
    o = attn.o_proj
    w = q.T @ o.weight.double()  # [d, heads*hd]
    if q_rows is not None:
        w = w[:, q_rows]
    _set(o, w, o.bias.double() @ q if o.bias is not None else None)


def _fold_mlp(mlp: nn.Module, gain: torch.Tensor, q: torch.Tensor, perm: torch.Tensor | None) -> None:
    for name in ("gate_proj", "up_proj"):
        lin = getattr(mlp, name)
        w = lin.weight.double() * gain[None] @ q
        b = lin.bias.double() if lin.bias is not None else None
        if perm is not None:
            w, b = w[perm], (b[perm] if b is not None else None)
        _set(lin, w, b)
    down = mlp.down_proj
    w = q.T @ down.weight.double()
    if perm is not None:
        w = w[:, perm]
    _set(down, w, down.bias.double() @ q if down.bias is not None else None)


def _ones(norm: nn.Module) -> torch.Tensor:
    """The norm's gain (float64) before it is set to ones."""
    gain = norm.weight.detach().double().clone()
    norm.weight.data = torch.ones_like(norm.weight)
    return gain


@torch.no_grad()
def apply_basis(model: nn.Module, config: BasisConfig = BasisConfig()) -> tuple[nn.Module, Basis, dict]:
    """A copy of `model` in a secret residual basis; returns (model, the secret, a record for the manifest).

    Arithmetic is float64, so the float32 result differs from the public model by rounding only.
    """
    check_supported(model)
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(secret_seed(config.seed))
    out = copy.deepcopy(model)
    cfg = out.config
    d = cfg.hidden_size
    q = random_orthogonal(d, generator)
    embed = out.model.embed_tokens
    lm_weight = out.lm_head.weight.detach().double().clone()
    embed.weight.data = (embed.weight.double() @ q).to(embed.weight.dtype)
    head_perms, neuron_perms = [], []
    for layer in out.model.layers:
        hp = torch.randperm(cfg.num_key_value_heads, generator=generator) if config.permute_heads else None
        np_ = torch.randperm(cfg.intermediate_size, generator=generator) if config.permute_neurons else None
        _fold_attention(layer.self_attn, _ones(layer.input_layernorm), q, cfg, hp, generator)
        _fold_mlp(layer.mlp, _ones(layer.post_attention_layernorm), q, np_)
        head_perms.append(hp if hp is not None else torch.arange(cfg.num_key_value_heads))
        neuron_perms.append(np_ if np_ is not None else torch.arange(cfg.intermediate_size))
    final_gain = _ones(out.model.norm)
    # The embedding rotated as E Q but the head needs W diag(g) Q: the two no longer share one matrix.
    out.lm_head.weight = nn.Parameter((lm_weight * final_gain[None] @ q).to(embed.weight.dtype), requires_grad=False)
    cfg.tie_word_embeddings = False
    record = {
        "method": "orthogonal residual basis with RMSNorm gains folded",
        "permute_heads": config.permute_heads,
        "permute_neurons": config.permute_neurons,
        "seconds": round(time.perf_counter() - started, 2),
    }
    return out.eval(), Basis(q, head_perms, neuron_perms), record


def write_basis_shards(model: nn.Module, shards: Path, out: Path, record: dict) -> Path:
    """OUT/local and OUT/cloud for `model` (from apply_basis), with the split, dtype and tokenizer of the
    prepared `shards`. Both shards are new: the cloud shard belongs to this deployment only."""
    from transformers import AutoTokenizer

    from ..model.shards import prepare, read_manifest
    from ..model.source import SourceModel

    if out.exists():
        raise ConfigError(f"{out} exists; choose a new --out directory.")
    manifest = read_manifest(shards / "local", "local")
    split = manifest["split"]
    tokenizer = None
    if manifest.get("has_tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(shards / "local", local_files_only=True)
    head_range = split.get("head_range")
    prepare(
        SourceModel(manifest["model_id"], model.config, model, tokenizer), out,
        head_layers=split["head_layers"], tail_layers=split["tail_layers"], dtype=manifest["dtype"],
        split_range=tuple(head_range) if head_range else None,
    )
    local = read_manifest(out / "local", "local")
    local["residual_basis"] = record
    (out / "local" / "manifest.json").write_text(json.dumps(local, indent=2, sort_keys=True))
    return out
