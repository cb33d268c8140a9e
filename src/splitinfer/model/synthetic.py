"""Synthetic shards: seeded random weights in the shape of a known config, for timing and nothing else.

    splitinfer prepare --synthetic mistral-7b-v0.1 --seed 0 --out shards/synthetic-mistral-7b [--sides local]

A decode step's cost depends on the shapes, the weight format and the kernels, not on the weights' values
(DESIGN.md, "Timing needs the shape"), so a shard of random weights in the shape of Mistral-7B times the
trusted half of the paper's configuration exactly, on a machine that has never seen its 14 GB of weights.
Text and acceptance need the real model: a synthetic shard has no tokenizer, its manifest says
`"synthetic": true`, and `generate`, `api` and `chat` refuse it (`refuse_synthetic`).

The shards are written tensor by tensor (a 7B model in float32 is 28 GB; its local half is 4.5 GB): each
tensor's values are windows of one seeded pool of random values at offsets drawn from the seed and the
tensor's name (`ValuePool`), written in chunks of rows straight into a safetensors file whose header is
computed from the shapes first, and hashed on the way. Peak memory is one chunk, whatever the model. The cloud fingerprint is a hash of the model, split, dtype,
config and seed rather than of the cloud file, so a local shard and a cloud shard made separately (on the
trusted machine and on a GPU host, say) with the same arguments still shake hands.

Values: weight matrices (and embeddings) uniform with the config's initializer_range as standard deviation (HF's own
initialisation scale, so activations stay finite and never denormal through every layer), norm weights
one, biases zero. This module knows the layouts only through the HF model skeleton (the meta device).
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .. import __version__
from ..errors import ModelError
from ..wire.frame import default_wire_dtype
from .formats import WeightFormats, quantize
from .fused import group_keys
from .manifest import DTYPES, FORMAT, FORMAT_VERSION, WEIGHTS, Split, fingerprint, read_manifest
from .prepare import _clean_config, _is_layer_linear, _owners
from .stack import config_from_dict, skeleton

SIDES = ("local", "cloud")
CHUNK_ELEMENTS = 1 << 24  # values generated and written at a time (64 MiB of float32)
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
                      torch.uint8: "U8"}


def packaged_configs() -> list[str]:
    """The config names shipped in the package (data/configs; the ones `bench plan` knows too)."""
    folder = resources.files("splitinfer.data").joinpath("configs")
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def synthetic_config(name_or_path: str) -> tuple[str, dict]:
    """(label, config dict) for a packaged name or a config.json path (or its folder); fields starting with
    '_' (the packaged configs' provenance notes) left out."""
    names = packaged_configs()
    if name_or_path in names:
        label, text = name_or_path, resources.files("splitinfer.data").joinpath(f"configs/{name_or_path}.json").read_text()
    else:
        path = Path(name_or_path)
        path = path / "config.json" if path.is_dir() else path
        label = path.parent.name if path.name == "config.json" else path.stem
        try:
            text = path.read_text()
        except OSError as exc:
            raise ModelError(f"cannot read {path} ({exc.strerror}); give a config.json or one of {', '.join(names)}.") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelError(f"{name_or_path} is not JSON ({exc}).") from exc
    return label, {k: v for k, v in data.items() if not k.startswith("_")}


def tensor_layout(config) -> dict[str, tuple[int, ...]]:
    """{state-dict key: shape} of the whole model, from the meta-device skeleton (no storage)."""
    model = skeleton(config)
    shapes = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)  # the embedding's; re-tied on load, as prepare leaves it out
    return shapes


class ValuePool:
    """2^24 seeded uniform values in (-b, b), b = std * sqrt(3) (standard deviation `std`). A tensor's values
    are windows of the pool at offsets drawn from the seed and the tensor's name: random-looking, different
    in every tensor, and as fast to write as a copy (a generator per value ran at ~20 ns a value here, minutes
    for a 7B cloud shard; a step's cost does not depend on the values)."""

    size = CHUNK_ELEMENTS

    def __init__(self, seed: int, std: float):
        self.seed = seed
        bound = std * 3**0.5
        generator = torch.Generator().manual_seed(seed)
        self.values = torch.empty(self.size).uniform_(-bound, bound, generator=generator)

    def window(self, key: str, index: int, n: int) -> torch.Tensor:
        """n values (n <= size) for chunk `index` of tensor `key`, float32."""
        # crc32: stable across processes and Python versions (hash() is salted per process)
        offset = zlib.crc32(f"{self.seed}/{key}/{index}".encode()) % self.size
        end = offset + n
        if end <= self.size:
            return self.values[offset:end]
        return torch.cat((self.values[offset:], self.values[: end - self.size]))


def tensor_chunks(key: str, shape: tuple[int, ...], dtype: torch.dtype, pool: ValuePool):
    """The tensor's values in `dtype`, as contiguous 1-D chunks of whole rows (first dimension), in order:
    norm weights one, biases zero, everything else windows of the pool."""
    rows = shape[0] if shape else 1
    width = max(1, int(torch.Size(shape[1:]).numel())) if shape else 1
    is_norm = len(shape) == 1 and "norm" in key
    is_bias = key.endswith(".bias")
    step = max(1, pool.size // width)
    for index, start in enumerate(range(0, rows, step)):
        n = min(step, rows - start) * width
        if is_norm:
            chunk = torch.ones(n)
        elif is_bias:
            chunk = torch.zeros(n)
        else:
            chunk = pool.window(key, index, n)
        yield chunk.to(dtype)


@dataclass(frozen=True)
class Stored:
    """One tensor of a shard file: its name, dtype and shape, and its values as 1-D chunks in order."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterator[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


def float_entries(key: str, shape: tuple[int, ...], dtype: torch.dtype, pool: ValuePool) -> list[Stored]:
    return [Stored(key, dtype, shape, lambda: tensor_chunks(key, shape, dtype, pool))]


def weight_entries(key: str, shape: tuple[int, ...], fmt: str, pool: ValuePool) -> list[Stored]:
    """A linear weight [N, K] stored in `fmt` (model/formats.py): a float weight, or the integer state
    `quantize` makes of the pool's values, quantized whole (int8's smoothing reads every row of a column)
    and held for one weight at a time. int8 is smoothed against unit activation maxima, so its stored
    state (and its step) has the `smooth` vector a calibrated `prepare --weights int8` writes; the siblings
    of a fusion group (q/k/v, gate/up) against unit column maxima too, so they share that vector and fuse
    at load (model/fused.py) as a calibrated shard's do."""
    if fmt in DTYPES:
        return float_entries(key, shape, DTYPES[fmt], pool)
    n, k = shape
    act_max = torch.ones(k) if fmt == "int8" else None
    column_max = torch.ones(k) if fmt == "int8" and group_keys(key) else None
    one, two = quantize(torch.ones(1, k), fmt, act_max), quantize(torch.ones(2, k), fmt, act_max)
    # a tensor with a row per output row grows with the rows; the others (int8's `smooth` [K]) do not
    shapes = {name: (n, *t.shape[1:]) if two[name].shape[0] == 2 * t.shape[0] else tuple(t.shape)
              for name, t in one.items()}
    state: dict[str, torch.Tensor] = {}

    def chunks(name: str):
        if not state:
            weight = torch.cat(list(tensor_chunks(key, shape, torch.float32, pool))).view(n, k)
            state.update(quantize(weight, fmt, act_max, column_max))
        yield state.pop(name).reshape(-1)

    prefix = key[: -len("weight")]
    return [Stored(prefix + name, one[name].dtype, shapes[name], lambda name=name: chunks(name)) for name in sorted(one)]


def write_safetensors(path: Path, entries: list[Stored]) -> str:
    """Write `entries` to a safetensors file, header first (offsets from the shapes), then each tensor's
    chunks in the same order; its sha256, computed on the way."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.name] = {"dtype": SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for part in (struct.pack("<Q", len(text)), text):
            f.write(part)
            digest.update(part)
        for entry in entries:
            written = 0
            for chunk in entry.chunks():
                data = chunk.contiguous().view(torch.uint8).numpy()
                f.write(data)
                digest.update(data)
                written += data.size
            assert written == entry.nbytes, (entry.name, written, entry.nbytes)
    return digest.hexdigest()


def side_entries(shapes: dict[str, tuple[int, ...]], side: str, dtype: str, formats: dict[str, str], model,
                 pool: ValuePool) -> list[Stored]:
    """One shard's stored tensors, as prepare.py's `_parts` lays them out: decoder-layer linears in the side's
    format, the LM head in its own (stored for a tied model too when its format is not the compute dtype),
    everything else in the compute dtype."""
    entries = []
    for key in sorted(shapes):
        if key == "lm_head.weight":
            entries += weight_entries(key, shapes[key], formats["lm_head"], pool)
        elif _is_layer_linear(model, key) and formats[side] != dtype:
            entries += weight_entries(key, shapes[key], formats[side], pool)
        else:
            entries += float_entries(key, shapes[key], DTYPES[dtype], pool)
    tied_head = side == "local" and "lm_head.weight" not in shapes and formats["lm_head"] != dtype
    if tied_head:
        entries += weight_entries("lm_head.weight", shapes["model.embed_tokens.weight"], formats["lm_head"], pool)
    return entries


def prepare_synthetic(
    name_or_path: str,
    out: str | Path,
    seed: int = 0,
    head_layers: int = 2,
    tail_layers: int = 2,
    dtype: str = "float32",
    cloud_dtype: str | None = None,
    sides: tuple[str, ...] = SIDES,
    split_range: tuple[int, int] | None = None,
    weights: WeightFormats | None = None,
) -> Path:
    """Write OUT/local and/or OUT/cloud with seeded random weights in the shape of the config. Returns OUT.

    dtype: the local shard's compute dtype (and the cloud's unless cloud_dtype); weights: each part's weight
    format (model/formats.py; None: every weight in its shard's compute dtype); sides: which shards to write."""
    cloud_dtype = cloud_dtype or dtype
    for name in (dtype, cloud_dtype):
        if name not in DTYPES:
            raise ModelError(f"synthetic shards compute in {', '.join(DTYPES)}, not {name!r}.")
    if not sides or any(s not in SIDES for s in sides):
        raise ModelError(f"--sides takes local, cloud or both (local,cloud); got {','.join(sides) or 'none'}.")
    label, data = synthetic_config(name_or_path)
    config = config_from_dict(data)
    layers = config.num_hidden_layers
    split = (Split(layers, split_range[0], tail_layers, head_max=split_range[1]) if split_range
             else Split(layers, head_layers, tail_layers))
    formats = weights.as_dict() if weights is not None else {"local": dtype, "cloud": cloud_dtype, "lm_head": dtype}
    parts: dict[str, dict] = {side: {} for side in SIDES}
    for key, shape in tensor_layout(config).items():
        for owner in _owners(key, split):
            parts[owner][key] = shape
    config_text = json.dumps(_clean_config(config), indent=2, sort_keys=True)
    config_sha = hashlib.sha256(config_text.encode()).hexdigest()
    identity = {"config.json": config_sha, "synthetic_seed": str(seed), "cloud_weights": formats["cloud"]}
    # Not over the cloud file: made the same way, a local and a cloud shard match wherever each was written.
    cloud_fp = fingerprint(f"synthetic/{label}", split, cloud_dtype, identity)
    model, pool = skeleton(config), ValuePool(seed, float(getattr(config, "initializer_range", 0.02) or 0.02))
    for side in sides:
        side_dtype = dtype if side == "local" else cloud_dtype
        directory = Path(out) / side
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(config_text)
        weights_sha = write_safetensors(directory / WEIGHTS, side_entries(parts[side], side, side_dtype, formats, model, pool))
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "role": side, "model_id": f"synthetic/{label}",
            "architecture": (config.architectures or [type(model).__name__])[0], "model_type": config.model_type,
            "hidden_size": config.hidden_size, "split": split.as_dict(), "dtype": side_dtype, "weights": formats,
            "wire_dtype": default_wire_dtype(config.model_type),
            "files": {WEIGHTS: weights_sha, "config.json": config_sha}, "cloud_fingerprint": cloud_fp,
            "has_tokenizer": False,
            "synthetic": True,  # random weights: for timing only (module docstring)
            "synthetic_source": {"config": label, "seed": seed, "config_sha256": config_sha},
            "created_by": f"splitinfer {__version__}",
        }
        (directory / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return Path(out)


def is_synthetic(manifest: dict) -> bool:
    return bool(manifest.get("synthetic"))


def refuse_synthetic(local_shard: str | Path | None, command: str) -> None:
    """Raise when `local_shard` (a local shard directory) holds synthetic weights: their text is noise."""
    if local_shard is None or not (Path(local_shard) / "manifest.json").is_file():
        return
    manifest = read_manifest(Path(local_shard), "local")
    if is_synthetic(manifest):
        source = manifest.get("synthetic_source", {})
        raise ModelError(
            f"{local_shard} holds synthetic weights (random, in the shape of {source.get('config', '?')}, seed "
            f"{source.get('seed', '?')}): they time a step but generate noise, so `splitinfer {command}` refuses them. "
            "Use them with `splitinfer bench step` or `bench batch`; prepare a real model for text."
        )
