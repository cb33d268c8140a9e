"""Partition a model into a local shard and a cloud shard, write them with manifests, and load them back.

    OUT/local/  manifest.json  config.json  weights.safetensors  tokenizer files
                (embedding, layers [0, k), layers [N-m, N), final norm, LM head)
    OUT/cloud/  manifest.json  config.json  weights.safetensors
                (layers [k, N-m) only)

With split-point randomisation (`prepare --split-range K1-K2`) each session picks its head depth k in
[K1, K2]: the local shard holds layers [0, K2) and the cloud shard layers [K1, N-m), so layers [K1, K2)
are in both, and a session runs the views `LocalHalf.head_for(k)` and `CloudHalf.stack_for(k)`.

The cloud shard never contains the embedding, the LM head, the final norm or a local layer, and loading
it never allocates them. Both manifests carry the cloud shard's fingerprint (a hash over its split, dtype
and file hashes), which the handshake compares so that a client cannot talk to a server holding other
layers or other weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoTokenizer, PretrainedConfig

from .. import __version__
from ..errors import ModelError
from ..kv import KVCache
from .keyed_norm import install as install_keyed_norms
from .source import SourceModel
from .stack import LayerStack, build_stack, config_from_dict, materialize, skeleton

log = logging.getLogger("splitinfer.model")

FORMAT = "splitinfer-shard"
FORMAT_VERSION = 1
WEIGHTS = "weights.safetensors"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Split:
    num_layers: int  # N, decoder layers of the whole model
    head_layers: int  # k, layers [0, k) run locally before the cloud
    tail_layers: int  # m, layers [N-m, N) run locally after the cloud
    # K2 under split-point randomisation: each session picks its head depth in [head_layers, head_max], so
    # head_layers is K1, the depth every session keeps local. None: one fixed split (K1 = K2).
    head_max: int | None = None

    def __post_init__(self):
        if self.head_layers < 1 or self.tail_layers < 1:
            raise ModelError("keep at least one local layer on each side (--head-layers >= 1, --tail-layers >= 1).")
        if self.head_max is not None and self.head_max <= self.head_layers:
            raise ModelError(f"--split-range K1-K2 needs K1 < K2 (got {self.head_layers}-{self.head_max}).")
        deepest = self.head_max if self.head_max is not None else self.head_layers
        if deepest + self.tail_layers >= self.num_layers:
            raise ModelError(
                f"the model has {self.num_layers} layers; the deepest head split + --tail-layers must leave at "
                f"least one for the cloud (got {deepest} + {self.tail_layers})."
            )

    @property
    def head_range(self) -> tuple[int, int]:
        """[K1, K2], both included: the head depths a session may pick (K1 = K2 for a fixed split)."""
        return (self.head_layers, self.head_max if self.head_max is not None else self.head_layers)

    @property
    def cloud_start(self) -> int:
        return self.head_layers

    @property
    def cloud_end(self) -> int:
        return self.num_layers - self.tail_layers

    def as_dict(self) -> dict:
        # head_range only when randomised, so fixed-split manifests (and their fingerprints) are unchanged.
        data = {
            "num_layers": self.num_layers,
            "head_layers": self.head_layers,
            "tail_layers": self.tail_layers,
            "cloud_layers": [self.cloud_start, self.cloud_end],
        }
        if self.head_max is not None:
            data["head_range"] = list(self.head_range)
        return data


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(model_id: str, split: Split, dtype: str, files: dict[str, str]) -> str:
    canonical = json.dumps(
        {"model_id": model_id, "split": split.as_dict(), "dtype": dtype, "files": files}, sort_keys=True
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


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


def prepare(
    source: SourceModel,
    out: str | Path,
    head_layers: int = 2,
    tail_layers: int = 2,
    dtype: str = "float32",
    split_range: tuple[int, int] | None = None,
) -> Path:
    """Write OUT/local and OUT/cloud. Returns OUT.

    split_range (K1, K2) replaces head_layers: sessions pick their head depth in [K1, K2] (see module doc).
    """
    if dtype not in DTYPES:
        raise ModelError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}.")
    out = Path(out)
    if split_range is not None:
        split = Split(source.config.num_hidden_layers, split_range[0], tail_layers, head_max=split_range[1])
    else:
        split = Split(source.config.num_hidden_layers, head_layers, tail_layers)
    state = source.model.state_dict()
    tied = bool(getattr(source.config, "tie_word_embeddings", False))
    parts: dict[str, dict[str, torch.Tensor]] = {"local": {}, "cloud": {}}
    for key, tensor in state.items():
        if tied and key == "lm_head.weight":
            continue  # the same tensor as the embedding; re-tied on load
        for owner in _owners(key, split):
            # clone: tied or shared storage would make safetensors refuse to save
            parts[owner][key] = tensor.detach().to(DTYPES[dtype]).contiguous().clone()
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
            "files": files[role],
            "cloud_fingerprint": cloud_fp,
            "has_tokenizer": source.tokenizer is not None,
            "created_by": f"splitinfer {__version__}",
        }
        (directory / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    log.info("wrote %s (cloud layers %d..%d of %d, head depths %s)", out, split.cloud_start, split.cloud_end,
             split.num_layers, split.head_range)
    return out


def read_manifest(directory: Path, role: str) -> dict:
    path = directory / "manifest.json"
    if not path.is_file():
        raise ModelError(f"{directory} is not a splitinfer shard (no manifest.json); run `splitinfer prepare` first.")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ModelError(f"{path} has format {manifest.get('format')!r} v{manifest.get('format_version')}; re-run prepare.")
    if manifest.get("role") != role:
        raise ModelError(f"{directory} is a {manifest.get('role')} shard, but a {role} shard is needed here.")
    return manifest


def model_identity(manifest: dict) -> str:
    """What a draft head is trained for: the model (its id and config), whatever its split, shard dtype or
    residual basis, since the final features it reads do not depend on where the model is cut. A shard in
    a secret basis carries the identity of the public shards it was made from (its config differs: the LM
    head is untied); the basis is a second check (`basis_identity`)."""
    carried = (manifest.get("residual_basis") or {}).get("model_identity")
    if carried:
        return str(carried)
    return hashlib.sha256(f"{manifest['model_id']}\n{manifest['files']['config.json']}".encode()).hexdigest()


PUBLIC_BASIS = "public"


def basis_identity(manifest: dict) -> str:
    """The residual basis a local shard's stream is in: "public", or the id `privatize --basis` recorded
    for its key (a keyed shard whose record names no id: a hash of the record, which no head names)."""
    record = manifest.get("residual_basis")
    if not isinstance(record, dict):
        return PUBLIC_BASIS
    if record.get("basis_id"):
        return str(record["basis_id"])
    return "unnamed-" + hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:32]


def local_weights_are_public(manifest: dict) -> bool:
    """True unless the local manifest says its weights were privatized and pins hashes that differ from the
    public ones it was made from (`splitinfer privatize`). Public local weights let the cloud invert what
    it sees (docs/privacy.md)."""
    private = manifest.get("private_local_weights")
    if not isinstance(private, dict):
        return True
    return private.get("public_weights_sha256") == manifest.get("files", {}).get(WEIGHTS)


def mark_private_local(directory: Path, state: dict[str, torch.Tensor], record: dict) -> None:
    """Replace the local layers in `directory` (a copy of a local shard) with private ones from `state`
    (a whole-model state dict), and pin the new file hash in the manifest. The cloud fingerprint is kept:
    the cloud shard is unchanged."""
    manifest = read_manifest(directory, "local")
    public_hash = manifest["files"][WEIGHTS]
    weights = load_file(str(directory / WEIGHTS))
    for key in weights:
        if key.startswith("model.layers."):
            weights[key] = state[key].detach().to(weights[key].dtype).contiguous().clone()
    save_file(weights, str(directory / WEIGHTS), metadata={"format": "pt"})
    manifest["files"][WEIGHTS] = sha256_file(directory / WEIGHTS)
    manifest["private_local_weights"] = {"public_weights_sha256": public_hash, **record}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _load_checked(directory: Path, manifest: dict, verify: bool) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    if verify:
        for name, digest in manifest["files"].items():
            if sha256_file(directory / name) != digest:
                raise ModelError(f"{directory / name} does not match its manifest hash; the shard is damaged or altered.")
    config = config_from_dict(json.loads((directory / "config.json").read_text()))
    return config, load_file(str(directory / WEIGHTS))


def _split_of(manifest: dict) -> Split:
    s = manifest["split"]
    head_range = s.get("head_range")
    if head_range is not None and (
        not isinstance(head_range, list) or len(head_range) != 2 or head_range[0] != s["head_layers"]
    ):
        raise ModelError("the manifest's split.head_range must be [head_layers, K2]; the shard is damaged. Re-run prepare.")
    return Split(s["num_layers"], s["head_layers"], s["tail_layers"], head_max=head_range[1] if head_range else None)


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
        self.layers = nn.ModuleList(list(full.layers)[first:last])
        self.start, self.end = full.start + first, full.start + last
        self.windows = full.windows[first:last]
        self.rope_keys = full.rope_keys[first:last]
        self._slots = len(full.layers)
        self.refresh_devices()

    def new_cache(self) -> KVCache:
        return KVCache(self._slots)


def _head_range(manifest: dict) -> tuple[int, int]:
    return _split_of(manifest).head_range


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
    """Manifest, split, config, weights, compute dtype and the meta-device skeleton of one shard."""
    manifest = read_manifest(directory, role)
    config, weights = _load_checked(directory, manifest, verify)
    if dtype is not None and dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}.")
    model = skeleton(config)
    install_keyed_norms(model, weights)  # a shard under a linear key (privatize --basis --key linear)
    return manifest, _split_of(manifest), config, weights, DTYPES[dtype or manifest["dtype"]], model


def load_cloud(directory: str | Path, device: str = "cpu", dtype: str | None = None, verify: bool = True) -> CloudHalf:
    manifest, split, config, weights, torch_dtype, model = _open(Path(directory), "cloud", dtype, verify)
    stack = build_stack(config, model, split.cloud_start, split.cloud_end, weights, device, torch_dtype)
    return CloudHalf(manifest=manifest, config=config, stack=stack)


def load_local(directory: str | Path, device: str = "cpu", dtype: str | None = None, verify: bool = True) -> LocalHalf:
    directory = Path(directory)
    manifest, split, config, weights, torch_dtype, model = _open(directory, "local", dtype, verify)

    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}

    embed = materialize(model.model.embed_tokens, part("model.embed_tokens."), device, torch_dtype)
    norm = materialize(model.model.norm, part("model.norm."), device, torch_dtype)
    if getattr(config, "tie_word_embeddings", False):
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        lm_head = materialize(lm_head, {"weight": weights["model.embed_tokens.weight"]}, device, torch_dtype)
    else:
        lm_head = materialize(model.lm_head, part("lm_head."), device, torch_dtype)
    head = build_stack(config, model, 0, split.head_range[1], weights, device, torch_dtype)
    tail = build_stack(config, model, split.cloud_end, split.num_layers, weights, device, torch_dtype)
    tokenizer = None
    if manifest.get("has_tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return LocalHalf(manifest, config, embed, head, tail, norm, lm_head, tokenizer)


def load_whole_hf(shards: str | Path) -> nn.Module:
    """The whole HF model reassembled from OUT/local and OUT/cloud (reference runs, e.g. HF generate)."""
    from transformers import AutoModelForCausalLM

    shards = Path(shards)
    local_manifest = read_manifest(shards / "local", "local")
    cloud_manifest = read_manifest(shards / "cloud", "cloud")
    if local_manifest["cloud_fingerprint"] != cloud_manifest["cloud_fingerprint"]:
        raise ModelError(f"{shards}/local and {shards}/cloud were not prepared together; re-run prepare.")
    config, weights = _load_checked(shards / "local", local_manifest, verify=False)
    weights.update(load_file(str(shards / "cloud" / WEIGHTS)))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=DTYPES[local_manifest["dtype"]])
    install_keyed_norms(model, weights)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    missing = set(model.state_dict()) - set(weights) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise ModelError(f"the shards lack {sorted(missing)[:3]}; re-run prepare.")
    return model.eval()
