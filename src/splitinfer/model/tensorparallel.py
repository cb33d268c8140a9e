"""Tensor parallelism inside the middle layers: every rank keeps a 1/N slice of each decoder layer.

Which projections are split by output rows (`colwise`) and which by input columns (`rowwise`) is the model
family's own plan, `config.base_model_tp_plan`, the plan transformers applies for `tp_plan="auto"`. For the
supported families it splits q/k/v and gate/up by output (so attention heads and MLP neurons are divided
among the ranks) and o/down by input; a rowwise projection yields a partial sum that one all-reduce per
projection completes (two per layer). Entries that only matter for training (`replicated_with_grad_allreduce`,
the q/k norms of Qwen3 and Gemma 3) keep the module whole.

The slices are cut in place from the weights each rank loaded, and the modules stay plain `nn.Linear`s
with a forward hook for the all-reduce, not DTensors: that keeps the HF decoder layers unchanged and costs
no per-op dispatch. HF attention reshapes by `-1` heads, so a layer runs on its rank's heads as is, and the
KV cache it fills holds those heads only (kv_heads / N per rank).

This module knows nothing about sessions or servers (cloud/tensorparallel.py drives the ranks).
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from ..errors import ConfigError, ModelError
from .stack import LayerStack

# What each plan entry means here; a style not listed is refused instead of silently running unsplit.
SPLIT_STYLES = ("colwise", "rowwise")
WHOLE_STYLES = ("replicated_with_grad_allreduce",)


def check_divisible(config, world: int) -> None:
    """ConfigError unless `world` ranks can share the heads, KV heads and MLP neurons evenly."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    sizes = {"attention heads": heads, "KV heads": kv_heads, "MLP neurons": config.intermediate_size}
    uneven = [f"{n} {name}" for name, n in sizes.items() if n % world]
    if world < 1 or uneven:
        fits = [n for n in range(1, kv_heads + 1) if all(size % n == 0 for size in sizes.values())]
        raise ConfigError(
            f"--tp {world} does not divide this model's {', '.join(uneven) or 'ranks'}; "
            f"choose --tp among {', '.join(map(str, fits))}."
        )


def tp_plan(config) -> dict[str, str]:
    """The family's plan for decoder layers, keyed by the module path inside one layer ('self_attn.q_proj')."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    layers: dict[str, str] = {}
    for pattern, style in plan.items():
        if not fnmatch.fnmatch(pattern, "layers.*.*"):
            continue  # embedding, norm: not in the middle
        if style not in SPLIT_STYLES + WHOLE_STYLES:
            raise ModelError(f"the {config.model_type} tensor-parallel plan asks for {style!r} on {pattern}, "
                             "which splitinfer does not apply; serve this model without --tp.")
        layers[pattern.split(".", 2)[2]] = style
    if not any(style in SPLIT_STYLES for style in layers.values()):
        raise ModelError(f"the {config.model_type} config declares no tensor-parallel plan; serve it without --tp.")
    return layers


def _all_reduce_output(group):
    import torch.distributed as dist

    def hook(_module, _inputs, output):
        dist.all_reduce(output, group=group)  # partial sums of this rank's input slice -> the full product
        return output

    return hook


@torch.inference_mode()
def shard_linear(linear: nn.Linear, style: str, rank: int, world: int) -> None:
    """Keep this rank's slice of `linear`: output rows for colwise, input columns for rowwise."""
    if style == "colwise":
        rows = linear.out_features // world
        keep = slice(rank * rows, (rank + 1) * rows)
        linear.weight = nn.Parameter(linear.weight[keep].clone(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[keep].clone(), requires_grad=False)
        linear.out_features = rows
    else:
        cols = linear.in_features // world
        linear.weight = nn.Parameter(linear.weight[:, rank * cols : (rank + 1) * cols].clone(), requires_grad=False)
        if linear.bias is not None and rank != 0:  # the all-reduce adds every rank's bias: keep one
            linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
        linear.in_features = cols


def shard_stack(stack: LayerStack, rank: int, world: int, group=None) -> LayerStack:
    """Cut every layer of `stack` down to rank `rank`'s slice of `world` (in place; views share the layers).

    The all-reduces run on `group` (the default process group when None), so every rank must call the
    stack's passes in the same order with the same shapes: cloud/tensorparallel.py sees to that.
    """
    if world == 1:
        return stack
    check_divisible(stack.config, world)
    plan = tp_plan(stack.config)
    for layer in stack.layers:
        for path, style in plan.items():
            if style not in SPLIT_STYLES:
                continue
            module = layer.get_submodule(path)
            if not isinstance(module, nn.Linear):
                raise ModelError(f"{path} is a {type(module).__name__}, not a linear layer; serve without --tp.")
            shard_linear(module, style, rank, world)
            if style == "rowwise":
                module.register_forward_hook(_all_reduce_output(group))
    return stack
