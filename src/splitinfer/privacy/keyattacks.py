"""The attacks on a secret residual basis or linear key itself (privacy/keyed.py runs them as rows T3-T5).

A5 recovers the key from the host's cloud shard by weight matching; A6 reads basis-free inner products
against anchors; A8 aligns the observed and the public activations by their moments. Pure functions of
arrays and layers: no corpus, no audit state, no scoring.
"""

from __future__ import annotations

import time

import numpy as np
import torch


def inner_products(x: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """[T, d] rows, [p, d] anchors -> [T, p + 1]: x . a for every anchor, and |x| (all basis-free)."""
    x = x.astype(np.float32)
    return np.concatenate([x @ anchors.T.astype(np.float32), np.linalg.norm(x, axis=-1, keepdims=True)], 1)


def moment_alignment(public: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """A8: [d, d] estimate R with observed @ R ~ public, from unpaired samples of both bases.

    Covariance eigenvectors correspond between the bases (up to sign) when the eigenvalues are distinct;
    each sign is set so the third moment along the vector agrees.
    """
    def frame(x):
        x = x.astype(np.float64)
        x = x - x.mean(0)
        values, vectors = np.linalg.eigh(x.T @ x / len(x))
        vectors = vectors[:, np.argsort(values)[::-1]]
        skew = ((x @ vectors) ** 3).mean(0)
        return vectors * np.where(skew < 0, -1.0, 1.0)[None]

    return frame(observed) @ frame(public).T


def weight_matching(public_layer, keyed_layer, factor: np.ndarray | None = None) -> tuple[np.ndarray, dict, np.ndarray]:
    """A5: recover R (observed @ R = public) from one cloud layer's MLP and the public layer.

    factor: [d, d] the keyed norm's factor F as read from the cloud shard (None for an orthogonal basis).
    Under a linear key A the layers after a keyed norm read h A F = h Q and hold W diag(g) Q, as under an
    orthogonal basis; the writing ones hold A^T W = F^-T Q^T W, which F^T un-factors. The map back is F Q^T.
    Neurons are permuted and their weights rotated, but each neuron's gate and up row norms, their inner
    product and its down column norm do not change: nearest neighbours in those four numbers name the
    permutation, and least squares on the matched rows gives the rotation (projected onto the orthogonal
    matrices). The public side folds its post-attention norm gain in, as the keyed model did.
    """
    started = time.perf_counter()
    gain = public_layer.post_attention_layernorm.weight.detach().double()
    pub = {n: getattr(public_layer.mlp, n).weight.detach().double() for n in ("gate_proj", "up_proj", "down_proj")}
    key = {n: getattr(keyed_layer.mlp, n).weight.detach().double() for n in ("gate_proj", "up_proj", "down_proj")}
    if factor is not None:
        key["down_proj"] = torch.from_numpy(factor).T @ key["down_proj"]
    pub_gate, pub_up = pub["gate_proj"] * gain[None], pub["up_proj"] * gain[None]

    def invariants(gate, up, down):
        return torch.stack([gate.norm(dim=1), up.norm(dim=1), down.norm(dim=0), (gate * up).sum(1)], 1).numpy()

    a = invariants(pub_gate, pub_up, pub["down_proj"])
    b = invariants(key["gate_proj"], key["up_proj"], key["down_proj"])
    scale = a.std(0) + 1e-12
    from scipy.spatial import cKDTree

    dist, match = cKDTree(a / scale).query(b / scale)  # keyed neuron i was public neuron match[i]
    lhs = torch.cat([pub_gate[match], pub_up[match]]).numpy()  # public rows in keyed order: lhs @ Q = rhs
    rhs = torch.cat([key["gate_proj"], key["up_proj"]]).numpy()
    q_hat, *_ = np.linalg.lstsq(lhs, rhs, rcond=None)
    u, _, vt = np.linalg.svd(q_hat)
    q_hat = u @ vt
    residual = float(np.linalg.norm(lhs @ q_hat - rhs) / np.linalg.norm(rhs))
    record = {"seconds": round(time.perf_counter() - started, 3), "weight_residual": residual,
              "distinct_matches": int(len(np.unique(match))), "neurons": int(len(match)),
              "max_match_distance": float(dist.max()), "used_norm_factor": factor is not None}
    r = q_hat.T if factor is None else factor @ q_hat.T
    return r, record, match  # match: [intermediate] public neuron behind each keyed one
