"""A shard's manifest: the split it holds, its file hashes and fingerprint, and the identities read from it.

Both manifests carry the cloud shard's fingerprint (a hash over its split, dtype and file hashes), which
the handshake compares so that a client cannot talk to a server holding other layers or other weights.
prepare.py writes manifests, shards.py loads the shards they describe; this module only reads and checks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import ModelError

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
    public ones it was made from (`splitinfer privacy privatize`). Public local weights let the cloud invert what
    it sees (docs/privacy.md)."""
    private = manifest.get("private_local_weights")
    if not isinstance(private, dict):
        return True
    return private.get("public_weights_sha256") == manifest.get("files", {}).get(WEIGHTS)


def mark_private_local(directory: Path, layers: dict[str, torch.Tensor], record: dict) -> None:
    """Replace the local layers in `directory` (a copy of a local shard) with private ones: `layers` holds
    every 'model.layers.' key of the shard, in the shard's own formats (model/prepare.py `restored_layers`).
    Pins the new file hash in the manifest. The cloud fingerprint is kept: the cloud shard is unchanged."""
    manifest = read_manifest(directory, "local")
    public_hash = manifest["files"][WEIGHTS]
    weights = load_file(str(directory / WEIGHTS))
    for key in weights:
        if key.startswith("model.layers."):
            weights[key] = layers[key].detach().to(weights[key].dtype).contiguous().clone()
    save_file(weights, str(directory / WEIGHTS), metadata={"format": "pt"})
    manifest["files"][WEIGHTS] = sha256_file(directory / WEIGHTS)
    manifest["private_local_weights"] = {"public_weights_sha256": public_hash, **record}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def split_of(manifest: dict) -> Split:
    s = manifest["split"]
    head_range = s.get("head_range")
    if head_range is not None and (
        not isinstance(head_range, list) or len(head_range) != 2 or head_range[0] != s["head_layers"]
    ):
        raise ModelError("the manifest's split.head_range must be [head_layers, K2]; the shard is damaged. Re-run prepare.")
    return Split(s["num_layers"], s["head_layers"], s["tail_layers"], head_max=head_range[1] if head_range else None)
