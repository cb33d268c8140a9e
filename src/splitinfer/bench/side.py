"""One side of the split as a step runs it, both ways: the benchmarks' unit of timing.

A `Side` holds one side's layers (the cloud's middle layers; or the local head and tail layers with the
final norm and the LM head) on a cache filled with `context` rows of real activations, and runs one block
of q rows through them as splitinfer does (`ours`) and, optionally, as plain transformers does (`anchor`, a
transformers model of those layers sharing their weights). `build_sides` loads them from a shards directory
on the benchmark prompts' activations; `stored_bytes` is what a step streams for weights.

`bench step` (step.py) times and reports them, `bench formats` (formats.py) times `ours` in every weight
format, `bench compile` and `bench arena` time them another way; this module times nothing and writes nothing.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import kernels
from ..errors import ConfigError
from ..model.linears import Int8Linear, QuantLinear, W8A8Linear
from ..model.shards import LocalHalf, load_cloud, load_local
from ..model.stack import LayerStack
from .baseline import plain_model, with_ends


def stored_bytes(modules) -> int:
    """Bytes a step streams for these modules' weights: parameters and persistent buffers, as stored (an int8
    weight held only as its kernel's tiles counted as its stored [N, K] bytes)."""
    seen, total = set(), 0
    for module in modules:
        for t in list(module.parameters()) + [b for _, b in module.named_buffers()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        for m in module.modules():
            if isinstance(m, Int8Linear) and m.qweight is None and id(m) not in seen:
                seen.add(id(m))
                total += m.out_features * m.in_features
    return total


def hf_layers(config, stacks: list[LayerStack], with_head: nn.Module | None, with_norm: nn.Module | None) -> nn.Module:
    """A plain transformers causal LM over the layers of `stacks` (renumbered 0..n-1), sharing their weights:
    bench/baseline.py's model built on the meta device, given these layers as plain modules."""
    layers = [layer for stack in stacks for layer in stack.layers]
    model = plain_model(config, [s.start + i for s in stacks for i in range(len(s.layers))], meta=True)
    model.model.layers = nn.ModuleList([_plain(layer, i, model.config) for i, layer in enumerate(layers)])
    model.model.rotary_emb = stacks[0].rotary
    # An integer-format head (model/formats.py) has no float weight to hand to F.linear: it stays as it is.
    plain = plain_linear(with_head) if isinstance(with_head, nn.Linear) else with_head
    return with_ends(model, None, with_norm, plain).eval()


def plain_linear(linear: nn.Linear) -> nn.Linear:
    """The same weights as a plain nn.Linear (F.linear: what transformers runs), no packed copy."""
    plain = nn.Linear.__new__(nn.Linear)
    plain.__dict__ = {k: v for k, v in linear.__dict__.items() if k not in ("_packed", "_packed_of")}
    return plain


def _plain(layer: nn.Module, index: int, config) -> nn.Module:
    """A shallow copy of a decoder layer with transformers' own products (nn.Linear), attention (its config,
    sdpa) and its own index."""
    layer = copy.copy(layer)
    layer._modules = dict(layer._modules)
    for name, child in list(layer._modules.items()):
        if isinstance(child, nn.Linear):
            layer._modules[name] = plain_linear(child)
        elif len(child._modules):
            layer._modules[name] = _plain(child, index, config)
    if hasattr(layer, "config"):
        layer.config = config
    if hasattr(layer, "self_attn"):
        layer.self_attn.layer_idx = index
    if hasattr(layer, "layer_idx"):
        layer.layer_idx = index
    return layer


class Side:
    """One side's step both ways at one context: `ours(q)` and `anchor(q)` each run one block of q rows.

    with_anchor=False builds no transformers model (bench formats times `ours` alone, in every weight format)."""

    def __init__(self, name: str, stacks: list[LayerStack], tail: tuple[nn.Module, nn.Module] | None, context: int,
                 inputs: torch.Tensor, with_anchor: bool = True):
        from transformers import DynamicCache

        self.name, self.stacks, self.tail, self.context = name, stacks, tail, context
        self.inputs = inputs  # [1, n, d]: the side's real input rows, context first, then the blocks
        self.d, self.dtype = inputs.shape[-1], inputs.dtype
        if with_anchor:
            self.hf = hf_layers(stacks[0].config, stacks, *(tail or (None, None))[::-1])
            self.hf_cache = DynamicCache(config=self.hf.config)
        self.caches = [s.new_cache() for s in stacks]
        with torch.inference_mode():
            prompt = inputs[:, :context]
            if with_anchor:
                self.hf(inputs_embeds=prompt, cache=self.hf_cache, use_cache=True, logits_to_keep=1)
            allowed = np.tril(np.ones((context, context), dtype=bool))
            for stack, cache in zip(stacks, self.caches):  # chained, as the anchor's layers are
                prompt = stack(prompt, torch.arange(context), allowed, cache)
                cache.commit_all()

    def block(self, q: int) -> torch.Tensor:
        """The q input rows after the context: [1, q, d]."""
        return self.inputs[:, self.context : self.context + q]

    @torch.inference_mode()
    def ours(self, q: int, hidden: torch.Tensor) -> torch.Tensor:
        """The side's output for the block: hidden states (cloud) or logits (local) [1, q, *]."""
        positions = torch.arange(self.context, self.context + q)
        allowed = np.tril(np.ones((q, q), dtype=bool))
        for stack, cache in zip(self.stacks, self.caches):
            hidden = stack(hidden, positions, allowed, cache)
            cache.truncate(cache.length)
        if self.tail is not None:
            norm, lm_head = self.tail
            hidden = lm_head(norm(hidden))
        return hidden

    def timed(self, q: int) -> float:
        """ms of one `ours` step of q rows (its input rows taken before the clock starts)."""
        hidden = self.block(q)
        t0 = time.perf_counter()
        self.ours(q, hidden)
        return (time.perf_counter() - t0) * 1e3

    @torch.inference_mode()
    def anchor(self, q: int, hidden: torch.Tensor) -> torch.Tensor:
        for layer in getattr(self.hf_cache, "layers", ()):
            # Sliding-window layers (Gemma 3) only allow a rollback when told before the block.
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        out = self.hf(inputs_embeds=hidden, cache=self.hf_cache, use_cache=True, logits_to_keep=0).logits
        self.hf_cache.crop(-q)
        return out

    def product_flops(self, q: int, kinds: tuple[type, ...] = (nn.Linear, QuantLinear)) -> int:
        """Multiply-adds x 2 of the weight products (of these module kinds) of a q-row step (attention's are
        not counted)."""
        modules = list(self.stacks) + list(self.tail or ())
        return 2 * q * sum(m.in_features * m.out_features for top in modules for m in top.modules()
                           if isinstance(m, kinds))

    def compute_bound_ms(self, q: int, float_peak: float, int8_peak: float | None, amx_peak: float | None = None) -> float:
        """The products' time at the peaks of the instructions they run on: int8 products at the AMX peak where
        that path runs (`amx_peak`, whole tiles of 64 inputs), other integer products at the VNNI peak where the
        kernels run (`int8_peak`), the rest (and all where the kernels do not) at the float peak."""
        if int8_peak is None:
            return self.product_flops(q) / float_peak / 1e6
        modules = [m for top in list(self.stacks) + list(self.tail or ()) for m in top.modules()]
        depth = kernels.build.layout()["w8a8_depth"] if amx_peak else 0
        on_amx = sum(2 * q * m.in_features * m.out_features for m in modules
                     if amx_peak and isinstance(m, W8A8Linear) and m.in_features % depth == 0)
        integer = self.product_flops(q, (QuantLinear,)) - on_amx
        return (self.product_flops(q, (nn.Linear,)) / float_peak + integer / int8_peak
                + (on_amx / amx_peak if on_amx else 0.0)) / 1e6

    def streamed_bytes(self, cached: bool = True) -> int:
        """Weights read once as stored (an integer format's state and scales too) plus (`cached`) the cached keys
        and values attended to, per step."""
        return stored_bytes(list(self.stacks) + list(self.tail or ())) + sum(
            s.kv_bytes_per_token() for s in self.stacks) * self.context * cached


def build_sides(shards: Path, contexts: tuple[int, ...], rows: tuple[int, ...], dtype: str | None = None,
                sides: tuple[str, ...] = ("cloud", "local")) -> list[Side]:
    """Only the shards of `sides` are loaded (a 7B cloud half need not fit beside the local one). The cloud
    side's inputs are the local head's output where the local shard is there, else seeded random rows."""
    n = max(contexts) + max(rows)
    missing = [side for side in sides if not (shards / side).is_dir()]
    if missing:
        raise ConfigError(f"{shards} holds no {' or '.join(missing)} shard; prepare it, or leave it out of --sides.")
    local = load_local(shards / "local", dtype=dtype, verify=False) if (shards / "local").is_dir() else None
    cloud = load_cloud(shards / "cloud", dtype=dtype, verify=False) if "cloud" in sides else None
    if local is not None:
        embedded, activations = real_inputs(local, n, head="cloud" in sides)
    else:
        d, param = cloud.config.hidden_size, next(cloud.stack.parameters())
        activations = torch.randn(1, n, d, generator=torch.Generator().manual_seed(0)).to(param.dtype)
    built = []
    for context in contexts:
        if "cloud" in sides:
            built.append(Side("cloud", [cloud.stack], None, context, activations))
        if "local" in sides:
            built.append(Side("local", [local.head, local.tail], (local.norm, local.lm_head), context, embedded))
    return built


@torch.inference_mode()
def real_inputs(local: LocalHalf, n: int, head: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token embeddings [1, n, d] of the benchmark prompts' text, and the local head's output for them (what
    the cloud receives): real activations, as a step sees them. Without a tokenizer (test models), seeded
    random ids. head=False: the embeddings only (no cloud side to feed)."""
    from .runtime import load_prompts

    if local.tokenizer is not None:
        text = "\n".join(p["prompt"] for p in load_prompts(None, 3))
        ids = list(local.tokenizer(text)["input_ids"])
        ids = (ids * (n // len(ids) + 1))[:n]
    else:
        ids = torch.randint(0, local.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    embedded = local.embed(torch.tensor([ids]))
    if not head:
        return embedded, None
    stack = local.head
    return embedded, stack(embedded, torch.arange(n), np.tril(np.ones((n, n), dtype=bool)), stack.new_cache())
