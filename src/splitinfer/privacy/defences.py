"""The defences, each with its utility and throughput cost: split depth, Gaussian noise, private weights.

Depth changes nothing the user sees (the same function is computed) and costs local compute per token,
measured here as the median time of one decode step through the local layers (KV cache, one token).
Noise (sigma times each sent row's RMS, fresh per row) is added to the upstream activations only: the
downstream states are computed by the cloud itself, so client-side noise cannot hide them from it.
Private weights come from `privatize`; T1 and T2 are evaluated against them. The attacker always knows
the defence and trains on defended activations (an adaptive attacker).
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch

from . import attackers, exact
from .collect import collect
from .privatize import privatize_model, utility


def _decode_ms(stack, embed, steps: int = 24) -> float:
    cache = stack.new_cache()
    times = []
    with torch.inference_mode():
        for t in range(steps):
            started = time.perf_counter()
            token = torch.tensor([(7 * t + 1) % embed.num_embeddings])
            stack(embed(token)[None], torch.tensor([t]), np.ones((1, 1), bool), cache)
            cache.commit_all()
            times.append(time.perf_counter() - started)
    return float(np.median(times[4:]) * 1000)


def depth_costs(audit) -> list[dict]:
    model, out = audit.model, []
    for side, depths in (("input", audit.config.depths), ("output", audit.config.tail_depths)):
        for d in depths:
            stack = exact.head_stack(model, d) if side == "input" else exact.tail_stack(model, d)
            out.append({"side": side, "depth": d, "local_ms_per_token": round(_decode_ms(stack, model.model.embed_tokens), 2)})
    return out


def _noisy(x: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    x = x.astype(np.float32)
    rms = np.sqrt((x**2).mean(-1, keepdims=True))
    return (x + sigma * rms * rng.standard_normal(x.shape, dtype=np.float32)).astype(np.float16)


def _noise_fn(sigma: float, generator: torch.Generator):
    def perturb(hidden: torch.Tensor) -> torch.Tensor:
        rms = hidden.pow(2).mean(-1, keepdim=True).sqrt()
        return hidden + sigma * rms * torch.randn(hidden.shape, generator=generator, dtype=hidden.dtype)

    return perturb


def _utility_chunks(audit) -> list[list[int]]:
    return [c.tokens for c in audit.corpus.test[: audit.config.utility_chunks]]


def noise_defence(audit) -> None:
    cfg, k = audit.config, audit.config.defence_depth
    rng = np.random.default_rng(cfg.seed + 1)
    tb = audit.train.chunk_bounds()
    head_ms = next(c["local_ms_per_token"] for c in audit.extra["depth_costs"] if c["side"] == "input" and c["depth"] == k)
    records = audit.extra.setdefault("defences", [])
    records.append({"defence": "none", "side": "input", "depth": k, "utility": utility(audit.model, audit.model, _utility_chunks(audit)), "added_ms_per_token": 0.0})
    for sigma in cfg.noise_sigmas:
        name = f"noise sigma={sigma:g}"
        x_train, x_test = _noisy(audit.train.inputs[k], sigma, rng), _noisy(audit.test.inputs[k], sigma, rng)
        audit.attack("input", k, "T0", name, x_train, audit.train.tokens, tb, x_test, exact_ok=False)
        fn = _noise_fn(sigma, torch.Generator().manual_seed(cfg.seed))
        util = utility(audit.model, audit.model, _utility_chunks(audit), perturb={k - 1: fn})
        sample = torch.randn(1, 1, audit.model.config.hidden_size)
        started = time.perf_counter()
        for _ in range(200):
            fn(sample)
        added = (time.perf_counter() - started) / 200 * 1000
        records.append({"defence": name, "side": "input", "depth": k, "utility": util, "added_ms_per_token": round(added, 4), "local_head_ms_per_token": head_ms})
        for att in ("A1", "A2", "A3", "A4"):
            audit._paired(("input", k, "T0", att, "none"), ("input", k, "T0", att, name), "defence")


def _first_tokens(data, n: int):
    """Rows of the first chunks holding about n tokens (whole chunks), and their chunk bounds."""
    bounds = data.chunk_bounds()
    kept = []
    for s, e in bounds:
        if kept and kept[-1][1] >= n:
            break
        kept.append((s, e))
    end = kept[-1][1]
    return end, kept


def private_defence(audit) -> None:
    cfg, k = audit.config, audit.config.defence_depth
    pconf = replace(cfg.privatize, head_layers=k, tail_layers=k)
    private, record = privatize_model(audit.model, [c.tokens for c in audit.corpus.train], pconf)
    util = utility(audit.model, private, _utility_chunks(audit))
    # The chosen-plaintext attacker needs only as many chunks as its largest N (collection is the slow part).
    needed, total = [], 0
    for chunk in audit.corpus.train:
        if total >= max(cfg.t2_tokens):
            break
        needed.append(chunk)
        total += len(chunk.tokens)
    ptrain = collect(private, needed, (k,), (k,))
    ptest = collect(private, audit.corpus.test, (k,), (k,))
    shift = {}
    for side in ("input", "output"):
        a, b = audit.test.side(side)[k].astype(np.float32), ptest.side(side)[k].astype(np.float32)
        shift[side] = float(np.mean(np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(a, axis=-1), 1e-6)))
    audit.extra.setdefault("defences", []).append(
        {"defence": "private weights", "side": "both", "depth": k, "utility": util, "privatize": record,
         "relative_activation_shift": shift, "added_ms_per_token": 0.0}
    )
    public_test = audit.test
    audit.test = ptest  # rows below are scored on what the private deployment sends
    try:
        tb = audit.train.chunk_bounds()
        for side in ("input", "output"):
            y_public = audit.train.target(side)
            audit.attack(side, k, "T1", "private weights", None, y_public, tb, ptest.side(side)[k], exact_ok=False,
                         reuse_from=(side, k, "T0", "none"))
            sizes = sorted({min(n, len(ptrain)) for n in cfg.t2_tokens})
            for n in sizes:
                end, bounds = _first_tokens(ptrain, n)
                x, y = ptrain.side(side)[k][:end], ptrain.target(side)[:end]
                for name, kind in (("A2", "mlp"), ("A3", "seq")):
                    if kind == "seq" and not cfg.seq_attacker:
                        continue
                    fitted = attackers.fit(kind, x, y, bounds, cfg.train)
                    pred = attackers.predict(fitted, ptest.side(side)[k], ptest.chunk_bounds())
                    label = f"{name} N={end}"
                    info = {"train_seconds": round(fitted.seconds, 1), "epochs_run": fitted.epochs_run,
                            "capped": fitted.capped, "chosen_plaintext_tokens": int(end)}
                    audit._row((side, k, "T2", label, "private weights"), pred, np.ones(len(ptest), bool), y, info)
            for att in ("A1", "A2", "A3", "A4"):
                audit._paired((side, k, "T0", att, "none"), (side, k, "T1", att, "private weights"), "threat")
            end_max, _ = _first_tokens(ptrain, sizes[-1])
            audit._paired((side, k, "T1", "A2", "private weights"), (side, k, "T2", f"A2 N={end_max}", "private weights"), "threat")
    finally:
        audit.test = public_test


def _row_stats(x: np.ndarray) -> np.ndarray:
    """Per-row summary statistics of sent activations: log RMS, log max |x|, top-8 mass share, mean, std."""
    x = x.astype(np.float32)
    rms = np.sqrt((x**2).mean(-1)) + 1e-6
    top8 = np.sort(np.abs(x), -1)[:, -8:].sum(-1) / (np.abs(x).sum(-1) + 1e-6)
    return np.stack([np.log(rms), np.log(np.abs(x).max(-1) + 1e-6), top8, x.mean(-1), x.std(-1)], -1).astype(np.float16)


def depth_identification(audit) -> dict:
    """Split-point randomisation, measured only: can the cloud tell the split depth k from what it receives?

    A classifier is trained on the attacker's own text at every depth and scored on the test text, once on
    five per-row statistics and once on the whole vector; chance is 1 / number of depths.
    """
    depths = audit.config.depths
    small = attackers.TrainConfig(hidden=64, epochs=4, max_seconds=audit.config.train.max_seconds)
    out = {"depths": list(depths), "chance": 1 / len(depths)}
    for name, feats in (("row statistics", _row_stats), ("whole vector", lambda x: x)):
        x_tr = np.concatenate([feats(audit.train.inputs[k]) for k in depths])
        y_tr = np.concatenate([np.full(len(audit.train), k) for k in depths])
        x_te = np.concatenate([feats(audit.test.inputs[k]) for k in depths])
        y_te = np.concatenate([np.full(len(audit.test), k) for k in depths])
        fitted = attackers.fit("mlp", x_tr, y_tr, [], small)
        hits = attackers.predict(fitted, x_te, [])[:, 0] == y_te
        out[name] = {"row_accuracy": float(hits.mean()), "n_rows": int(len(hits))}
    return out
