"""`splitinfer prepare`: convert a model once into a local shard and a cloud shard (model/prepare.py).

Parsing and reporting only; nothing heavy is imported until the command runs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..options import Opt, add_options
from ..wire.dtypes import DTYPE_NAMES


@dataclass(frozen=True)
class SplitOptions:
    """The default split and shard dtype: `prepare` makes it, `plan` sizes it, the privacy table reports it."""

    head_layers: int = 2  # k: decoder layers kept local before the cloud
    tail_layers: int = 2  # m: decoder layers kept local after the cloud
    dtype: str = "float32"  # the compute dtype of prepared shards (activations, norms, the embedding)
    # Each part's weight format (model/formats.py): one format, or PART=FORMAT entries (local, cloud, lm_head);
    # "auto": by the source, this CPU's int8 product and `cloud_device` (model/autoformat.py: int8 on a CPU
    # with splitinfer's or FBGEMM's int8 product); "" every weight in `dtype`.
    weights: str = "auto"
    cloud_device: str = "cpu"  # where the cloud half will run, for `weights` auto: "cpu", or "cuda" (layers bfloat16)


@dataclass(frozen=True)
class SyntheticOptions:
    """`prepare --synthetic`'s defaults (model/synthetic.py)."""

    seed: int = 0  # the random weights' seed: the same seed, the same shards
    sides: str = "local,cloud"  # the shards written: local, cloud or both


def parse_split_range(text: str) -> tuple[int, int]:
    """'K1-K2' -> (K1, K2) with 1 <= K1 < K2."""
    low, sep, high = text.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit() or not 1 <= int(low) < int(high):
        raise ConfigError(f"--split-range must be K1-K2 with 1 <= K1 < K2, e.g. 2-4 (got {text!r}).")
    return int(low), int(high)


def install_shipped_drafter(local_dir: Path, shipped: Path | None = None) -> str:
    """Copy the shipped draft head made for this model and the shard's residual basis (package
    data/drafters/<name>/, or the folders in `shipped`) into `local_dir`/drafter; a sentence saying what
    happened."""
    from importlib import resources

    from .drafthead import DRAFTER_DIR, HEAD_CONFIG, head_basis, read_head_info
    from .manifest import basis_identity, model_identity, read_manifest

    manifest = read_manifest(local_dir, "local")
    identity = model_identity(manifest)
    shipped = resources.files("splitinfer.data").joinpath("drafters") if shipped is None else shipped
    candidates = sorted(d.name for d in shipped.iterdir() if d.joinpath(HEAD_CONFIG).is_file()) if shipped.is_dir() else []
    for name in candidates:
        with resources.as_file(shipped.joinpath(name)) as source:
            info = read_head_info(source)
            if info.get("model_fingerprint") != identity:
                continue
            if head_basis(info) != basis_identity(manifest):
                return (f"the shipped draft head {name!r} is for this model's public basis and {local_dir} is in a "
                        "secret one, so it was not installed; run `splitinfer privacy privatize --basis` from public shards "
                        "(it re-bases their head with the key).")
            shutil.copytree(source, local_dir / DRAFTER_DIR, dirs_exist_ok=True)
            return f"installed the shipped draft head {name!r} in {local_dir / DRAFTER_DIR}"
    shipped_names = ", ".join(candidates) or "none"
    return (f"no shipped draft head matches this model (shipped: {shipped_names}); the tree drafts without one. "
            "Train one with `splitinfer drafter train` and copy it to LOCAL_SHARD/drafter.")


def cmd_prepare(args) -> int:
    from .. import kernels
    from ..extras import GGUF, is_gguf_source, require_extra

    if not args.synthetic and is_gguf_source(args.model):  # a missing extra says so before anything builds
        require_extra("gguf", GGUF, "splitinfer prepare (reading a GGUF model; the default is one)")
    kernels.ensure()  # built here, once per install, rather than at the first client's start
    if args.synthetic:
        return cmd_prepare_synthetic(args)
    from ..progress import progress
    from .autoformat import auto_formats
    from .prepare import prepare
    from .source import load_source

    from .formats import WeightFormats

    split_range = parse_split_range(args.split_range) if args.split_range else None  # fail before loading
    weights = WeightFormats.parse(args.weights) if args.weights not in ("", "auto") else None
    reason = None
    with progress(total=2, desc="prepare: loading the model", unit="step") as bar:
        source = load_source(args.model)
        if args.weights == "auto":
            choice = auto_formats(source, args.dtype, args.cloud_device)
            weights, reason = choice.weights, "--weights auto: " + choice.reason
        bar.set_description("prepare: writing the shards")
        bar.update(1)
        out = prepare(source, args.out, args.head_layers, args.tail_layers, args.dtype, split_range=split_range,
                      weights=weights, reason=reason)
        bar.update(1)
    manifest = json.loads((out / "cloud" / "manifest.json").read_text())
    split = manifest["split"]
    low, high = split.get("head_range", [split["head_layers"]] * 2)
    randomised = f"; each session picks its split k in {low}..{high}" if high > low else ""
    print(
        f"prepared {manifest['model_id']}: local layers [0, {high}) + "
        f"[{split['cloud_layers'][1]}, {split['num_layers']}), cloud layers [{split['cloud_layers'][0]}, "
        f"{split['cloud_layers'][1]}){randomised}, {manifest['dtype']}, weights {weights.spec() if weights else manifest['dtype']}\n  {out / 'local'}\n  {out / 'cloud'}"
    )
    if reason:
        print(reason)
    print(install_shipped_drafter(out / "local"))
    if args.allow_public_weights:
        from ..public_weights import RECORDED, acknowledge

        print(RECORDED.format(manifest=acknowledge(out / "local", "splitinfer prepare --allow-public-weights")))
    return 0


def cmd_prepare_synthetic(args) -> int:
    """`prepare --synthetic NAME|config.json --seed S`: random weights in a config's shape (model/synthetic.py)."""
    from .synthetic import prepare_synthetic

    if args.model:
        raise ConfigError("--synthetic makes random weights in a config's shape; leave out --model.")
    split_range = parse_split_range(args.split_range) if args.split_range else None
    sides = tuple(s.strip() for s in args.sides.split(",") if s.strip())
    from .formats import WeightFormats

    weights = WeightFormats.parse(args.weights) if args.weights not in ("", "auto") else None  # random: dtype
    out = prepare_synthetic(args.synthetic, args.out, args.seed, args.head_layers, args.tail_layers, args.dtype,
                            args.cloud_dtype, sides, split_range, weights)
    for side in sides:
        manifest = json.loads((out / side / "manifest.json").read_text())
        size = (out / side / "weights.safetensors").stat().st_size
        print(f"synthetic {side} shard of {manifest['model_id']} (seed {args.seed}, computes in {manifest['dtype']}, "
              f"weights {', '.join(f'{k}={v}' for k, v in manifest['weights'].items())}, {size / 1e9:.2f} GB): {out / side}")
    print("random weights: for timing (bench step, bench batch); generate, api and chat refuse them")
    return 0


def register(subparsers) -> None:
    s = subparsers.add_parser("prepare", help="convert a model once into a local shard and a cloud shard")
    s.add_argument("--out", required=True, help="output directory; OUT/local and OUT/cloud are written")
    s.add_argument("--model", help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    add_options(s, SplitOptions, (Opt("head_layers", help="decoder layers kept local before the cloud (k)"),))
    s.add_argument("--split-range", metavar="K1-K2",
                   help="split-point randomisation instead of --head-layers: each session runs k in [K1, K2] head "
                        "layers, drawn at random; the local shard holds layers [0, K2), the cloud [K1, N-m)")
    add_options(s, SplitOptions, (
        Opt("tail_layers", help="decoder layers kept local after the cloud (m)"),
        Opt("dtype", choices=DTYPE_NAMES, help="compute dtype of the shards (activations, norms, embedding)"),
        Opt("weights", help="weight format of the decoder layers and LM head: float32, bfloat16, int8 or int4, "
                            "or PART=FORMAT entries for local, cloud, lm_head (e.g. int4,lm_head=int8); "
                            "int4 keeps a Q4_0/Q4_1 GGUF's own blocks; auto: int8 for every part where this CPU runs "
                            "splitinfer's or FBGEMM's int8 product (exact, and measured faster than float32 on both), "
                            "from any GGUF (its blocks dequantized and quantized again) or float checkpoint, else "
                            "--dtype; --cloud-device cuda makes the cloud's layers bfloat16; --synthetic: every "
                            "weight in --dtype; '' or float32: every weight in --dtype (the reference)"),
        Opt("cloud_device", choices=("cpu", "cuda"),
            help="where the cloud half will run, for --weights auto: cpu (int8, as the local half), or cuda (its "
                 "layers bfloat16: a GPU multiplies floats and would dequantize int8 at load)"),
    ))
    s.add_argument("--allow-public-weights", action="store_true",
                   help="accept, once for this shard, that its local layers are the stock public weights (the cloud "
                        "can invert what it sees): recorded in OUT/local/manifest.json, so client commands on it need "
                        "no --allow-public-weights (they still warn)")
    s.add_argument("--synthetic", metavar="NAME|CONFIG",
                   help="seeded random weights in the shape of a config (a name `bench plan` knows, e.g. "
                        "mistral-7b-v0.1, or a config.json), for timing only: no tokenizer, refused by generate/api/chat")
    add_options(s, SyntheticOptions, (Opt("seed", help="with --synthetic: the weights' seed"),
                                      Opt("sides", help="with --synthetic: the shards to write (local, cloud or both)")))
    s.add_argument("--cloud-dtype", choices=DTYPE_NAMES, help="with --synthetic: the cloud shard's dtype (default --dtype)")
    s.set_defaults(func=cmd_prepare)
