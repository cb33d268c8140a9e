"""An RMSNorm that measures the norm in another basis: the norm of a stream carried under a linear key.

A model keyed with a general invertible A (privacy/basis.py, `--key linear`) carries x' = x A on its
residual stream instead of x. Its RMSNorms must still divide by rms(x). The key is built as A = Q S V^T
with a factor F = V S^-1 such that A F = Q is orthogonal, so y = x' F = x Q has the public norm: the
keyed norm maps the stream through F and then runs a plain RMSNorm on y. Its output is in the orthogonal
basis Q, which (with the norm's gain) is folded into the linear layers that read it.

    KeyedRMSNorm(x') = rms_norm(x' F)        F = blockdiag(F_1 .. F_n)   [d, d], blocks of `block`

F is block diagonal, so the norm costs d * block multiply-adds per token (not d^2) on top of a plain one.
The factor is a weight like any other (`<norm>.factor`, [n, block, block]) and travels in the shards;
`install` puts keyed norms into a model skeleton wherever the weights hold one, so a plain shard loads
exactly as before. This module knows the HF Llama-style module names and nothing about keys or attacks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FACTOR = "factor"


class KeyedRMSNorm(nn.Module):
    """RMSNorm of x' F without a gain: x': [..., d] -> [..., d] (in the basis x' F), same dtype."""

    def __init__(self, hidden_size: int, block: int, eps: float, device=None, dtype=None):
        super().__init__()
        assert hidden_size % block == 0, (hidden_size, block)
        self.block, self.eps = block, eps
        self.factor = nn.Parameter(torch.empty(hidden_size // block, block, block, device=device, dtype=dtype),
                                   requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # [n, T, block] @ [n, block, block]: each block of coordinates through its factor block, as one bmm
        # (a broadcast matmul over [..., n, 1, block] ran 3-50x slower on a CPU), in float32 as HF's
        # RMSNorm computes its variance.
        n = self.factor.shape[0]
        x = hidden.float().reshape(-1, n, self.block).transpose(0, 1)
        y = torch.bmm(x, self.factor.float()).transpose(0, 1).reshape(hidden.shape)
        return F.rms_norm(y, (y.shape[-1],), eps=self.eps).to(hidden.dtype)

    def extra_repr(self) -> str:
        return f"blocks={self.factor.shape[0]}x{self.block}, eps={self.eps}"


def stream_norms(model: nn.Module) -> dict[str, nn.Module]:
    """{qualified name: module} of every RMSNorm that reads the residual stream (not q_norm/k_norm)."""
    names = {"model.norm": model.model.norm}
    for i, layer in enumerate(model.model.layers):
        names[f"model.layers.{i}.input_layernorm"] = layer.input_layernorm
        names[f"model.layers.{i}.post_attention_layernorm"] = layer.post_attention_layernorm
    return names


def _eps(norm: nn.Module, config) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", config.rms_norm_eps)))


def replace_norm(model: nn.Module, name: str, block: int, device=None, dtype=None) -> KeyedRMSNorm:
    """Swap the stream norm `name` (from stream_norms) for a keyed one; returns it (factor uninitialised)."""
    old = stream_norms(model)[name]
    keyed = KeyedRMSNorm(model.config.hidden_size, block, _eps(old, model.config), device=device, dtype=dtype)
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, keyed)
    return keyed


def install(model: nn.Module, weights: dict[str, torch.Tensor]) -> int:
    """Keyed norms wherever `weights` (a whole or partial state dict) holds `<norm>.factor`; returns how many.

    Works on a meta skeleton (shards) and on an allocated model (load_whole_hf) alike.
    """
    count = 0
    for name, norm in stream_norms(model).items():
        factor = weights.get(f"{name}.{FACTOR}")
        if factor is None or isinstance(norm, KeyedRMSNorm):
            continue
        device = next(norm.parameters()).device
        replace_norm(model, name, factor.shape[-1], device=device, dtype=factor.dtype)
        count += 1
    return count
