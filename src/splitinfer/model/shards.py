"""Load a prepared shard back: the cloud half (middle layers only), the local half, or the whole model.

    OUT/local/  manifest.json  config.json  weights.safetensors  tokenizer files
                (embedding, layers [0, k), layers [N-m, N), final norm, LM head)
    OUT/cloud/  manifest.json  config.json  weights.safetensors
                (layers [k, N-m) only)

prepare.py writes these directories and manifest.py reads and checks their manifests. With split-point
randomisation each session runs the views `LocalHalf.head_for(k)` and `CloudHalf.stack_for(k)` of the
layers both shards hold. Loading the cloud shard never allocates the embedding, the LM head, the final
norm or a local layer.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoTokenizer, PretrainedConfig

from .. import kernels
from ..errors import ModelError
from ..kv import KVCache
from . import arena, formats, linears
from .fused import norm_module
from .keyed_norm import install as install_keyed_norms
from .manifest import DTYPES, WEIGHTS, read_manifest, sha256_file, split_of
from .layers import build_stack, kernel_table
from .stack import LayerStack, config_from_dict, materialize, skeleton

log = logging.getLogger(__name__)


def _load_checked(directory: Path, manifest: dict, verify: bool) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    if verify:
        for name, digest in manifest["files"].items():
            if sha256_file(directory / name) != digest:
                raise ModelError(f"{directory / name} does not match its manifest hash; the shard is damaged or altered.")
    config = config_from_dict(json.loads((directory / "config.json").read_text()))
    return config, load_file(str(directory / WEIGHTS))


class StackView(LayerStack):
    """Layers [first, last) of a built stack, sharing its modules (no copy of any weight).

    The modules keep the full stack's cache slot numbers (`layer_idx`), which other sessions use at the
    same time, so a view's cache has a slot for every layer of the full stack and fills only its own:
    a cloud session that starts deeper never allocates keys or values for the layers it skips.
    """

    def __init__(self, full: LayerStack, first: int, last: int):
        assert 0 <= first <= last <= len(full.layers), (first, last, len(full.layers))
        nn.Module.__init__(self)  # not LayerStack.__init__: it would renumber the shared modules
        self.config, self.rotary, self._cache_kw = full.config, full.rotary, full._cache_kw
        self.compute_dtype = full.compute_dtype
        self.grad_mode = full.grad_mode  # its sessions' caches are made in the full stack's mode; never compiled
        self.layers = nn.ModuleList(list(full.layers)[first:last])
        self.start, self.end = full.start + first, full.start + last
        self.windows = full.windows[first:last]
        self.rope_keys = full.rope_keys[first:last]
        self._slots = len(full.layers)
        self.refresh_devices()

    def new_cache(self) -> KVCache:
        return KVCache(self._slots)


def _head_range(manifest: dict) -> tuple[int, int]:
    return split_of(manifest).head_range


@dataclass
class CloudHalf:
    """What the untrusted server holds: the middle layers, nothing else."""

    manifest: dict
    config: PretrainedConfig
    stack: LayerStack

    @property
    def fingerprint(self) -> str:
        return self.manifest["cloud_fingerprint"]

    @property
    def head_range(self) -> tuple[int, int]:
        """[K1, K2]: the head depths a client may pin in its hello (K1 = K2 for a fixed split)."""
        return _head_range(self.manifest)

    def stack_for(self, head_layers: int) -> LayerStack:
        """The layers [k, N-m) a session with head depth k runs: the whole stack, or a view of its suffix."""
        low, high = self.head_range
        assert low <= head_layers <= high, (head_layers, low, high)
        if head_layers == low:
            return self.stack
        views = self.__dict__.setdefault("_views", {})
        if head_layers not in views:
            views[head_layers] = StackView(self.stack, head_layers - low, len(self.stack.layers))
        return views[head_layers]


@dataclass
class LocalHalf:
    """What stays on the trusted machine: embedding, head and tail layers, final norm, LM head, tokenizer."""

    manifest: dict
    config: PretrainedConfig
    embed: nn.Module
    head: LayerStack
    tail: LayerStack
    norm: nn.Module
    lm_head: nn.Module
    tokenizer: object | None

    @property
    def fingerprint(self) -> str:
        return self.manifest["cloud_fingerprint"]

    @property
    def head_range(self) -> tuple[int, int]:
        """[K1, K2]: the head depths this shard can run (K1 = K2 for a fixed split)."""
        return _head_range(self.manifest)

    def head_for(self, head_layers: int) -> LayerStack:
        """Layers [0, k) for a session with head depth k (`head` holds [0, K2))."""
        low, high = self.head_range
        assert low <= head_layers <= high, (head_layers, low, high)
        return self.head if head_layers == high else StackView(self.head, 0, head_layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, q, d] tail output -> [q, vocab] float32 logits."""
        with torch.inference_mode():
            logits = self.lm_head(self.norm(hidden))[0].float()
        # Gemma 2 style soft-capping, where the family's config asks for it (Gemma 3 leaves it unset).
        cap = getattr(self.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits


def _open(directory: Path, role: str, dtype: str | None, verify: bool):
    """Manifest, split, config, weights, compute dtype and the meta-device skeleton of one shard. Builds or
    loads the CPU kernels once the manifest is read (a missing shard fails first) and before any module is
    built (kernels.ensure: a log line says which), so no step ever builds them."""
    manifest = read_manifest(directory, role)
    kernels.ensure()
    config, weights = _load_checked(directory, manifest, verify)
    if dtype is not None and dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}.")
    model = skeleton(config)
    install_keyed_norms(model, weights)  # a shard under a linear key (privatize --basis --key linear)
    return manifest, split_of(manifest), config, weights, DTYPES[dtype or manifest["dtype"]], model


def warn_if_inexact(directory: Path, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: str) -> None:
    """bfloat16 products on a CPU are float kernels whose bits change with the rows beside them: speculation in
    bfloat16 is not token-identical to sequential decoding (notes/bench/bf16: 13 of 30 generations differed)."""
    bf16 = dtype == torch.bfloat16 or any(t.dtype == torch.bfloat16 for t in weights.values())
    if bf16 and torch.device(device).type == "cpu":
        log.warning("%s holds bfloat16 weights: on a CPU, speculative output may differ from sequential output "
                    "where two logits are within bfloat16 rounding; prepare int4, int8 or float32 for exact "
                    "speculation (docs/benchmarks.md#weight-formats).", directory)


def load_cloud(directory: str | Path, device: str = "cpu", dtype: str | None = None, verify: bool = True) -> CloudHalf:
    manifest, split, config, weights, torch_dtype, model = _open(Path(directory), "cloud", dtype, verify)
    warn_if_inexact(Path(directory), weights, torch_dtype, device)
    stack = build_stack(config, model, split.cloud_start, split.cloud_end, weights, device, torch_dtype)
    del weights, model  # what the stack does not hold is freed now, and handed back to the OS
    arena.return_freed()
    log.info("cloud shard %s on %s runs: %s", directory, device, describe(stack))
    return CloudHalf(manifest=manifest, config=config, stack=stack)


def load_local(directory: str | Path, device: str = "cpu", dtype: str | None = None, verify: bool = True) -> LocalHalf:
    directory = Path(directory)
    manifest, split, config, weights, torch_dtype, model = _open(directory, "local", dtype, verify)
    warn_if_inexact(directory, weights, torch_dtype, device)

    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}

    embed = materialize(model.model.embed_tokens, part("model.embed_tokens."), device, torch_dtype)
    norm = materialize(model.model.norm, part("model.norm."), device, torch_dtype)
    lm_head = _lm_head(config, model, weights, part("lm_head."), device, torch_dtype)
    # One call, not six small ones: an integer LM head's input takes the native norm's bits, as its layers' norms
    # do; a float head's keeps transformers' bits (F.rms_norm where it gives them).
    norm = norm_module(norm, own_bits=isinstance(lm_head, linears.QuantLinear)) or norm
    head = build_stack(config, model, 0, split.head_range[1], weights, device, torch_dtype)
    tail = build_stack(config, model, split.cloud_end, split.num_layers, weights, device, torch_dtype)
    tokenizer = None
    if manifest.get("has_tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    del weights, model  # what the half does not hold is freed now, and handed back to the OS
    arena.return_freed()
    log.info("local shard %s on %s runs: %s", directory, device, describe(head, tail, norm, lm_head))
    return LocalHalf(manifest, config, embed, head, tail, norm, lm_head, tokenizer)


def describe(*modules: nn.Module) -> str:
    """What loading chose to run (model/layers.py's kernel_table) as one line."""
    return ", ".join(f"{count} {name}" for name, count in kernel_table(*modules).items())


def _lm_head(config, model, weights: dict, stored: dict, device: str, dtype: torch.dtype) -> nn.Module:
    """The LM head: stored quantized (`prepare --weights lm_head=int8`), or tied to the embedding, or its own."""
    stored = formats.for_device(stored, device)
    fmt = formats.stored_format(stored, "")
    if fmt is not None:
        with torch.device("meta"):
            head = linears.quant_module(fmt, config.hidden_size, config.vocab_size, False, smooth="smooth" in stored)
        head = materialize(head, stored, device, dtype)
        arena.gather(arena.packed_weights(head))  # one stream in huge pages (model/arena.py)
        return head
    if getattr(config, "tie_word_embeddings", False) and not stored:
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        return materialize(head, {"weight": weights["model.embed_tokens.weight"]}, device, dtype)
    return materialize(model.lm_head, stored, device, dtype)


def load_whole_hf(shards: str | Path) -> nn.Module:
    """The whole HF model reassembled from OUT/local and OUT/cloud (reference runs, e.g. HF generate). Weights
    stored as int8/int4 come back as the float weights they stand for: plain transformers on the same values,
    not on the same kernels."""
    from transformers import AutoModelForCausalLM

    shards = Path(shards)
    local_manifest = read_manifest(shards / "local", "local")
    cloud_manifest = read_manifest(shards / "cloud", "cloud")
    if local_manifest["cloud_fingerprint"] != cloud_manifest["cloud_fingerprint"]:
        raise ModelError(f"{shards}/local and {shards}/cloud were not prepared together; re-run prepare.")
    config, weights = _load_checked(shards / "local", local_manifest, verify=False)
    weights.update(load_file(str(shards / "cloud" / WEIGHTS)))
    weights = formats.dequantized_state(weights)  # int8/int4 linears as the float weights they stand for
    if "lm_head.weight" in weights:
        config.tie_word_embeddings = False  # a head stored in its own format is its own tensor
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=DTYPES[local_manifest["dtype"]])
    install_keyed_norms(model, weights)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    missing = set(model.state_dict()) - set(weights) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise ModelError(f"the shards lack {sorted(missing)[:3]}; re-run prepare.")
    return model.eval()
