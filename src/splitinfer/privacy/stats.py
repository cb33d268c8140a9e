"""Statistics for the audit: rates with bootstrap intervals over documents, exact McNemar tests, buckets.

Tokens of one document are not independent (a document repeats its words), so intervals resample whole
documents, not tokens. Comparisons between two attackers, or two depths, use the same tokens and an exact
McNemar test: a two-sided binomial test on the discordant pairs (scipy.stats.binomtest).
Per-token outcomes are stored as hex of packed bits so the JSON keeps them for every row at little cost.
"""

from __future__ import annotations

import numpy as np

# Training-frequency buckets of a test token's type (how often the attacker saw it in training).
BUCKETS = (("unseen", 0, 0), ("rare 1-4", 1, 4), ("mid 5-49", 5, 49), ("frequent 50+", 50, None))


def bootstrap_ci(correct: np.ndarray, docs: np.ndarray, n_boot: int = 1000, seed: int = 0) -> list[float]:
    """95% percentile interval of the pooled rate, resampling documents with replacement."""
    if len(correct) == 0:
        return [float("nan"), float("nan")]
    unique, inverse = np.unique(docs, return_inverse=True)
    hits = np.bincount(inverse, weights=correct.astype(float), minlength=len(unique))
    sizes = np.bincount(inverse, minlength=len(unique)).astype(float)
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(len(unique), np.full(len(unique), 1 / len(unique)), size=n_boot)  # [B, D]
    rates = (weights @ hits) / np.maximum(weights @ sizes, 1)
    low, high = np.percentile(rates, [2.5, 97.5])
    return [float(low), float(high)]


def mcnemar(a: np.ndarray, b: np.ndarray) -> dict:
    """Exact McNemar on paired outcomes: n01 = a wrong & b right, n10 = a right & b wrong."""
    from scipy.stats import binomtest

    a, b = a.astype(bool), b.astype(bool)
    n01 = int((~a & b).sum())
    n10 = int((a & ~b).sum())
    p = 1.0 if n01 + n10 == 0 else float(binomtest(n01, n01 + n10, 0.5).pvalue)
    return {"n01": n01, "n10": n10, "p_value": p, "n_tokens": int(len(a))}


def frequency_prior(train_targets: np.ndarray, k: int = 5) -> np.ndarray:
    """The k most frequent training targets, most frequent first (ties broken by lower id)."""
    ids, counts = np.unique(train_targets, return_counts=True)
    order = np.lexsort((ids, -counts))
    return ids[order[:k]]


def baselines(train_targets: np.ndarray, test_targets: np.ndarray, test_docs: np.ndarray) -> dict:
    """Majority token (= frequency-prior top-1), frequency-prior top-5 and the learned attackers' ceiling."""
    prior = frequency_prior(train_targets)
    top1 = test_targets == prior[0]
    top5 = np.isin(test_targets, prior)
    seen = np.isin(test_targets, np.unique(train_targets))
    return {
        "majority_token": int(prior[0]),
        "baseline_top1": float(top1.mean()),
        "baseline_top1_ci": bootstrap_ci(top1, test_docs),
        "baseline_top5": float(top5.mean()),
        "ceiling": float(seen.mean()),
    }


def by_bucket(correct: np.ndarray, test_targets: np.ndarray, train_targets: np.ndarray) -> dict:
    ids, counts = np.unique(train_targets, return_counts=True)
    freq = dict(zip(ids.tolist(), counts.tolist()))
    seen = np.array([freq.get(int(t), 0) for t in test_targets])
    out = {}
    for name, low, high in BUCKETS:
        mask = (seen >= low) & (seen <= (high if high is not None else np.inf))
        out[name] = {"n": int(mask.sum()), "top1": float(correct[mask].mean()) if mask.any() else None}
    return out


def exact_sequences(correct: np.ndarray, chunks: np.ndarray) -> float:
    """Share of chunks whose every token was recovered top-1."""
    unique, inverse = np.unique(chunks, return_inverse=True)
    wrong = np.bincount(inverse, weights=(~correct.astype(bool)).astype(float), minlength=len(unique))
    return float((wrong == 0).mean())


def pack(outcomes: np.ndarray) -> str:
    return np.packbits(outcomes.astype(bool)).tobytes().hex()


def unpack(hex_bits: str, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(bytes.fromhex(hex_bits), dtype=np.uint8))[:n].astype(bool)
