"""Partition a model into a local shard and a cloud shard and write them with their manifests.

    OUT/local/  (embedding, layers [0, k), layers [N-m, N), final norm, LM head, tokenizer files)
    OUT/cloud/  (layers [k, N-m) only)

With split-point randomisation (`prepare --split-range K1-K2`) each session picks its head depth k in
[K1, K2]: the local shard holds layers [0, K2) and the cloud shard layers [K1, N-m), so layers [K1, K2)
are in both. The cloud shard never contains the embedding, the LM head, the final norm or a local layer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig

from .. import __version__
from ..errors import ModelError
from .manifest import DTYPES, FORMAT, FORMAT_VERSION, WEIGHTS, Split, fingerprint, sha256_file
from .calibrate import activation_maxima, calibration_ids
from .formats import PARTS, WeightFormats, int4_state, quantize, stored_format
from .fused import group_column_maxima
from .source import SourceModel
from ..wire.frame import default_wire_dtype

log = logging.getLogger("splitinfer.model")


def _clean_config(config: PretrainedConfig) -> dict:
    data = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        data.pop(key, None)
    return data


def _owners(key: str, split: Split) -> tuple[str, ...]:
    """The shards that hold one state-dict key: layers [K1, K2) of a randomised split are in both."""
    if key.startswith("model.layers."):
        index = int(key.split(".")[2])
        owners = ("cloud",) if split.cloud_start <= index < split.cloud_end else ()
        if index < split.head_range[1] or index >= split.cloud_end:
            owners += ("local",)
        return owners
    return ("local",)


def _parts(source: SourceModel, split: Split, dtype: str, formats: dict[str, str]) -> dict[str, dict[str, torch.Tensor]]:
    """{"local": state, "cloud": state}: each shard's tensors, linears in their part's format."""
    state = source.model.state_dict()
    tied = bool(getattr(source.config, "tie_word_embeddings", False))
    blocks = getattr(source, "blocks", None) or {}
    maxima, columns = int8_calibration(source.model, source.tokenizer, state) if "int8" in formats.values() else ({}, {})
    parts: dict[str, dict[str, torch.Tensor]] = {"local": {}, "cloud": {}}
    for key, tensor in state.items():
        if key == "lm_head.weight":
            continue  # below: its own format, or tied to the embedding
        for owner in _owners(key, split):
            fmt = formats[owner]
            if not _is_layer_linear(source.model, key) or fmt == dtype:
                # clone: tied or shared storage would make safetensors refuse to save
                parts[owner][key] = tensor.detach().to(DTYPES[dtype]).contiguous().clone()
            else:
                parts[owner].update(stored_linear(key, tensor, fmt, blocks.get(key), maxima.get(key), columns.get(key)))
    head = state["model.embed_tokens.weight"] if tied else state["lm_head.weight"]
    if formats["lm_head"] != dtype or not tied:
        parts["local"].update(stored_linear("lm_head.weight", head, formats["lm_head"], blocks.get("lm_head.weight"),
                                            maxima.get("lm_head.weight")))
    return parts


def int8_calibration(model: torch.nn.Module, tokenizer, state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """int8's calibration of `model` (its float `state`): (activation maxima per linear weight key, the column
    maxima each fusion group shares: q/k/v and gate/up get one smoothing, model/fused.py)."""
    maxima = activation_maxima(model, calibration_ids(tokenizer, model.config.vocab_size))
    return maxima, group_column_maxima(state)


def _is_layer_linear(model: torch.nn.Module, key: str) -> bool:
    if not (key.startswith("model.layers.") and key.endswith(".weight")):
        return False
    return isinstance(model.get_submodule(key[: -len(".weight")]), torch.nn.Linear)


def stored_linear(key: str, weight: torch.Tensor, fmt: str, block: tuple | None = None,
                  act_max: torch.Tensor | None = None, column_max: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The shard entries of one linear weight ('...q_proj.weight') in `fmt`. `block`: the GGUF's own 4-bit
    blocks of this weight (q, d, m), kept as they are when `fmt` is int4 instead of quantizing again;
    `act_max`, `column_max`: int8's calibration (model/calibrate.py, model/fused.py)."""
    prefix = key[: -len("weight")]
    if fmt == "int4" and block is not None:
        state = int4_state(*block)
    else:
        state = quantize(weight, fmt, act_max, column_max)
    return {prefix + name: value for name, value in state.items()}


def restored_layers(model: torch.nn.Module, stored: dict[str, torch.Tensor], tokenizer=None) -> dict[str, torch.Tensor]:
    """`model`'s decoder-layer tensors for every 'model.layers.' key of a shard's `stored` state, in the
    formats `stored` holds them: float tensors cast to their stored dtype, int8/int4 linears quantized again
    from `model`'s float weights (int8 calibrated on `model`, as `prepare` calibrates). What a shard writer
    uses when new weights (privatized ones) replace a prepared shard's layers."""
    state = model.state_dict()
    keys = [k for k in stored if k.startswith("model.layers.")]
    linears = sorted({k[: -len("qweight")] for k in keys if k.endswith("qweight")})
    int8 = any(stored_format(stored, prefix) == "int8" for prefix in linears)
    maxima, columns = int8_calibration(model, tokenizer, state) if int8 else ({}, {})
    out = {k: state[k].detach().to(stored[k].dtype).contiguous().clone()
           for k in keys if k.rpartition(".")[0] + "." not in linears}
    for prefix in linears:
        key = prefix + "weight"
        out.update(stored_linear(key, state[key], stored_format(stored, prefix), None, maxima.get(key), columns.get(key)))
    if set(out) != set(keys):
        raise ModelError(f"the shard's layers hold {sorted(set(keys) - set(out))[:3]}..., which new weights cannot "
                         "restore; prepare the shard again.")
    return out


def prepare(
    source: SourceModel,
    out: str | Path,
    head_layers: int = 2,
    tail_layers: int = 2,
    dtype: str = "float32",
    split_range: tuple[int, int] | None = None,
    weights: WeightFormats | None = None,
    reason: str | None = None,
) -> Path:
    """Write OUT/local and OUT/cloud. Returns OUT.

    split_range (K1, K2) replaces head_layers: sessions pick their head depth in [K1, K2] (see module doc).
    weights: each part's weight format (model/formats.py); None stores every weight in `dtype`.
    reason: why these formats (`prepare --weights auto`, model/autoformat.py): logged, and written into
    both manifests as `weights_reason`.
    """
    if dtype not in DTYPES:
        raise ModelError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}.")
    out = Path(out)
    if split_range is not None:
        split = Split(source.config.num_hidden_layers, split_range[0], tail_layers, head_max=split_range[1])
    else:
        split = Split(source.config.num_hidden_layers, head_layers, tail_layers)
    formats = weights.as_dict() if weights is not None else {part: dtype for part in PARTS}
    if reason:
        log.info("weights %s: %s", ", ".join(f"{part} {fmt}" for part, fmt in formats.items()), reason)
    parts = _parts(source, split, dtype, formats)
    config = _clean_config(source.config)

    cloud_dir, local_dir = out / "cloud", out / "local"
    files = {}
    for role, directory in (("cloud", cloud_dir), ("local", local_dir)):
        directory.mkdir(parents=True, exist_ok=True)
        save_file(parts[role], str(directory / WEIGHTS), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        files[role] = {name: sha256_file(directory / name) for name in (WEIGHTS, "config.json")}
    if source.tokenizer is not None:
        source.tokenizer.save_pretrained(local_dir)
    cloud_fp = fingerprint(source.model_id, split, dtype, files["cloud"])
    for role, directory in (("cloud", cloud_dir), ("local", local_dir)):
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "role": role,
            "model_id": source.model_id,
            "architecture": (source.config.architectures or [type(source.model).__name__])[0],
            "model_type": source.config.model_type,
            "hidden_size": source.config.hidden_size,
            "split": split.as_dict(),
            "dtype": dtype,
            "weights": formats,
            "wire_dtype": default_wire_dtype(source.config.model_type),  # what clients send unless told
            "files": files[role],
            "cloud_fingerprint": cloud_fp,
            "has_tokenizer": source.tokenizer is not None,
            "created_by": f"splitinfer {__version__}",
        }
        if reason:
            manifest["weights_reason"] = reason
        (directory / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    log.info("wrote %s (cloud layers %d..%d of %d, head depths %s)", out, split.cloud_start, split.cloud_end,
             split.num_layers, split.head_range)
    return out
