"""Run the privacy audit and write DIR/audit.json: one row per (side, depth, threat, attacker, defence).

Threats: T0 the local layers are the public weights; T1 they are private (`privatize`) and the attacker
holds the public ones; T2 as T1 plus a chosen-plaintext attacker that pushed N tokens of its own text
through the deployment's real local layers and trained on what came out; T3-T5 the model runs in a
secret residual basis (`privatize --basis`) and the attacker is an observer without the cloud shard (T3),
the host with it (T4), or holds known (text, activation) pairs (T5); see keyed.py. Defences: split depth, private
local weights, Gaussian noise on the sent activations (sigma times each row's RMS). Every row carries its
frequency-prior baseline, its ceiling, a bootstrap interval over documents and its per-token outcomes.
T6 is a network observer with TLS intact, reading message sizes and times (metadata.py), with and without
padding; its rows score steps, generations or documents instead of tokens.
This module orchestrates; the attackers, statistics and report live in their own modules.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from . import attackers, exact, stats
from .collect import collect
from .corpus import CorpusConfig, build_corpus
from .exact import ExactConfig
from .keyed import KeyedConfig
from .metadata import MetadataConfig, metadata_section, metadata_threat
from .privatize import PrivatizeConfig, privatize_model, utility

log = logging.getLogger("splitinfer.privacy")
LEARNED = ("A2", "A3")


@dataclass(frozen=True)
class AuditConfig:
    shards: str = "shards/smollm2"
    depths: tuple[int, ...] = (1, 2, 4, 6, 8)  # input side: head layers k
    tail_depths: tuple[int, ...] = (1, 2, 4, 6, 8)  # output side: tail layers m
    # Sized so the whole audit finishes in well under an hour on two shared CPU cores; raise on a GPU.
    corpus: CorpusConfig = CorpusConfig(max_documents=40, max_chunks_per_document=2)
    train: attackers.TrainConfig = attackers.TrainConfig(epochs=5, max_seconds=20)
    exact: ExactConfig = ExactConfig()
    inexact: ExactConfig = ExactConfig(blocks=(64,), max_candidates=64)  # A4 when no exact match can exist
    a4_chunks: int = 3  # test chunks for input-side A4 (it runs layers per candidate; the rest is cheap)
    seq_attacker: bool = True  # A3
    defence_depth: int = 2  # k = m used for the noise and private-weights defences
    noise_sigmas: tuple[float, ...] = (0.1, 0.5)
    # 100 steps per stage: ~456 s for 60 steps of 4 windows under load 5 on 2 cores, so ~2-3 min quiet.
    privatize: PrivatizeConfig | None = PrivatizeConfig(steps=100, batch_chunks=2, seq_len=64, pool_windows=32)
    # T2: chosen-plaintext tokens (the attacker's own text, see corpus.attacker_text). The output side needs
    # a whole-model forward per token (its targets are the private model's greedy tokens): capped apart.
    t2_tokens: tuple[int, ...] = (1_000, 10_000, 100_000)
    t2_output_tokens: int = 10_000
    t2_train: attackers.TrainConfig = attackers.TrainConfig(epochs=5, max_seconds=90)
    utility_chunks: int = 6  # test chunks for perplexity / greedy agreement
    # T3-T5: a secret residual basis (privatize --basis) against an observer, the host, known plaintext.
    basis: KeyedConfig | None = KeyedConfig()
    # T0 rows (the public-weights baseline) and their collection; the noise and private-weights defences
    # build on them. --quick leaves them to the full audit.
    t0: bool = True
    # T6: a network observer's recovery of accepted counts, category and document from sizes and times, per
    # padding setting (a loopback server and real generations); None leaves it out (the CLI's full audit runs it).
    metadata: MetadataConfig | None = None
    n_boot: int = 1000
    seed: int = 0

    def __post_init__(self):
        if not self.t0 and self.basis is None and self.metadata is None:
            raise ConfigError("without T0 and without the secret basis there is nothing to audit; drop --no-t0 "
                              "or --no-basis.")
        if not self.t0 and (self.noise_sigmas or self.privatize is not None):
            raise ConfigError("the noise and private-weights defences need the T0 rows; drop --no-t0, or pass "
                              "--noise '' and --no-privatize.")


def quick_config(shards: str) -> AuditConfig:
    """Within 15 minutes on two loaded CPU cores: the linear key's T3-T5 at k = m = 2 only (`--keys
    linear,orthogonal` adds the orthogonal basis's), fewer documents, epochs and A4 chunks, A4 after A7 at the
    largest N only; no T0 rows, no noise and no private weights (the full audit has them)."""
    return AuditConfig(
        shards=shards,
        depths=(2,),
        tail_depths=(2,),
        corpus=CorpusConfig(max_documents=30, max_chunks_per_document=1),
        train=attackers.TrainConfig(epochs=4, max_seconds=15),
        a4_chunks=2,
        noise_sigmas=(),
        privatize=None,
        utility_chunks=4,
        t0=False,
        basis=KeyedConfig(keys=("linear",), t5_a4_from=10_000),
        n_boot=500,
    )


def keyed_config(shards: str, threats: tuple[str, ...]) -> AuditConfig:
    """`--threats`: only these threats of the secret basis (T3-T5), at k = m = 2, on an evaluation set sized so
    that each row's bootstrap interval over documents is a few points wide (60 held-out documents; A4 on 100
    chunks), A8 / A9 with up to 80,000 tokens of other sessions' traffic; no T0 rows, no noise, no private
    weights, no T6. notes/privacy/t3: the linear key's T3 in 43 minutes on one loaded core, intervals at most
    2.4 points wide."""
    return AuditConfig(
        shards=shards,
        depths=(2,),
        tail_depths=(2,),
        corpus=CorpusConfig(max_documents=200, max_chunks_per_document=3),
        train=attackers.TrainConfig(epochs=5, max_seconds=120),
        a4_chunks=100,
        noise_sigmas=(),
        privatize=None,
        t0=False,
        basis=KeyedConfig(threats=threats, traffic_tokens=(10_000, 80_000)),
    )


class Audit:
    def __init__(self, config: AuditConfig, model=None, tokenizer=None):
        """`model` / `tokenizer` default to the ones in config.shards (tests pass tiny ones)."""
        from transformers import AutoTokenizer

        from ..model.shards import load_whole_hf

        self.started = time.perf_counter()
        self.config = config
        self.model = model if model is not None else load_whole_hf(config.shards)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(Path(config.shards) / "local", local_files_only=True)
        self.tokenizer = tokenizer
        self.rows: list[dict] = []
        self.outcomes: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # row key -> (mask, top1 on mask)
        self.paired: list[dict] = []
        self.fitted: dict[tuple, attackers.Fitted] = {}
        self.timings: dict[str, float] = {}
        self.extra: dict = {}
        self.keyed_test = None  # the keyed threats' scored rows (keyed.py), when there are no T0 rows

    # -- one row -------------------------------------------------------------------------------------
    def _row(self, key: tuple, pred: np.ndarray, mask: np.ndarray, train_targets: np.ndarray, info: dict) -> None:
        side, depth, threat, attacker, defence = key
        test = self.test
        target = test.target(side)[mask]
        docs, chunks, canary = test.doc[mask], test.chunk[mask], test.canary[mask]
        top1 = pred[:, 0] == target
        top5 = (pred == target[:, None]).any(1)
        base = stats.baselines(train_targets, target, docs)
        learned = attacker.split(" ")[0] in LEARNED
        row = {
            "side": side, "depth": depth, "threat": threat, "attacker": attacker, "defence": defence,
            "top1": float(top1.mean()), "top1_ci": stats.bootstrap_ci(top1, docs, self.config.n_boot),
            "top5": float(top5.mean()), "top5_ci": stats.bootstrap_ci(top5, docs, self.config.n_boot),
            "baseline_top1": base["baseline_top1"], "baseline_top1_ci": base["baseline_top1_ci"],
            "baseline_top5": base["baseline_top5"], "majority_token": base["majority_token"],
            # Learned attackers can only output types they trained on; A1/A4 rank the whole vocabulary.
            "ceiling": base["ceiling"] if learned else 1.0, "train_type_coverage": base["ceiling"],
            "n_tokens": int(mask.sum()), "n_documents": int(len(np.unique(docs))),
            "exact_sequence": stats.exact_sequences(top1, chunks),
            "canary_top1": float(top1[canary].mean()) if canary.any() else None, "canary_tokens": int(canary.sum()),
            "by_frequency": stats.by_bucket(top1, target, train_targets),
            "eval_set": "a4_subset" if mask.sum() < len(mask) else "test",
            "outcomes_top1_hex": stats.pack(top1),
            **info,
        }
        self.rows.append(row)
        self.outcomes[key] = (mask, top1)
        log.info("%s %s k=%d %s %s: top1 %.3f (baseline %.3f)", threat, side, depth, attacker, defence, row["top1"], row["baseline_top1"])

    def _paired(self, a: tuple, b: tuple, what: str) -> None:
        if a not in self.outcomes or b not in self.outcomes:
            return
        (ma, oa), (mb, ob) = self.outcomes[a], self.outcomes[b]
        full_a, full_b = np.zeros(len(ma), bool), np.zeros(len(mb), bool)
        full_a[ma], full_b[mb] = oa, ob
        both = ma & mb
        result = stats.mcnemar(full_a[both], full_b[both])
        self.paired.append({"a": "/".join(map(str, a)), "b": "/".join(map(str, b)), "comparison": what, **result})

    # -- attackers on one (side, depth) ---------------------------------------------------------------
    def attack(self, side: str, depth: int, threat: str, defence: str, x_train, y_train, train_bounds, x_test, exact_ok: bool, reuse_from: tuple | None = None):
        cfg, test, model = self.config, self.test, self.model
        all_rows = np.ones(len(test), bool)
        test_bounds = test.chunk_bounds()
        if side == "input":
            a1 = attackers.embedding_topk(model.model.embed_tokens.weight, x_test)
        else:
            a1 = attackers.lens_topk(model.model.norm, model.lm_head, x_test)
        self._row((side, depth, threat, "A1", defence), a1, all_rows, y_train, {})
        guesses = [a1]
        for name, kind in (("A2", "mlp"), ("A3", "seq")):
            if kind == "seq" and not cfg.seq_attacker:
                continue
            if reuse_from is not None:
                fitted = self.fitted[(*reuse_from, name)]
            else:
                fitted = attackers.fit(kind, x_train, y_train, train_bounds, cfg.train)
                self.fitted[(side, depth, threat, defence, name)] = fitted
            pred = attackers.predict(fitted, x_test, test_bounds)
            info = {"train_seconds": round(fitted.seconds, 1), "epochs_run": fitted.epochs_run, "capped": fitted.capped}
            self._row((side, depth, threat, name, defence), pred, all_rows, y_train, info)
            guesses.insert(0, pred)
        if side == "input":
            # A1 is no pruner on this side (see exact.py); the learned attackers' guesses are.
            self._exact_input(depth, threat, defence, x_test, np.concatenate(guesses[:-1], 1), y_train, exact_ok)
        else:
            stack = exact.tail_stack(model, depth)
            pred = np.concatenate([exact.lens_through_tail(stack, model.model.norm, model.lm_head, x_test[s:e]) for s, e in test_bounds])
            self._row((side, depth, threat, "A4", defence), pred, all_rows, y_train, {"a4": "public tail + norm + LM head"})

    def _exact_input(self, depth, threat, defence, x_test, guesses, y_train, exact_ok):
        test, model = self.test, self.model
        chunk_ids = self.a4_chunk_ids
        mask = np.isin(test.chunk, chunk_ids)
        run = exact.ExactStats()
        config = self.config.exact if exact_ok else self.config.inexact
        stack = exact.head_stack(model, depth)
        bounds = test.chunk_bounds()
        pred = np.concatenate([
            exact.match_chunk(stack, model.model.embed_tokens, self.codebooks[depth], x_test[s:e], guesses[s:e], config, run)
            for i, (s, e) in enumerate(bounds) if i in set(chunk_ids.tolist())
        ])
        info = {"a4": run.as_dict(), "a4_max_candidates": config.max_candidates}
        self._row(("input", depth, threat, "A4", defence), pred, mask, y_train, info)

    # -- the whole audit ---------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.config
        t0 = time.perf_counter()
        corpus = build_corpus(self.tokenizer, cfg.corpus)
        self.corpus = corpus
        self.train = self.test = None
        if cfg.t0:
            self.train = collect(self.model, corpus.train, cfg.depths, cfg.tail_depths)
            self.test = collect(self.model, corpus.test, cfg.depths, cfg.tail_depths)
            self.timings["collect_s"] = time.perf_counter() - t0
        rng = np.random.default_rng(cfg.seed)
        n_chunks = len(corpus.test)
        self.a4_chunk_ids = np.sort(rng.choice(n_chunks, size=min(cfg.a4_chunks, n_chunks), replace=False))
        t0 = time.perf_counter()
        prefix = list(self.tokenizer("\n", add_special_tokens=False)["input_ids"])
        self.codebooks = exact.codebooks(self.model, cfg.depths, prefix)
        self.timings["codebooks_s"] = time.perf_counter() - t0
        if cfg.t0:
            self._baseline()
        from .defences import depth_costs, depth_identification, noise_defence, private_defence

        self.extra["depth_costs"] = depth_costs(self)
        if cfg.t0 and len(cfg.depths) > 1:
            self.extra["depth_identification"] = depth_identification(self)
        if cfg.t0:
            noise_defence(self)
        if cfg.basis is not None:
            from .keyed import basis_threats

            t0 = time.perf_counter()
            basis_threats(self, cfg.basis)
            self.timings["basis_threats_s"] = time.perf_counter() - t0
        if cfg.privatize is not None:
            private_defence(self)
        self._metadata()
        return self.result()

    def _metadata(self) -> None:
        """T6: the observer behind TLS, on real traffic (metadata.py)."""
        if self.config.metadata is None:
            return
        t0 = time.perf_counter()
        rows, self.extra["metadata"] = metadata_threat(self.config.shards, self.config.metadata, self.config.n_boot)
        self.rows += rows
        self.timings["metadata_s"] = time.perf_counter() - t0

    def _baseline(self) -> None:
        """T0: every attacker against the public local weights at every depth, and the paired tests."""
        cfg = self.config
        tb = self.train.chunk_bounds()
        for side, depths in (("input", cfg.depths), ("output", cfg.tail_depths)):
            for d in depths:
                t0 = time.perf_counter()
                self.attack(side, d, "T0", "none", self.train.side(side)[d], self.train.target(side), tb,
                            self.test.side(side)[d], True)
                self.timings[f"T0_{side}_{d}_s"] = time.perf_counter() - t0
        for side, depths in (("input", cfg.depths), ("output", cfg.tail_depths)):
            for att in ("A1", "A2", "A3", "A4"):
                for a, b in zip(depths, depths[1:]):
                    self._paired((side, a, "T0", att, "none"), (side, b, "T0", att, "none"), "depth")
            for d in depths:
                for a, b in (("A1", "A2"), ("A2", "A3"), ("A3", "A4"), ("A2", "A4")):
                    self._paired((side, d, "T0", a, "none"), (side, d, "T0", b, "none"), "attacker")

    def result(self) -> dict:
        test = self.test if self.test is not None else self.keyed_test  # without T0: the keyed rows' tokens
        return {
            "schema": "splitinfer-privacy-audit/1",
            "model": self.config.shards,
            "config": json.loads(json.dumps(asdict(self.config), default=str)),
            "corpus": self.corpus.describe(),
            "targets": {
                "input": "the token at the same position",
                "output": "the model's greedy next token at that position (what the client would generate)",
            },
            "outcomes_format": "outcomes_top1_hex: numpy.packbits of per-token top-1 hits over the row's eval_set, in test order",
            "eval_sets": {
                "test": int(len(test)),
                "a4_subset": {"chunks": self.a4_chunk_ids.tolist(), "n_tokens": int(np.isin(test.chunk, self.a4_chunk_ids).sum())},
            },
            "results": self.rows,
            "paired_tests": self.paired,
            "timings_s": {k: round(v, 1) for k, v in self.timings.items()},
            **self.extra,
        }


def run_audit(config: AuditConfig, out: str | Path, model=None, tokenizer=None) -> dict:
    from .report import write_report

    torch.manual_seed(config.seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if not config.t0 and config.basis is None:  # T6 alone: no model in this process, no corpus
        result = metadata_only(config)
    else:
        result = Audit(config, model, tokenizer).run()
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    if "metadata" in result:  # T6's recorded messages, beside the rows rather than in them
        (out / "traffic.json").write_text(json.dumps(result["metadata"].pop("traces")))
    (out / "audit.json").write_text(json.dumps(result, indent=1))
    if "corpus" in result:
        write_report(result, out)
    else:
        (out / "audit.md").write_text("\n".join(["# Privacy audit: metadata only (T6)", "", *metadata_section(result)]))
    return result


def metadata_only(config: AuditConfig) -> dict:
    """The audit's result with T6 rows only (`privacy audit --metadata-only`)."""
    rows, record = metadata_threat(config.shards, config.metadata, config.n_boot)
    return {"schema": "splitinfer-privacy-audit/1", "model": config.shards,
            "config": json.loads(json.dumps(asdict(config), default=str)), "results": rows, "paired_tests": [],
            "metadata": record}

