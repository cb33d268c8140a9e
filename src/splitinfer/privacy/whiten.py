"""A9: recover a general linear key from statistics alone, by whitening and then an orthogonal alignment.

An observer without the cloud shard sees x' = x A for an unknown invertible A. Whitening both sides by
their own covariances, z = (x - mu) C^-1/2 and z' = (x' - mu') C'^-1/2, leaves an orthogonal problem:
z' = z R with R = C^1/2 A C'^-1/2 orthogonal, whatever A was. Any further matrix statistic K that
transforms as R^T K R then names R through its eigenvectors (when its eigenvalues are distinct):

    fobi   E[|z|^2 z^T z]                       fourth moments (FOBI, a classic ICA estimator)
    lag1   E[z_t^T z_t+1 + z_t+1^T z_t] / 2     one-step autocovariance along each sequence (SOBI)
    cross  the other wire direction's covariance in these whitened coordinates (both directions
           carry the same key, and the observer sees both for the same rows)

Each eigenvector's sign is fixed by the anchors (the chat template's opening tokens, whose public states
the observer computes itself and whose keyed states it sees at the start of every session), falling back
to third moments. Of the methods, the attacker keeps the one whose map sends the observed anchors closest
to their public states: a choice it can make without any label. Pure numpy; no model, no training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METHODS = ("fobi", "lag1", "cross")


@dataclass(frozen=True)
class Whitener:
    mean: np.ndarray  # [d]
    w: np.ndarray  # [d, d] C^-1/2
    w_inv: np.ndarray  # [d, d] C^1/2

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return (np.asarray(x, np.float64) - self.mean) @ self.w


def whitener(x: np.ndarray, floor: float = 1e-9) -> Whitener:
    """x: [n, d]. Eigenvalues below floor x the largest are raised to it (float16 rows, few samples)."""
    x = np.asarray(x, np.float64)
    mean = x.mean(0)
    values, vectors = np.linalg.eigh(np.cov(x - mean, rowvar=False))
    values = np.maximum(values, floor * values.max())
    return Whitener(mean, (vectors / np.sqrt(values)) @ vectors.T, (vectors * np.sqrt(values)) @ vectors.T)


def _lag1(z: np.ndarray, bounds: list[tuple[int, int]]) -> np.ndarray:
    pairs = [(z[s : e - 1], z[s + 1 : e]) for s, e in bounds if e - s > 1]
    a, b = np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])
    k = a.T @ b / len(a)
    return (k + k.T) / 2


def statistic(method: str, z: np.ndarray, bounds: list[tuple[int, int]], other: np.ndarray | None) -> np.ndarray | None:
    """The [d, d] matrix `method` uses, in the whitened coordinates z: [n, d]; None where it cannot be formed.
    other: [n, d] whitened-by-this-side rows of the other direction, or None."""
    if method == "fobi":
        return (z * (z * z).sum(1, keepdims=True)).T @ z / len(z)
    if method == "lag1":
        return _lag1(z, bounds)
    if method == "cross":
        if other is None:
            return None
        return np.cov(other, rowvar=False)
    raise ValueError(method)


def _frame(k: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh((k + k.T) / 2)
    return vectors[:, np.argsort(values)[::-1]]


def _signs(e_pub, e_obs, z_pub, z_obs, anchors_pub, anchors_obs) -> np.ndarray:
    """+-1 per eigenvector: agree with the anchors where they project on it, else with third moments."""
    agree = ((anchors_pub @ e_pub) * (anchors_obs @ e_obs)).sum(0)
    skew = ((z_pub @ e_pub) ** 3).mean(0) * ((z_obs @ e_obs) ** 3).mean(0)
    return np.where(agree != 0, np.sign(agree), np.where(skew < 0, -1.0, 1.0))


@dataclass(frozen=True)
class Alignment:
    """observed -> public: x_hat = mu + ((x' - mu') W' R^T) C^1/2, as one affine map."""

    matrix: np.ndarray  # [d, d]
    offset: np.ndarray  # [d]
    method: str

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.float64) @ self.matrix + self.offset


def align(public: dict, observed: dict, method: str) -> Alignment | None:
    """public / observed: {"x": [n, d], "bounds": chunk bounds, "other": [n, d] or None (the other direction,
    same rows), "anchors": [p, d]}, in their own bases. Returns the map, or None if `method` cannot run."""
    wp, wo = whitener(public["x"]), whitener(observed["x"])
    zp, zo = wp(public["x"]), wo(observed["x"])
    other_p = other_o = None
    if public.get("other") is not None and observed.get("other") is not None:
        # The other direction keeps its own mean but is read in this side's whitened coordinates.
        other_p = (public["other"] - public["other"].mean(0)) @ wp.w
        other_o = (observed["other"] - observed["other"].mean(0)) @ wo.w
    kp, ko = statistic(method, zp, public["bounds"], other_p), statistic(method, zo, observed["bounds"], other_o)
    if kp is None or ko is None:
        return None
    ep, eo = _frame(kp), _frame(ko)
    eo = eo * _signs(ep, eo, zp, zo, wp(public["anchors"]), wo(observed["anchors"]))[None]
    r_t = eo @ ep.T  # z = z' R^T
    matrix = wo.w @ r_t @ wp.w_inv
    return Alignment(matrix, wp.mean - wo.mean @ matrix, method)


def anchor_residual(alignment: Alignment, anchors_pub: np.ndarray, anchors_obs: np.ndarray) -> float:
    """Relative distance between the mapped observed anchors and their public states (label-free score)."""
    mapped = alignment(anchors_obs)
    return float(np.linalg.norm(mapped - anchors_pub) / np.linalg.norm(anchors_pub))


def best_alignment(public: dict, observed: dict, methods: tuple[str, ...] = METHODS) -> tuple[Alignment | None, dict]:
    """Every method that can run; the one with the smallest anchor residual, and each one's residual."""
    scores, best = {}, None
    for method in methods:
        found = align(public, observed, method)
        if found is None:
            continue
        scores[method] = anchor_residual(found, public["anchors"], observed["anchors"])
        if best is None or scores[method] < scores[best.method]:
            best = found
    return best, scores
