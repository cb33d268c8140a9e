"""The defences, each with its utility and throughput cost: split depth, Gaussian noise, private weights.

Depth changes nothing the user sees (the same function is computed) and costs local compute per token,
measured here as the median time of one decode step through the local layers (KV cache, one token).
Noise (sigma times each sent row's RMS, fresh per row) is added to the upstream activations only: the
downstream states are computed by the cloud itself, so client-side noise cannot hide them from it.
Private weights come from `privatize`; T1 and T2 are evaluated against them. The attacker always knows
the defence and trains on defended activations (an adaptive attacker).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch

from . import attackers, exact
from .collect import collect
from .privatize import privatize_model, utility

log = logging.getLogger("splitinfer.privacy")


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


def _first_rows(data, side: str, depth: int, n: int):
    """The first n rows of `data` (the last chunk cut short): features, targets and chunk bounds."""
    n = min(n, len(data))
    bounds = [(s, min(e, n)) for s, e in data.chunk_bounds() if s < n]
    return data.side(side)[depth][:n], data.target(side)[:n], bounds


def _chosen_plaintext(audit, private) -> dict:
    """T2's own text pushed through the private deployment: input side through the head layers only, output
    side through the whole model (its targets are the private model's greedy tokens), up to its own cap.
    A side with no text (the sources ran out, or a cap of 0) is left out, with a warning, not a crash."""
    from .corpus import attacker_text

    cfg, k = audit.config, audit.config.defence_depth
    started = time.perf_counter()
    chunks = attacker_text(audit.tokenizer, cfg.corpus, max(cfg.t2_tokens))
    if not chunks:
        log.warning("T2 skipped: every source document is in the audit's corpus; lower --documents")
        audit.extra["chosen_plaintext"] = {"skipped": "no documents outside the audit's corpus"}
        return {}
    inputs = collect(private, chunks, (k,))  # input side only: the head layers
    input_s = time.perf_counter() - started
    started = time.perf_counter()
    n_out, out_chunks = 0, []
    for chunk in chunks:
        if n_out >= min(cfg.t2_output_tokens, max(cfg.t2_tokens)):
            break
        out_chunks.append(chunk)
        n_out += len(chunk.tokens)
    outputs = collect(private, out_chunks, (k,), (k,)) if out_chunks else None
    audit.timings["T2_collect_input_s"] = input_s
    audit.timings["T2_collect_output_s"] = time.perf_counter() - started
    n_out = len(outputs) if outputs is not None else 0
    log.info("T2: %d chosen-plaintext tokens through %d private layers in %.0f s; %d through the whole model in %.0f s",
             len(inputs), k, input_s, n_out, audit.timings["T2_collect_output_s"])
    audit.extra["chosen_plaintext"] = {
        "documents": len({c.doc_id for c in chunks}), "input_tokens": len(inputs), "output_tokens": n_out,
        "requested": list(cfg.t2_tokens), "output_cap": cfg.t2_output_tokens,
        "shares_documents_with_audit": bool({c.doc_id for c in chunks} & {c.doc_id for c in audit.corpus.train + audit.corpus.test}),
    }
    return {"input": inputs, "output": outputs} if outputs is not None else {"input": inputs}


def private_defence(audit) -> None:
    cfg, k = audit.config, audit.config.defence_depth
    pconf = replace(cfg.privatize, head_layers=k, tail_layers=k)
    private, record = privatize_model(audit.model, [c.tokens for c in audit.corpus.train], pconf)
    audit.timings["privatize_s"] = record["seconds"]
    util = utility(audit.model, private, _utility_chunks(audit))
    ptest = collect(private, audit.corpus.test, (k,), (k,))
    shift = {}
    for side in ("input", "output"):
        a, b = audit.test.side(side)[k].astype(np.float32), ptest.side(side)[k].astype(np.float32)
        shift[side] = float(np.mean(np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(a, axis=-1), 1e-6)))
    audit.extra.setdefault("defences", []).append(
        {"defence": "private weights", "side": "both", "depth": k, "utility": util, "privatize": record,
         "relative_activation_shift": shift, "added_ms_per_token": 0.0}
    )
    own = _chosen_plaintext(audit, private)
    public_test = audit.test
    audit.test = ptest  # rows below are scored on what the private deployment sends
    learned = [("A2", "mlp")] + ([("A3", "seq")] if cfg.seq_attacker else [])
    try:
        tb = audit.train.chunk_bounds()
        for side in ("input", "output"):
            y_public = audit.train.target(side)
            audit.attack(side, k, "T1", "private weights", None, y_public, tb, ptest.side(side)[k], exact_ok=False,
                         reuse_from=(side, k, "T0", "none"))
            for att in ("A1", "A2", "A3", "A4"):
                audit._paired((side, k, "T0", att, "none"), (side, k, "T1", att, "private weights"), "threat")
            if side not in own:
                continue
            limit = len(own[side]) if side == "input" else min(len(own[side]), cfg.t2_output_tokens)
            sizes = sorted({min(n, limit) for n in cfg.t2_tokens})
            for name, kind in learned:
                for n in sizes:
                    x, y, bounds = _first_rows(own[side], side, k, n)
                    fitted = attackers.fit(kind, x, y, bounds, cfg.t2_train)
                    pred = attackers.predict(fitted, ptest.side(side)[k], ptest.chunk_bounds())
                    info = {"train_seconds": round(fitted.seconds, 1), "epochs_run": fitted.epochs_run,
                            "capped": fitted.capped, "chosen_plaintext_tokens": int(len(y))}
                    audit._row((side, k, "T2", f"{name} N={n}", "private weights"), pred, np.ones(len(ptest), bool), y, info)
                    audit.timings[f"T2_{side}_{name}_N{n}_s"] = fitted.seconds
                t2 = lambda n: (side, k, "T2", f"{name} N={n}", "private weights")  # noqa: E731
                audit._paired((side, k, "T1", name, "private weights"), t2(sizes[-1]), "threat")
                for a, b in zip(sizes, sizes[1:]):
                    audit._paired(t2(a), t2(b), "chosen-plaintext tokens")
                if len(sizes) > 2:
                    audit._paired(t2(sizes[0]), t2(sizes[-1]), "chosen-plaintext tokens")
    finally:
        audit.test = public_test


def _row_stats(x: np.ndarray) -> np.ndarray:
    """Per-row summary statistics of sent activations: log RMS, log max |x|, top-8 mass share, mean, std."""
    x = x.astype(np.float32)
    rms = np.sqrt((x**2).mean(-1)) + 1e-6
    top8 = np.sort(np.abs(x), -1)[:, -8:].sum(-1) / (np.abs(x).sum(-1) + 1e-6)
    return np.stack([np.log(rms), np.log(np.abs(x).max(-1) + 1e-6), top8, x.mean(-1), x.std(-1)], -1).astype(np.float16)


SPLIT_RANGE = (2, 4)  # the randomised range docs/privacy.md measures (`prepare --split-range 2-4`)


def _classify_depth(train: dict, test: dict, train_bounds, test_bounds, feats, config) -> dict:
    """Train one depth classifier on {k: [T, d]} rows and score it per row and per session (a test chunk
    seen at one depth, as a cloud session is: majority vote of its rows' guesses)."""
    depths = sorted(train)
    x_tr = np.concatenate([feats(train[k]) for k in depths])
    y_tr = np.concatenate([np.full(len(train[k]), k) for k in depths])
    fitted = attackers.fit("mlp", x_tr, y_tr, [], config)
    rows = sessions = n_rows = n_sessions = 0
    for k in depths:
        guess = attackers.predict(fitted, feats(test[k]), [])[:, 0]
        rows += int((guess == k).sum())
        n_rows += len(guess)
        for s, e in test_bounds:
            values, counts = np.unique(guess[s:e], return_counts=True)
            sessions += int(values[counts.argmax()] == k)
            n_sessions += 1
    return {"row_accuracy": rows / n_rows, "n_rows": n_rows, "session_accuracy": sessions / n_sessions,
            "n_sessions": n_sessions}


def depth_identification(audit, split_range: tuple[int, int] = SPLIT_RANGE) -> dict:
    """Split-point randomisation: can a party that sees the sent activations (but not the handshake, which
    names k) tell the split depth k from them?

    A classifier is trained on the attacker's own text at every depth and scored on the test text, once on
    five per-row statistics and once on the whole vector; chance is 1 / number of depths. Measured for the
    audit's depths (top-level keys) and for the randomised range `split_range` (key "split_range"), where
    it is also scored per session (majority vote over a test chunk's rows).
    """
    depths = audit.config.depths
    small = attackers.TrainConfig(hidden=64, epochs=4, max_seconds=audit.config.train.max_seconds)
    out = {"depths": list(depths), "chance": 1 / len(depths)}
    tb, eb = audit.train.chunk_bounds(), audit.test.chunk_bounds()
    for name, feats in (("row statistics", _row_stats), ("whole vector", lambda x: x)):
        train, test = ({k: part.inputs[k] for k in depths} for part in (audit.train, audit.test))
        out[name] = _classify_depth(train, test, tb, eb, feats, small)
    n_layers = len(audit.model.model.layers)
    low, high = split_range[0], min(split_range[1], n_layers - 2)  # keep a cloud and a tail layer
    if high > low:
        wanted = tuple(range(low, high + 1))
        missing = tuple(k for k in wanted if k not in audit.train.inputs)
        extra = {}
        if missing:  # one more forward pass per chunk for depths the audit did not collect
            extra = {part: collect(audit.model, chunks, missing, (1,)).inputs
                     for part, chunks in (("train", audit.corpus.train), ("test", audit.corpus.test))}
        train = {k: audit.train.inputs[k] if k not in missing else extra["train"][k] for k in wanted}
        test = {k: audit.test.inputs[k] if k not in missing else extra["test"][k] for k in wanted}
        ranged = {"depths": list(wanted), "chance": 1 / len(wanted)}
        for name, feats in (("row statistics", _row_stats), ("whole vector", lambda x: x)):
            ranged[name] = _classify_depth(train, test, tb, eb, feats, small)
        out["split_range"] = ranged
    return out
