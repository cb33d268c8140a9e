"""The plain-transformers baseline model: one builder for both benchmarks that run the model without
splitinfer's model code.

`plain_model` is a transformers causal LM built by transformers from a model's config, holding only some of
its decoder layers (renumbered 0..n-1), attention "sdpa". bench/plaincloud.py (`bench plain-split`) loads a
shard's weights into it; bench/step.py (`bench step`'s anchor) builds it on the meta device and hands it the
splitinfer side's own layers as plain modules. `with_ends` gives it the token embedding, final norm and LM
head a side holds, an identity for each it does not. It knows nothing of shards, sessions or timing.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def layers_config(config, layers: list[int]):
    """A copy of a model config for a plain transformers model holding only the decoder layers `layers` (HF
    indices, renumbered from 0)."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = len(layers)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [config.layer_types[i] for i in layers]
    return cfg


def plain_model(config, layers: list[int], dtype: torch.dtype | None = None, vocabulary: bool = True,
                meta: bool = False) -> nn.Module:
    """A plain transformers causal LM of `config` with decoder layers `layers` only (see the module docstring).
    vocabulary=False: a one-row embedding (a middle holds no vocabulary: no 49k-row table is built); meta:
    nothing allocated, for a caller that puts its own modules in."""
    from transformers import AutoModelForCausalLM

    cfg = layers_config(config, layers)
    if not vocabulary:
        cfg.vocab_size, cfg.pad_token_id = 1, None
    kwargs = {} if dtype is None else {"dtype": dtype}
    with torch.device("meta" if meta else "cpu"):
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", **kwargs)


def with_ends(model: nn.Module, embed: nn.Module | None, norm: nn.Module | None,
              lm_head: nn.Module | None) -> nn.Module:
    """`model` with this token embedding, final norm and LM head; None: an identity (a side without it)."""
    model.model.embed_tokens = embed if embed is not None else nn.Identity()
    model.model.norm = norm if norm is not None else nn.Identity()
    model.lm_head = lm_head if lm_head is not None else nn.Identity()
    return model
