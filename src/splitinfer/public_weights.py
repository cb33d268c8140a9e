"""The public-weights acknowledgement, given once and kept in the local shard's manifest.

A local shard whose layers are the model's stock public weights lets whoever runs the cloud half invert
what it sees (docs/privacy.md). Client commands refuse such a shard unless the user accepts that. The
acceptance can be given per command (`--allow-public-weights`, for scripts), in a configuration file
(`allow-public-weights = true`), or once for a shard: `prepare --allow-public-weights` and
`privacy privatize --basis --allow-public-weights` record it here, in the local manifest, pinned to the
weights file's hash. Later commands on that shard honour it and still print the warning every time.

A record pinned to other weights (the shard's weights were rewritten since) counts for nothing, so an
acknowledgement never carries over to weights the user did not see it for.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

RECORD = "public_weights_acknowledged"  # the manifest key
WEIGHTS = "weights.safetensors"  # model.manifest.WEIGHTS; not imported, so this module needs no torch


def acknowledged(manifest: dict) -> bool:
    """True when the local manifest records the acknowledgement for the weights it pins now."""
    record = manifest.get(RECORD)
    if not isinstance(record, dict):
        return False
    pinned = manifest.get("files", {}).get(WEIGHTS)
    return pinned is not None and record.get("weights_sha256") == pinned


def acknowledge(local_dir: str | Path, given_by: str) -> Path:
    """Record in LOCAL_DIR/manifest.json that its user accepts running on these weights as they are.

    given_by: the command that recorded it (kept for whoever reads the manifest later).
    """
    path = Path(local_dir) / "manifest.json"
    manifest = json.loads(path.read_text())
    if manifest.get("role") != "local":
        raise ValueError(f"{local_dir} is not a local shard")
    manifest[RECORD] = {
        "weights_sha256": manifest["files"][WEIGHTS],
        "given_by": given_by,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return path


RECORDED = ("recorded in {manifest}: later client commands on this shard accept its public weights without "
            "--allow-public-weights (and still warn). Remove the \"" + RECORD + "\" entry to take it back.")
