"""Build the pieces of a HF decoder-only model and run a contiguous range of its layers on a KVCache.

Pieces are built on the meta device from the config alone and then materialised only for the weights a
side actually holds, so the cloud never allocates an embedding, a final norm or an LM head. Layers are
the model family's own HF decoder layers; this module only supplies positions, masks (one per sliding
window size), rotary tables (one per layer type where the family keeps several) and the cache.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from ..errors import ModelError
from ..kv import KVCache
from ..masks import attention_mask
from . import formats, linears, native_layer
from .attention import install as install_attention
from .rows import use_row_kernels

# Families whose layers take (hidden, position_embeddings, attention_mask, cache) and whose model has
# embed_tokens / layers / norm / rotary_emb / lm_head. Gemma 3 (text) adds per-layer attention types with
# a rotary table per type, which `LayerStack` handles; its multimodal wrapper is not claimed.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def check_supported(config: PretrainedConfig) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"model type {config.model_type!r} is not supported; splitinfer supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}. Convert or choose a model of one of these families."
        )


def config_from_dict(data: dict) -> PretrainedConfig:
    data = dict(data)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ModelError("config.json has no model_type; the shard is damaged. Re-run `splitinfer prepare`.")
    config = AutoConfig.for_model(model_type, **data)
    check_supported(config)
    return config


def skeleton(config: PretrainedConfig) -> nn.Module:
    """The whole model on the meta device: structure only, no storage. Its layers attend through
    attention.py's `grouped_sdpa` (transformers' sdpa without the per-layer copy of grouped keys)."""
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    install_attention(model.config)
    return model


def materialize(module: nn.Module, weights: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> nn.Module:
    """`module` (meta) allocated on `device` with exactly `weights` loaded (strict: no missing, no extra), each
    linear constructed as the module that multiplies by its stored format on this machine: an integer one
    (linears.kernel_class), a CastLinear for a bfloat16 weight in a float32 model, else a RowsLinear. Returns
    the module, or its replacement where it is itself such a linear."""
    weights = formats.for_device(weights, device)  # off the CPU, int8/int4 as the float weights they stand for
    module = linears.construct_quantized(module, weights)
    module = module.to_empty(device=device).to(dtype)
    expected = set(module.state_dict())
    if set(weights) != expected:
        missing = sorted(expected - set(weights))[:5]
        extra = sorted(set(weights) - expected)[:5]
        raise ModelError(f"shard weights do not match the model structure (missing {missing}, unexpected {extra}).")
    kept = _kept_dtypes(module, weights, dtype)
    state = {k: v.to(device) if k in kept else v.to(device=device, dtype=dtype) for k, v in weights.items()}
    module.load_state_dict(state, strict=True, assign=True)  # assign: kept tensors keep their dtype
    cast = {key.rpartition(".")[0] for key in kept if type(_owner(module, key)) is nn.Linear}
    module = replace_named(module, cast, linears.CastLinear.of)
    _restore_buffers(module)
    linears.finish(module, device)
    return use_row_kernels(module.eval().requires_grad_(False))


def _owner(module: nn.Module, key: str) -> nn.Module:
    name = key.rpartition(".")[0]
    return module.get_submodule(name) if name else module


def replace_named(module: nn.Module, names: set[str], make) -> nn.Module:
    """`module` with its submodules named in `names` replaced by `make(submodule)` ('' names `module` itself:
    its replacement is returned)."""
    if "" in names:
        return make(module)
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, make(module.get_submodule(name)))
    return module


def _kept_dtypes(module: nn.Module, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.dtype]:
    """{state key: stored dtype} for the tensors not cast to the compute dtype: a quantized linear's state,
    and the bfloat16 weight of a linear in a model that computes in float32 (`prepare --weights bfloat16`)."""
    kept = {}
    for key, value in weights.items():
        owner_name = key.rpartition(".")[0]
        owner = module.get_submodule(owner_name) if owner_name else module
        if isinstance(owner, linears.QuantLinear):
            kept[key] = value.dtype
        elif (type(owner) is nn.Linear and key.endswith("weight") and value.dtype == torch.bfloat16
              and dtype == torch.float32):
            kept[key] = value.dtype
    return kept


def _restore_buffers(module: nn.Module) -> None:
    """Refill the buffers that are not in a state dict, which `to_empty` leaves uninitialised."""
    persistent = set(module.state_dict())
    for name, buffer in module.named_buffers():
        if name in persistent:
            continue
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        # Gemma's embedding multiplies by sqrt(hidden_size), kept as a non-persistent buffer.
        if name.rpartition(".")[2] == "embed_scale" and hasattr(owner, "scalar_embed_scale"):
            buffer.fill_(owner.scalar_embed_scale)
        else:
            raise ModelError(f"{type(owner).__name__} keeps a buffer ({name}) that splitinfer cannot rebuild; "
                             "this model family is not supported.")


def layer_window(config: PretrainedConfig, index: int) -> int | None:
    """Sliding-window size of layer `index` (original numbering), None for full attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and config.model_type != "mistral":
        return window if layer_types[index] == "sliding_attention" else None
    if config.model_type == "mistral":
        return window
    return None


def cache_keyword(module: nn.Module) -> str:
    """The name of `module.forward`'s cache argument (a decoder layer's, or a whole HF model's)."""
    # transformers names it `cache` from 5.24 and `past_key_values` in 5.0-5.23. A wrong name lands in
    # **kwargs, and the layer silently attends without the cache. A layer built around transformers' (a
    # NativeLayer) takes what that one takes.
    module = getattr(module, "transformers", module)
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def layer_rope_key(config: PretrainedConfig, rotary: nn.Module, index: int) -> str | None:
    """Which rotary table layer `index` uses: its layer type where the rotary module keeps one table per
    type (Gemma 3: a local base for sliding layers, a global one for full attention), else None."""
    if getattr(rotary, "layer_types", None) is None:
        return None
    return config.layer_types[index]


def rotary_tables(rotary: nn.Module, keys: set, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict:
    """{rope key: (cos, sin)} for the keys of `layer_rope_key`; position_ids: [B, Q]."""
    if keys == {None}:
        return {None: rotary(hidden, position_ids)}
    return {key: rotary(hidden, position_ids, key) for key in keys}


class LayerStack(nn.Module):
    """Decoder layers [start, end) of one model, renumbered 0..n-1 for their own KVCache."""

    def __init__(self, config: PretrainedConfig, layers: list[nn.Module], start: int, rotary: nn.Module):
        super().__init__()
        self.config = config
        self.start = start
        self.end = start + len(layers)
        self.layers = nn.ModuleList(layers)
        self.rotary = rotary
        # The attention module indexes the cache by layer_idx; renumbering lets a cache hold just this
        # stack (a DynamicCache filled lazily by absolute layer index misreports its length otherwise).
        for local_index, layer in enumerate(self.layers):
            layer.self_attn.layer_idx = local_index
        self.windows = [layer_window(config, start + i) for i in range(len(layers))]
        self.rope_keys = [layer_rope_key(config, rotary, start + i) for i in range(len(layers))]
        self._cache_kw = cache_keyword(self.layers[0]) if len(self.layers) else "cache"
        self.compute_dtype = compute_dtype(self.layers)
        self.refresh_devices()

    def refresh_devices(self) -> None:
        """Re-read where each layer lives (after a multi-GPU placement moved them)."""
        self.devices = [next(layer.parameters()).device for layer in self.layers]
        # Every layer one native call (model/native_layer.py), on one device: a pass may skip the modules.
        self._native = (len(set(self.devices)) == 1
                        and all(isinstance(layer, native_layer.NativeLayer) for layer in self.layers))
        # A lone block on a KVCache: every layer in one call (model/native_layer.py's StackCall).
        self._stack_call = (native_layer.StackCall(list(self.layers), self.windows, self.rotary, self.config)
                            if self._native and native_layer.StackCall.fits(self.rotary) else None)

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers))

    def kv_heads_and_dim(self) -> tuple[int, int]:
        config = self.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim

    def kv_bytes_per_token(self) -> int:
        """Key + value bytes one token occupies over all layers of this stack (the KV budget's unit)."""
        kv_heads, head_dim = self.kv_heads_and_dim()
        item = self.compute_dtype.itemsize if len(self.layers) else 0
        return len(self.layers) * 2 * kv_heads * head_dim * item

    # The autograd mode every pass runs under: inference mode, or no_grad once `compile_passes` is on
    # (inductor's freezing cannot take inference tensors, and a cache's buffers are made in this mode).
    grad_mode = staticmethod(torch.inference_mode)
    compile_rows = 0  # blocks of at least this many rows take the compiled pass (0: none does)
    _compiled = None
    graphs = None  # model/graphs.py's StepGraphs once `use_graphs` is on (a view of the stack never has them)

    def use_graphs(self, capture: bool = True) -> None:
        """Run lone blocks of up to 64 rows as CUDA graphs by bucket of rows (model/graphs.py); capture=False:
        the same static-shape pass without a graph (any device; what the CPU tests check)."""
        from .graphs import StepGraphs

        if self._compiled is not None:
            raise ModelError("a stack runs either compiled passes or CUDA graphs; leave out --compile-rows.")
        self.graphs = StepGraphs(self, capture)

    def compile_passes(self, min_rows: int) -> None:
        """Run blocks of `min_rows` rows or more through `torch.compile` (inductor, dynamic shapes, weights
        frozen and prepacked: the CPU recipe); smaller blocks, batches of several sessions and views of the
        stack stay eager. Two graphs: a block on an empty cache, and every other block. CPU only: the compiled pass is measured on this project's CPU (notes/bench/compile),
        never on a GPU. The first compiled block compiles (minutes on a small CPU): call `warm_up` first."""
        if min_rows < 1:
            raise ModelError(f"compile_passes needs a row count of at least 1, not {min_rows}.")
        if any(device.type != "cpu" for device in self.devices):
            raise ModelError("compiled passes are measured on the CPU only; leave out --compile-rows on a GPU.")
        self.grad_mode = torch.no_grad
        self.compile_rows = min_rows
        kv_heads, head_dim = self.kv_heads_and_dim()
        dtype = self.compute_dtype
        self._empty_keys = torch.empty((1, kv_heads, 0, head_dim), dtype=dtype)
        self._compiled = torch.compile(self._pass, dynamic=True, options={"freezing": True})

    def warm_up(self, rows: int) -> None:
        """Two blocks of `rows` rows on a scratch cache, the first on the empty cache (as many keys as rows),
        the second after it: a compiled stack compiles its two graphs here, ahead of its users."""
        param = next(self.parameters())
        hidden = torch.zeros((1, rows, self.config.hidden_size), dtype=param.dtype, device=param.device)
        allowed = np.tril(np.ones((rows, rows), dtype=bool))
        cache = self.new_cache()
        for start in (0, rows):
            self(hidden, torch.arange(start, start + rows), allowed, cache)
            cache.commit_all()

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, allowed: np.ndarray, cache: KVCache) -> torch.Tensor:
        """hidden: [1, q, d]; positions: [q] long; allowed: [q, q] bool. Leaves the block pending in `cache`."""
        q = hidden.shape[1]
        assert hidden.dim() == 3 and hidden.shape[0] == 1, hidden.shape
        assert positions.shape == (q,), (positions.shape, q)
        if not len(self.layers):
            return hidden
        if self.graphs is not None and self.graphs.fits(hidden, cache):
            with self.grad_mode():
                out = self.graphs.run(hidden, positions, allowed, cache)
            if out is not None:
                return out
        if (self._stack_call is not None and type(cache) is KVCache and not cache.held_rows
                and not self._takes_compiled(hidden, cache) and self.layers[0].runs_native(hidden, cache)):
            with self.grad_mode():
                return self._stack_call(hidden, positions, allowed, cache)
        masks = {
            w: attention_mask(cache.length, positions, allowed, hidden.dtype, window=w) for w in set(self.windows)
        }
        return self.run_layers(hidden, positions[None, :], masks, cache)

    def run_layers(self, hidden: torch.Tensor, position_ids: torch.Tensor, masks: dict, cache) -> torch.Tensor:
        """hidden: [B, Q, d]; position_ids: [B, Q]; masks: {window: [B, 1, Q, K]} -> [B, Q, d].

        Inputs live on the first layer's device; the output is on the last one's. Layers placed on several
        devices get the activations, masks and rotary tables moved to them once per device, not per layer.
        """
        with self.grad_mode():
            if not self._takes_compiled(hidden, cache):
                return self._pass(hidden, position_ids, masks, cache)
            # Buffers grown here, outside the compiled pass: inside, a growth is another graph to compile. One
            # spare row: a block ending exactly at the buffer's end reads all of it, a contiguous slice, which
            # the warm-up's graphs are guarded against (capacity != length + held + rows) and so compiles again.
            cache.reserve(cache.length + cache.held_rows + hidden.shape[1] + self.spare_rows, self._empty_keys)
            return self._compiled(*dynamic_rows(hidden, position_ids, masks), cache)

    @property
    def spare_rows(self) -> int:
        """Rows a compiled pass (run_layers) or a graph (model/graphs.py) keeps free past a block's end; a KV
        budget counts them too."""
        return 1 if self._compiled is not None or self.graphs is not None else 0

    def _takes_compiled(self, hidden: torch.Tensor, cache) -> bool:
        return (self._compiled is not None and type(cache) is KVCache and hidden.shape[0] == 1
                and hidden.shape[1] >= self.compile_rows)

    def _pass(self, hidden: torch.Tensor, position_ids: torch.Tensor, masks: dict, cache) -> torch.Tensor:
        tables = rotary_tables(self.rotary, set(self.rope_keys), hidden, position_ids)
        if self._native and self.layers[0].runs_native(hidden, cache):
            return native_layer.run(self.layers, hidden, masks, tables, self.windows, self.rope_keys, cache)
        on_device: dict[torch.device, tuple] = {}
        for layer, window, rope_key, device in zip(self.layers, self.windows, self.rope_keys, self.devices):
            if device not in on_device:
                on_device[device] = (
                    position_ids.to(device),
                    {key: tuple(t.to(device) for t in cos_sin) for key, cos_sin in tables.items()},
                    {w: m.to(device) for w, m in masks.items()},
                )
            device_positions, device_tables, device_masks = on_device[device]
            out = layer(
                hidden.to(device),
                attention_mask=device_masks[window],
                position_ids=device_positions,
                position_embeddings=device_tables[rope_key],
                **{self._cache_kw: cache},
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden


def compute_dtype(layers) -> torch.dtype:
    """The dtype activations and the KV cache are in: the norms' (a linear's weight may be stored in
    another format, model/formats.py)."""
    for layer in layers:
        for name, param in layer.named_parameters():
            if "norm" in name:
                return param.dtype
    return next((p.dtype for layer in layers for p in layer.parameters()), torch.float32)


def dynamic_rows(hidden: torch.Tensor, position_ids: torch.Tensor, masks: dict) -> tuple:
    """A compiled pass's inputs with their row and key counts marked dynamic (one graph for every size, not
    one per size seen first), as ordinary tensors (an inference tensor's other dispatch keys would be a
    second graph)."""
    hidden = hidden.clone() if hidden.is_inference() else hidden
    torch._dynamo.maybe_mark_dynamic(hidden, 1)
    torch._dynamo.maybe_mark_dynamic(position_ids, 1)
    for mask in masks.values():
        torch._dynamo.maybe_mark_dynamic(mask, 2)
        torch._dynamo.maybe_mark_dynamic(mask, 3)
    return hidden, position_ids, masks
