"""CLI: `splitinfer privacy audit` and `splitinfer privacy privatize` (thin wrappers over privacy.audit / privacy.privatize).

No torch import at module level: the CLI parses arguments before anything heavy loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..model.commands import SplitOptions
from ..options import SHARDS, THREADS, Opt, Shared, add_options, config_from_args, defer

# `--steps` keeps this command's own default (60), which is not PrivatizeConfig's.
PRIVATIZE_OPTIONS = (
    Opt("steps", default=60, help="distillation steps"),
    Opt("rank", help="rank of the secret low-rank deltas"),
    Opt("scale", help="initial size of the deltas relative to the weights"),
    Opt("seed", help="the secret seed (default: drawn from the OS and never stored)"),
)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise ConfigError(f"expected comma-separated integers like 1,2,4, not {text!r}.") from exc
    if not values or min(values) < 1:
        raise ConfigError(f"expected positive integers, not {text!r}.")
    return values


def _keys(text: str) -> tuple[str, ...]:
    from .basis import KEYS

    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    if not keys or not set(keys) <= set(KEYS):
        raise ConfigError(f"--keys takes a comma-separated subset of {', '.join(KEYS)}, not {text!r}.")
    return keys


def _threats(text: str) -> tuple[str, ...]:
    """--threats: T3,T4,T5 or a subset (KeyedConfig checks them)."""
    return tuple(t.strip().upper() for t in text.split(",") if t.strip())


def _pad_settings(text: str) -> tuple[str, ...]:
    """--pad-rows: comma-separated padding settings (wire/padding.py's PadSetting), e.g. 0,33,33+s64+h110+t50."""
    from ..wire.padding import parse_pad_settings

    return tuple(s.key for s in parse_pad_settings(text))


def _metadata_changes(args, config) -> dict:
    """T6 (metadata.py): on in the full audit unless --no-metadata, off with --quick unless --metadata;
    --metadata-only runs it alone (no model in this process, no other threat)."""
    from dataclasses import replace

    from .metadata import MetadataConfig

    metadata = MetadataConfig()
    if args.pad_rows is not None:
        metadata = replace(metadata, pad_rows=_pad_settings(args.pad_rows))
    if args.pad_prompt_rows:
        if args.pad_prompt_rows < 0:
            raise ConfigError(f"--pad-prompt-rows takes a row count of 0 (off) or more, not {args.pad_prompt_rows}.")
        metadata = replace(metadata, pad_prompt_rows=args.pad_prompt_rows)
    if args.metadata_only:
        return {"metadata": metadata, "t0": False, "basis": None, "privatize": None, "noise_sigmas": ()}
    wanted = args.metadata if args.metadata is not None else config.t0
    return {"metadata": metadata if wanted else None}


def cmd_audit(args) -> int:
    from ..extras import AUDIT, require_extra

    require_extra("audit", AUDIT, "splitinfer privacy audit")
    import torch

    from .audit import run_audit

    if args.threads:
        torch.set_num_threads(args.threads)
    config = audit_config(args)
    if not (Path(args.shards) / "local" / "manifest.json").is_file():
        raise ConfigError(f"{args.shards} is not a prepared model; run `splitinfer prepare --out {args.shards}` first.")
    result = run_audit(config, args.out)
    print(f"wrote {args.out}/audit.json and {args.out}/audit.md ({len(result['results'])} rows, {result['wall_seconds']} s)")
    return 0


def audit_config(args):
    """The AuditConfig `privacy audit`'s arguments ask for: --quick's or --threats' preset (audit.py), or the full
    audit, with the options given on top."""
    from dataclasses import replace

    from .audit import AuditConfig, keyed_config, quick_config

    threats = _threats(args.threats) if args.threats is not None else None
    if threats is not None and (args.no_basis or args.metadata_only):
        raise ConfigError("--threats picks threats of the secret basis; drop --no-basis and --metadata-only.")
    if args.quick:
        config = quick_config(args.shards)
        if threats is not None:
            config = replace(config, basis=replace(config.basis, threats=threats))
    elif threats is not None:
        config = keyed_config(args.shards, threats)
    else:
        config = AuditConfig(shards=args.shards)
    changes = {}
    if args.depths:
        changes["depths"] = _ints(args.depths)
    if args.tail_depths:
        changes["tail_depths"] = _ints(args.tail_depths)
    if args.documents:
        changes["corpus"] = replace(config.corpus, max_documents=args.documents)
    if args.a4_chunks is not None:
        changes["a4_chunks"] = args.a4_chunks
    if args.epochs:
        changes["train"] = replace(config.train, epochs=args.epochs)
    if args.t2_tokens:
        changes["t2_tokens"] = _ints(args.t2_tokens)
    if args.no_seq:
        changes["seq_attacker"] = False
    if args.no_privatize:
        changes["privatize"] = None
    if args.no_basis:
        changes["basis"] = None
    else:
        if args.t5_pairs:
            changes["basis"] = replace(changes.get("basis", config.basis), t5_pairs=_ints(args.t5_pairs))
        if args.keys:
            changes["basis"] = replace(changes.get("basis", config.basis), keys=_keys(args.keys))
    if args.t0 is not None:
        changes["t0"] = args.t0
    changes.update(_metadata_changes(args, config))
    if args.noise is not None:
        try:
            changes["noise_sigmas"] = tuple(float(v) for v in args.noise.split(",") if v.strip())
        except ValueError as exc:
            raise ConfigError(f"--noise takes comma-separated sigmas like 0.1,0.5 (or '' for none), not {args.noise!r}.") from exc
    config = replace(config, **changes)
    if config.defence_depth not in config.depths or config.defence_depth not in config.tail_depths:
        raise ConfigError(f"--depths and --tail-depths must include the defence depth {config.defence_depth}.")
    return config


def _read_texts(paths: list[str]) -> list[str]:
    texts = []
    for p in map(Path, paths):
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".txt", ".md", ".rst")) if p.is_dir() else [p]
        for f in files:
            if not f.is_file():
                raise ConfigError(f"{f} does not exist; pass text files or directories of .txt/.md/.rst files.")
            texts.append(f.read_text(encoding="utf-8", errors="replace"))
    return [t for t in texts if t.strip()]


def _basis(shards: Path, out: Path, args) -> int:
    """`privatize --basis`: both shards rewritten in a secret residual basis (privacy/basis.py)."""
    import time

    import torch

    from ..model.shards import load_whole_hf
    from .basis import BasisConfig, apply_basis, write_basis_shards

    started = time.perf_counter()
    model = load_whole_hf(shards)
    config = BasisConfig(seed=args.seed, key=args.key, condition=args.condition, metric_block=args.metric_block)
    keyed, secret, record = apply_basis(model, config)
    # A self-check on 64 arbitrary tokens: the keyed model must compute the public model's logits.
    ids = torch.arange(64)[None] * 7919 % model.config.vocab_size
    with torch.inference_mode():
        gap = (model(ids).logits - keyed(ids).logits).abs().max().item()
    record["self_check_max_logit_difference"] = gap
    _, head_note = write_basis_shards(keyed, secret, shards, out, record)
    if args.allow_public_weights:  # the host can undo the key, so client commands still need the acceptance
        from ..public_weights import RECORDED, acknowledge

        head_note += "\n" + RECORDED.format(
            manifest=acknowledge(out / "local", "splitinfer privacy privatize --basis --allow-public-weights"))
    print(
        f"wrote {out} (local and cloud shards in a secret residual basis, {config.key} key, "
        f"{time.perf_counter() - started:.1f} s; "
        f"max |logit difference| to the public model {gap:.2e} on 64 tokens)\n"
        f"{head_note}\n"
        "serve OUT/cloud to this deployment only: its host can recover the basis from it (docs/privacy.md, T4)."
    )
    return 0


def cmd_privatize(args) -> int:
    import torch
    from transformers import AutoTokenizer

    from ..model.shards import load_whole_hf
    from .privatize import PrivatizeConfig, privatize_model, utility, write_private_shard

    if args.threads:
        torch.set_num_threads(args.threads)
    shards, out = Path(args.shards), Path(args.out)
    if out.exists():
        raise ConfigError(f"{out} exists; choose a new --out directory.")
    if args.basis:
        if args.text:
            raise ConfigError("--basis needs no --text and does not combine with the distilled private weights; "
                              "pass one or the other.")
        return _basis(shards, out, args)
    if not args.text:
        raise ConfigError("pass the organisation's own text with --text (or --basis for a secret residual basis).")
    texts = _read_texts(args.text)
    if len(texts) < 2:
        raise ConfigError("pass at least two documents of the organisation's own text with --text (one is held out).")
    manifest = json.loads((shards / "local" / "manifest.json").read_text())
    split = manifest["split"]
    tokenizer = AutoTokenizer.from_pretrained(shards / "local", local_files_only=True)
    chunks = []
    for doc, text in enumerate(texts):
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        chunks += [(doc, ids[s : s + 128]) for s in range(0, len(ids), 128) if len(ids[s : s + 128]) >= 16]
    held = {d for d in range(len(texts)) if d % 5 == 4} or {len(texts) - 1}  # split by document
    train = [c for d, c in chunks if d not in held]
    test = [c for d, c in chunks if d in held][:32]
    config = config_from_args(PrivatizeConfig, args, PRIVATIZE_OPTIONS,
                              head_layers=split["head_layers"], tail_layers=split["tail_layers"])
    model = load_whole_hf(shards)
    private, record = privatize_model(model, train, config)
    record["utility"] = utility(model, private, test)
    write_private_shard(private, shards, out, record)
    u = record["utility"]
    print(
        f"wrote {out} (private local layers {record['layers']}, cloud shard unchanged)\n"
        f"held-out perplexity {u['perplexity']:.2f} (original {u['reference_perplexity']:.2f}), "
        f"greedy agreement {100 * u['greedy_agreement']:.1f}% over {u['n_tokens']} tokens"
    )
    if args.seed is not None:
        print("warning: --seed makes the private weights reproducible by anyone who learns it; keep it secret.", file=sys.stderr)
    return 0


def cmd_basis_check(args) -> int:
    from .basis_check import compare

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = compare(Path(args.public), Path(args.keyed), args.tokens)
    Path(args.out).write_text(json.dumps(result, indent=1))
    same = sum(r["float32_identical"] for r in result["prompts"])
    p = result["perplexity"]
    print(f"float32 greedy identical on {same}/{len(result['prompts'])} prompts; perplexity {p['perplexity']:.3f} "
          f"(public {p['reference_perplexity']:.3f}); decode tok/s {result['decode_tok_s_median']}; wrote {args.out}")
    return 0


def cmd_privacy_table(args) -> int:
    from .table import write_tables

    print(write_tables([Path(a) for a in args.audit], [Path(t) for t in args.write], args.depth,
                       [Path(t) for t in args.write_short]))
    return 0


@dataclass(frozen=True)
class BasisCheckOptions:
    """`splitinfer privacy check`'s defaults."""

    tokens: int = 32  # new tokens per prompt


def register(subparsers) -> None:
    s = subparsers.add_parser("audit", help="measure what the cloud can recover from the hidden states it sees")
    add_options(s, Shared, (SHARDS,))
    s.add_argument("--out", required=True, help="directory for audit.json, audit.md and plots")
    s.add_argument("--quick", action="store_true", help="a smaller audit (about ten minutes on two CPU cores)")
    s.add_argument("--depths", help="input-side depths k, e.g. 1,2,4,6,8")
    s.add_argument("--tail-depths", help="output-side depths m, e.g. 1,2,4,6,8")
    s.add_argument("--documents", type=int, help="source documents in the corpus")
    s.add_argument("--a4-chunks", type=int, help="test chunks for the known-weights exact attacker")
    s.add_argument("--epochs", type=int, help="training epochs of the learned attackers")
    s.add_argument("--t2-tokens", help="chosen-plaintext attacker's own tokens (T2 learning curve), e.g. 1000,10000,100000")
    s.add_argument("--no-seq", action="store_true", help="skip A3, the sequence-aware attacker")
    s.add_argument("--no-privatize", action="store_true", help="skip the private-weights defence (T1, T2)")
    s.add_argument("--no-basis", action="store_true", help="skip the secret residual basis (threats T3, T4, T5)")
    s.add_argument("--keys", help="the deployments T3-T5 measure: orthogonal,linear (default both)")
    s.add_argument("--threats", help="only these threats of the secret basis, e.g. T3 (of T3,T4,T5), on an evaluation "
                                     "set sized for intervals a few points wide (with --quick: the quick audit's)")
    s.add_argument("--t0", action=argparse.BooleanOptionalAction, default=None,
                   help="the public-weights baseline rows (default: on, off with --quick)")
    s.add_argument("--t5-pairs", help="known (text, activation) pairs for T5's least squares, e.g. 100,1000,10000")
    s.add_argument("--noise", help="noise sigmas (relative to each row's RMS), e.g. 0.1,0.5; '' for none")
    s.add_argument("--metadata", action=argparse.BooleanOptionalAction, default=None,
                   help="T6, a network observer's recovery from message sizes and times, with and without padding "
                        "(default: on, off with --quick)")
    s.add_argument("--metadata-only", action="store_true", help="run T6 alone (a loopback server, real generations)")
    s.add_argument("--pad-rows", help="T6's padding settings ROWS[+sSTEPS][+hHOLD_MS][+tTHINK_MS], e.g. 0,33,33+s64+h110+t50 "
                   "(0: none; default 0,33; generate's --pad-rows, --pad-steps, --pad-hold-ms, --pad-think-ms)")
    s.add_argument("--pad-prompt-rows", type=int, help="T6: every padded setting also pads prompt messages to this "
                   "many rows (ClientConfig.pad_prompt_rows; default: prompts padded as steps are)")
    add_options(s, Shared, (THREADS,))
    s.set_defaults(func=cmd_audit)

    s = subparsers.add_parser("check", help="compare a `privatize --basis` copy with its public shards")
    s.add_argument("--public", required=True, help="the public OUT directory")
    s.add_argument("--keyed", required=True, help="its `privatize --basis` copy")
    s.add_argument("--out", required=True, help="JSON file for the comparison")
    add_options(s, BasisCheckOptions, (Opt("tokens", help="new tokens per prompt"),))
    add_options(s, Shared, (THREADS,))
    s.set_defaults(func=cmd_basis_check)

    s = subparsers.add_parser("table", help="write the threat-model table from audit.json files into docs")
    s.add_argument("--audit", nargs="+", required=True,
                   help="audit.json files; a row found in several comes from the first")
    s.add_argument("--write", nargs="*", default=[], help="Markdown files with threat-table markers to update")
    s.add_argument("--write-short", nargs="*", default=[], help="files to get the short table (no has/data columns)")
    add_options(s, SplitOptions, (Opt("head_layers", "--depth", help="the split depth k = m the table reports"),))
    s.set_defaults(func=cmd_privacy_table)

    s = subparsers.add_parser("privatize",
                              help="make the local layers private (secret seed + distillation, or --basis)")
    s.add_argument("--shards", required=True, help="a prepared OUT directory with stock weights")
    s.add_argument("--out", required=True, help="new OUT directory: private OUT/local, unchanged OUT/cloud")
    s.add_argument("--text", nargs="+", help="the organisation's own text: files or directories")
    s.add_argument("--basis", action="store_true",
                   help="instead: rewrite both shards under a secret key (same outputs; new cloud shard)")
    s.add_argument("--allow-public-weights", action="store_true",
                   help="with --basis: accept once for the keyed shard that its host can undo the key and invert what "
                        "it sees (recorded in OUT/local/manifest.json; client commands then need no flag and still warn)")
    add_options(s, Shared, (THREADS,))
    defer(s, _privatize_options)
    s.set_defaults(func=cmd_privatize)


def _privatize_options(s) -> None:
    from .basis import KEYS, BasisConfig
    from .privatize import PrivatizeConfig

    add_options(s, PrivatizeConfig, PRIVATIZE_OPTIONS)
    add_options(s, BasisConfig, _basis_options(KEYS))


def _basis_options(keys) -> tuple[Opt, ...]:
    return (
        Opt("key", choices=keys, help="with --basis: a rotation, or a general invertible key with keyed RMSNorms "
                                      "(hides inner products from an observer without the cloud shard; "
                                      "see docs/privacy.md)"),
        Opt("condition", help="with --key linear: the key's condition number"),
        Opt("metric_block", help="with --key linear: block size of the norms' factor "
                                 "(extra multiply-adds per norm: d x block)"),
    )
