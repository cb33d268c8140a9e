"""Threats against a secret residual basis (privacy/basis.py): rows T3, T4 and T5 of the audit.

T3  an observer without the cloud shard (a tap behind TLS termination, logs, a dumped KV cache): it sees
    the keyed activations h Q and holds the public weights. Attackers: A1 and A4 with the public weights;
    A2/A3 trained on public-basis activations of its own text; A6, inner products with anchors (Q keeps
    inner products; every session starts with the same chat-template tokens, whose public states the
    observer computes, so x . a is known in both bases); A8, statistical alignment (eigenvectors of the
    observed and the public activation covariance, signs fixed by third moments) followed by A2.
T4  the host with the cloud shard: A5 matches the first cloud layer's MLP against the public one (per-
    neuron norms are blind to Q and name the permutation; least squares then gives Q), then A4.
T5  known plaintext: A7 learns the linear map back to the public basis from N (text, activation) pairs
    by least squares, then A2 and A4 (nearest of 64 candidates).

Every session, the audit's and the attacker's own, starts with the chat template's opening tokens;
rows are scored on the text after it. This module builds the keyed model and the collections and calls
the audit's attackers and row writer; it knows no statistics of its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from . import attackers, exact
from .basis import BasisConfig, apply_basis
from .collect import Collected, collect
from .corpus import Chunk, attacker_text

log = logging.getLogger("splitinfer.privacy")
DEFENCE = "secret basis"
MARKER = "\u2063MARK\u2063"
FALLBACK_TEMPLATE = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"


@dataclass(frozen=True)
class KeyedConfig:
    t5_pairs: tuple[int, ...] = (100, 1_000, 10_000)  # known (text, activation) pairs for A7
    seed: int = 12345  # the audit's basis (a real deployment draws its own from the OS)


def template_ids(tokenizer) -> list[int]:
    """The tokens every chat session starts with (the template up to the user's text)."""
    text = FALLBACK_TEMPLATE
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False)
        text = rendered.split(MARKER)[0]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _prefixed(chunks: list[Chunk], prefix: list[int]) -> list[Chunk]:
    return [Chunk(c.doc_id, c.source, prefix + c.tokens, 0) for c in chunks]


def _body(full: Collected, chunks: list[Chunk], p: int) -> Collected:
    """The rows after the template (what is scored), with the chunks' canary marks restored."""
    keep = full.pos >= p
    canary_len = np.array([c.canary_len for c in chunks])[full.chunk]
    canary = (full.pos >= p) & (full.pos < p + canary_len)
    return Collected(
        tokens=full.tokens[keep], greedy=full.greedy[keep], doc=full.doc[keep], chunk=full.chunk[keep],
        pos=full.pos[keep] - p, canary=canary[keep],
        inputs={k: v[keep] for k, v in full.inputs.items()}, outputs={m: v[keep] for m, v in full.outputs.items()},
    )


def _pred_a4_input(audit, stack, rows: np.ndarray, full: Collected, p: int, guesses: np.ndarray,
                   config) -> tuple[np.ndarray, dict]:
    """A4 on the a4 chunks' whole sequences (template included, as a session is); body predictions only.
    rows: [T_full, d] (already mapped to the public basis by the attacker); guesses: [T_body, g]."""
    model = audit.model
    run = exact.ExactStats()
    body_bounds = audit.test.chunk_bounds()
    preds = []
    for i, ((s, e), (bs, be)) in enumerate(zip(full.chunk_bounds(), body_bounds)):
        if i not in set(audit.a4_chunk_ids.tolist()):
            continue
        g = np.concatenate([np.zeros((p, guesses.shape[1]), np.int64), guesses[bs:be]])
        g[:p, 0] = full.tokens[s : s + p]  # the template is public: the attacker's first guess there
        pred = exact.match_chunk(stack, model.model.embed_tokens, audit.codebooks[audit.config.defence_depth],
                                 rows[s:e], g, config, run)
        preds.append(pred[p:])
    return np.concatenate(preds), {"a4": run.as_dict(), "a4_max_candidates": config.max_candidates}


def _pred_a4_output(audit, rows: np.ndarray, full: Collected, p: int) -> np.ndarray:
    model, m = audit.model, audit.config.defence_depth
    stack = exact.tail_stack(model, m)
    return np.concatenate([exact.lens_through_tail(stack, model.model.norm, model.lm_head, rows[s:e])[p:]
                           for s, e in full.chunk_bounds()])


def _a4_mask(audit) -> np.ndarray:
    return np.isin(audit.test.chunk, audit.a4_chunk_ids)


def _fit_or_reuse(state: dict, name: str, kind: str, x, y, bounds, config):
    if name not in state:
        state[name] = attackers.fit(kind, x, y, bounds, config)
    return state[name]


def _info(fitted) -> dict:
    return {"train_seconds": round(fitted.seconds, 1), "epochs_run": fitted.epochs_run, "capped": fitted.capped}


def _inner_products(x: np.ndarray, anchors: np.ndarray) -> np.ndarray:
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


def weight_matching(public_layer, keyed_layer) -> tuple[np.ndarray, dict, np.ndarray]:
    """A5: recover R (observed @ R = public) from one cloud layer's MLP and the public layer.

    Neurons are permuted and their weights rotated, but each neuron's gate and up row norms, their inner
    product and its down column norm do not change: nearest neighbours in those four numbers name the
    permutation, and least squares on the matched rows gives the rotation (projected onto the orthogonal
    matrices). The public side folds its post-attention norm gain in, as the keyed model did.
    """
    started = time.perf_counter()
    gain = public_layer.post_attention_layernorm.weight.detach().double()
    pub = {n: getattr(public_layer.mlp, n).weight.detach().double() for n in ("gate_proj", "up_proj", "down_proj")}
    key = {n: getattr(keyed_layer.mlp, n).weight.detach().double() for n in ("gate_proj", "up_proj", "down_proj")}
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
              "max_match_distance": float(dist.max())}
    return q_hat.T, record, match  # match: [intermediate] public neuron behind each keyed one


def basis_threats(audit, config: KeyedConfig = KeyedConfig()) -> None:
    """Add the T3, T4 and T5 rows (input side at k, output side at m = k, k = the audit's defence depth)."""
    cfg, k = audit.config, audit.config.defence_depth
    started = time.perf_counter()
    keyed, secret, record = apply_basis(audit.model, BasisConfig(seed=config.seed))
    q = secret.q.numpy()
    prefix = template_ids(audit.tokenizer)
    p = len(prefix)
    train_chunks, test_chunks = audit.corpus.train, audit.corpus.test
    pub_full = collect(audit.model, _prefixed(train_chunks, prefix), (k,), (k,))
    obs_train_full = collect(keyed, _prefixed(train_chunks, prefix), (k,), (k,))
    obs_full = collect(keyed, _prefixed(test_chunks, prefix), (k,), (k,))
    pub_train, obs_train = _body(pub_full, train_chunks, p), _body(obs_train_full, train_chunks, p)
    audit.timings["keyed_collect_s"] = time.perf_counter() - started
    public_test, audit.test = audit.test, _body(obs_full, test_chunks, p)
    # The secret, for measuring how close each attacker's estimate comes (attackers never read it).
    state: dict = {"q": q, "neuron_perms": secret.neuron_perms, "obs_full": obs_full, "train_targets": pub_train.tokens}
    try:
        for side in ("input", "output"):
            _t3(audit, side, k, pub_train, pub_full, obs_train, obs_full, p, state)
            _t4(audit, side, k, keyed, obs_full, p, state)
        _t5(audit, k, keyed, prefix, config, state)
    finally:
        audit.test = public_test
    audit.extra["secret_basis"] = {
        "basis": record, "template_tokens": p, "anchors": p, "seed": config.seed,
        "t4": state.get("t4"), "alignment_error": state.get("alignment_error"),
        "keyed_seconds": round(time.perf_counter() - started, 1),
        "note": "rows are scored on the text after the chat template's opening tokens",
    }


def _t3(audit, side, k, pub_train, pub_full, obs_train, obs_full, p, state) -> None:
    cfg = audit.config
    tb, eb = pub_train.chunk_bounds(), audit.test.chunk_bounds()
    x_pub, y = pub_train.side(side)[k], pub_train.target(side)
    x_obs = audit.test.side(side)[k]
    all_rows = np.ones(len(audit.test), bool)
    model = audit.model
    if side == "input":
        a1 = attackers.embedding_topk(model.model.embed_tokens.weight, x_obs)
    else:
        a1 = attackers.lens_topk(model.model.norm, model.lm_head, x_obs)
    audit._row((side, k, "T3", "A1", DEFENCE), a1, all_rows, y, {})
    guesses = [a1]
    for name, kind in (("A2", "mlp"), ("A3", "seq")):
        if kind == "seq" and not cfg.seq_attacker:
            continue
        fitted = _fit_or_reuse(state, (side, name), kind, x_pub, y, tb, cfg.train)
        pred = attackers.predict(fitted, x_obs, eb)
        audit._row((side, k, "T3", name, DEFENCE), pred, all_rows, y, _info(fitted))
        guesses.insert(0, pred)
    full_rows = obs_full.side(side)[k]
    if side == "input":
        stack = exact.head_stack(model, k)
        pred, info = _pred_a4_input(audit, stack, full_rows, obs_full, p, np.concatenate(guesses[:-1], 1), cfg.inexact)
        audit._row((side, k, "T3", "A4", DEFENCE), pred, _a4_mask(audit), y, info)
    else:
        audit._row((side, k, "T3", "A4", DEFENCE), _pred_a4_output(audit, full_rows, obs_full, p), all_rows, y,
                   {"a4": "public tail + norm + LM head on the keyed states"})
    # A6: inner products with the template's states, public basis (its own text) vs observed basis.
    anchors_pub, anchors_obs = pub_full.side(side)[k][:p], obs_full.side(side)[k][:p]
    fitted = attackers.fit("mlp", _inner_products(x_pub, anchors_pub), y, tb, cfg.train)
    pred = attackers.predict(fitted, _inner_products(x_obs, anchors_obs), eb)
    audit._row((side, k, "T3", f"A6 inner products ({p} anchors)", DEFENCE), pred, all_rows, y, _info(fitted))
    # A8: align the observed traffic's statistics (train text, unlabelled) to the public ones, then A2.
    r = moment_alignment(x_pub, obs_train.side(side)[k])
    state.setdefault("alignment_error", {})[side] = _rotation_error(r, audit, state)
    a2 = state[(side, "A2")]
    pred = attackers.predict(a2, (x_obs.astype(np.float32) @ r).astype(np.float16), eb)
    audit._row((side, k, "T3", "A8 moment alignment + A2", DEFENCE), pred, all_rows, y,
               {"rotation_error": state["alignment_error"][side]})


def _rotation_error(r: np.ndarray, audit, state) -> float:
    """Relative Frobenius error of an estimate R of Q^T (observed @ R = public)."""
    q = state.get("q")
    return None if q is None else float(np.linalg.norm(r - q.T) / np.linalg.norm(q))


def _t4(audit, side, k, keyed, obs_full, p, state) -> None:
    cfg = audit.config
    layer = k  # the first cloud layer: the host holds it
    if "t4_r" not in state:
        r, record, match = weight_matching(audit.model.model.layers[layer], keyed.model.layers[layer])
        record["rotation_error"] = _rotation_error(r, audit, state)
        record["permutation_recovered"] = float((match == state["neuron_perms"][layer].numpy()).mean())
        record["layer"] = layer
        state["t4"], state["t4_r"] = record, r
    r, record = state["t4_r"], state["t4"]
    derotated = (obs_full.side(side)[k].astype(np.float32) @ r).astype(np.float32)
    y = audit.test.target(side)
    if side == "input":
        exact_ok = record["weight_residual"] < 1e-3
        stack = exact.head_stack(audit.model, k)
        body = _body(replace(obs_full, inputs={k: derotated.astype(np.float16)}), audit.corpus.test, p)
        a2 = state[(side, "A2")]
        guesses = attackers.predict(a2, body.inputs[k], audit.test.chunk_bounds())
        search = cfg.exact if exact_ok else cfg.inexact
        pred, info = _pred_a4_input(audit, stack, derotated, obs_full, p, guesses, search)
        key = (side, k, "T4", "A5 weight matching + A4", DEFENCE)
        audit._row(key, pred, _a4_mask(audit), y, {**info, "a5": record})
    else:
        audit._row((side, k, "T4", "A5 weight matching + A4", DEFENCE), _pred_a4_output(audit, derotated, obs_full, p),
                   np.ones(len(audit.test), bool), y, {"a5": record})


def _t5(audit, k, keyed, prefix, config: KeyedConfig, state) -> None:
    """A7 on the input side: N known (text, activation) pairs of the attacker's own text -> least squares."""
    cfg, p = audit.config, len(prefix)
    chunks = attacker_text(audit.tokenizer, cfg.corpus, max(config.t5_pairs))
    if not chunks:
        log.warning("T5 skipped: every source document is in the audit's corpus; lower --documents")
        return
    started = time.perf_counter()
    pub = _body(collect(audit.model, _prefixed(chunks, prefix), (k,)), chunks, p).inputs[k].astype(np.float64)
    obs = _body(collect(keyed, _prefixed(chunks, prefix), (k,)), chunks, p).inputs[k].astype(np.float64)
    audit.timings["T5_collect_s"] = time.perf_counter() - started
    x_obs, a2 = audit.test.inputs[k].astype(np.float64), state[("input", "A2")]
    train_targets = state["train_targets"]
    stack = exact.head_stack(audit.model, k)
    obs_full = state["obs_full"]
    for n in sorted({min(n, len(pub)) for n in config.t5_pairs}):
        t0 = time.perf_counter()
        r, *_ = np.linalg.lstsq(obs[:n], pub[:n], rcond=None)  # minimum norm below d pairs
        fit_s = time.perf_counter() - t0
        info = {"known_pairs": int(n), "fit_seconds": round(fit_s, 3),
                "rotation_error": _rotation_error(r, audit, state)}
        test = (x_obs @ r).astype(np.float16)
        pred = attackers.predict(a2, test, audit.test.chunk_bounds())
        everything = np.ones(len(audit.test), bool)
        audit._row(("input", k, "T5", f"A7 N={n} + A2", DEFENCE), pred, everything, train_targets, info)
        rows = (obs_full.inputs[k].astype(np.float64) @ r).astype(np.float32)
        a4, a4_info = _pred_a4_input(audit, stack, rows, obs_full, p, pred, cfg.inexact)
        key = ("input", k, "T5", f"A7 N={n} + A4", DEFENCE)
        audit._row(key, a4, _a4_mask(audit), train_targets, {**info, **a4_info})
        audit.timings[f"T5_N{n}_s"] = time.perf_counter() - t0
    audit.extra["secret_basis_t5"] = {"pairs_available": int(len(pub)), "documents": len({c.doc_id for c in chunks})}
