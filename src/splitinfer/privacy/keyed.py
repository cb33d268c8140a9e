"""Threats against a secret residual basis (privacy/basis.py): rows T3, T4 and T5 of the audit.

Two deployments are measured, each with its own rows: an orthogonal basis Q (defence "secret basis") and a
general linear key A with keyed RMSNorms (defence "secret linear key", `privatize --basis --key linear`).

T3  an observer without the cloud shard (a tap behind TLS termination, logs, a dumped KV cache): it sees
    the keyed activations h A and holds the public weights. Attackers: A1 and A4 with the public weights;
    A2/A3 trained on public-basis activations of its own text; A6, inner products with anchors (an
    orthogonal basis keeps them; every session starts with the same chat-template tokens, whose public
    states the observer computes, so x . a is known in both bases); A8, statistical alignment
    (eigenvectors of the observed and the public activation covariance, signs fixed by third moments)
    followed by A2; A9, whitening and an orthogonal alignment by higher-order or temporal statistics
    (privacy/whiten.py), which any invertible linear key reduces to, followed by A2 and A4. A8 and A9 align the
    sessions' own traffic (input side: plus other sessions', one set per `traffic_tokens`) to the attacker's text.
T4  the host with the cloud shard: a keyed norm's factor F gives A up to an orthogonal matrix (A F is
    orthogonal), so A5 un-factors the first cloud layer and matches its MLP against the public one (per-
    neuron norms are blind to the rotation and name the permutation; least squares then gives it), then A4.
T5  known plaintext: A7 learns the linear map back to the public basis from N (text, activation) pairs
    by least squares, then A2 and A4 (nearest of 64 candidates); and A8 / A9 on traffic of exactly the
    attacker's own documents, unpaired (it knows which texts were sent, not which row is which).

The keyed activations are the public model's float32 states times A, rounded to float16 as on the wire:
the keyed model computes exactly that (checked on one chunk per key: `identity_error`), and the audit
is spared a forward pass of each keyed model over every chunk. Every session, the audit's and the
attacker's own, starts with the chat template's opening tokens; rows are scored on the text after it.
`KeyedConfig.threats` picks which of T3-T5 run. This module builds the keyed models and the collections and calls the audit's attackers and row writer;
it knows no statistics of its own: the attacks on the key itself (A5, A6, A8) are in keyattacks.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..errors import ConfigError
from ..model.keyed_norm import KeyedRMSNorm
from . import attackers, exact
from .basis import BasisConfig, apply_basis
from .collect import Collected, collect
from .corpus import Chunk, attacker_text
from .keyattacks import inner_products, moment_alignment, weight_matching
from .whiten import best_alignment

log = logging.getLogger("splitinfer.privacy")
DEFENCES = {"orthogonal": "secret basis", "linear": "secret linear key"}
EXTRA = {"orthogonal": "secret_basis", "linear": "secret_linear_key"}  # audit.json keys of each key's record
THREATS = ("T3", "T4", "T5")
MARKER = "\u2063MARK\u2063"
FALLBACK_TEMPLATE = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"


@dataclass(frozen=True)
class KeyedConfig:
    t5_pairs: tuple[int, ...] = (100, 1_000, 10_000)  # known (text, activation) pairs for A7
    seed: int = 12345  # the audit's basis (a real deployment draws its own from the OS)
    keys: tuple[str, ...] = ("linear", "orthogonal")  # the deployments measured (basis.KEYS), rows for each
    condition: float = 8.0  # the linear key's condition number (BasisConfig.condition)
    metric_block: int = 64  # the linear key's norm-factor block (BasisConfig.metric_block)
    t5_a4_from: int = 0  # A4 after A7 fits from this N on (the largest N measured at most): the slowest rows
    a9_a4: bool = True  # A4 after the input side's A9 on the most traffic
    threats: tuple[str, ...] = THREATS  # which of T3, T4, T5 run (`privacy audit --threats T3`: the observer alone)
    # The attacker's other text, from documents the corpus does not use: T5's known pairs come from it, and keyed,
    # its first N tokens (whole chunks) are other sessions' traffic that T3's input-side A8 / A9 also align on,
    # one set per N here (A4 after A9 on the largest). Every set holds the attacked sessions' own traffic too.
    traffic_tokens: tuple[int, ...] = (10_000,)

    def __post_init__(self):
        if not self.threats or not set(self.threats) <= set(THREATS):
            raise ConfigError(f"--threats takes a comma-separated subset of {', '.join(THREATS)}, not "
                              f"{','.join(self.threats) or 'nothing'}.")


@dataclass
class _Public:
    """What every key's rows share: public-basis collections (float32: keyed views are made from them) and
    the attackers trained on public-basis activations."""

    prefix_len: int  # template tokens at the start of every sequence
    train_full: Collected  # template + train chunks, both sides, float32
    test_full: Collected  # template + test chunks, both sides, float32
    train: Collected  # the train text after the template, float16: what A2/A3 train on
    t5: Collected | None  # template + the attacker's other text, input side only, float32 (T5 pairs, A9 traffic)
    fitted: dict  # (side, attacker name) -> attackers.Fitted


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


def keyed_view(collected: Collected, a: np.ndarray) -> Collected:
    """What a deployment keyed by A sends: float32 public states times A, rounded to float16 (the wire)."""
    def key(rows: dict) -> dict:
        return {depth: (v.astype(np.float64) @ a).astype(np.float16) for depth, v in rows.items()}

    return replace(collected, inputs=key(collected.inputs), outputs=key(collected.outputs))


def _rounded(collected: Collected) -> Collected:
    def cast(rows: dict) -> dict:
        return {depth: v.astype(np.float16) for depth, v in rows.items()}

    return replace(collected, inputs=cast(collected.inputs), outputs=cast(collected.outputs))


def _identity_error(audit, keyed, prefix: list[int], a: np.ndarray, k: int) -> float:
    """Max relative difference between what the keyed model sends on one test chunk (both sides) and the
    public states times A that the rows below are computed from."""
    chunk = _prefixed(audit.corpus.test[:1], prefix)
    got = collect(keyed, chunk, (k,), (k,), torch.float32)
    want = collect(audit.model, chunk, (k,), (k,), torch.float32)
    errors = []
    for side in ("input", "output"):
        expected = want.side(side)[k].astype(np.float64) @ a
        errors.append(np.abs(got.side(side)[k] - expected).max() / np.abs(expected).max())
    return float(max(errors))


def basis_threats(audit, config: KeyedConfig = KeyedConfig()) -> None:
    """Add the rows of config.threats (T3, T4, T5) for each key in config.keys (input side at k, output side at
    m = k, k = the audit's defence depth)."""
    k = audit.config.defence_depth
    started = time.perf_counter()
    prefix = template_ids(audit.tokenizer)
    p = len(prefix)
    train_chunks, test_chunks = audit.corpus.train, audit.corpus.test
    train_full = collect(audit.model, _prefixed(train_chunks, prefix), (k,), (k,), torch.float32)
    test_full = collect(audit.model, _prefixed(test_chunks, prefix), (k,), (k,), torch.float32)
    pub = _Public(p, train_full, test_full, _body(_rounded(train_full), train_chunks, p),
                  _t5_public(audit, k, prefix, config), {})
    audit.timings["keyed_collect_s"] = time.perf_counter() - started
    public_test = audit.test
    try:
        for key in config.keys:
            t0 = time.perf_counter()
            _one_key(audit, key, config, pub, prefix)
            audit.timings[f"keyed_{key}_s"] = time.perf_counter() - t0
            # What an audit of the keys so far took (the first key carries the shared collections and fits).
            audit.timings[f"elapsed_after_{key}_s"] = time.perf_counter() - audit.started
    finally:
        audit.keyed_test, audit.test = audit.test, public_test


def _one_key(audit, key: str, config: KeyedConfig, pub: _Public, prefix: list[int]) -> None:
    k, p = audit.config.defence_depth, pub.prefix_len
    t0 = time.perf_counter()
    basis = BasisConfig(seed=config.seed, key=key, condition=config.condition, metric_block=config.metric_block)
    keyed, secret, record = apply_basis(audit.model, basis)
    a = secret.a.numpy()
    obs_full = keyed_view(pub.test_full, a)
    record["identity_error"] = _identity_error(audit, keyed, prefix, a, k)
    audit.timings[f"keyed_{key}_build_s"] = time.perf_counter() - t0
    audit.test = _body(obs_full, audit.corpus.test, p)
    # The secret, for measuring how close each attacker's estimate comes (attackers never read it).
    state: dict = {"inverse": np.linalg.inv(a), "neuron_perms": secret.neuron_perms, "defence": DEFENCES[key],
                   "obs_full": obs_full, "obs_train": _body(keyed_view(pub.train_full, a), audit.corpus.train, p),
                   "pub": pub, "a": a, "config": config}
    threats = config.threats
    for side in ("input", "output"):
        if "T3" in threats:
            _t3(audit, side, k, state)
        _aligned(audit, side, k, state)  # A8 / A9: T3's on the sessions' traffic, T5's on its own text
        if "T4" in threats:
            _t4(audit, side, k, keyed, state)
    if "T5" in threats:
        _t5(audit, k, state)
    audit.extra[EXTRA[key]] = {
        "basis": record, "template_tokens": p, "anchors": p, "seed": config.seed,
        "t4": state.get("t4"), "alignment_error": state.get("alignment_error"), "a9": state.get("a9"),
        "keyed_seconds": round(time.perf_counter() - t0, 1),
        "note": "rows are scored on the text after the chat template's opening tokens",
    }


def _t5_public(audit, k: int, prefix: list[int], config: KeyedConfig) -> Collected | None:
    """The attacker's other text through the public layers [0, k), after the template (float32)."""
    chunks = attacker_text(audit.tokenizer, audit.config.corpus, max(*config.t5_pairs, *config.traffic_tokens))
    if not chunks:
        log.warning("T5 skipped: every source document is in the audit's corpus; lower --documents")
        return None
    started = time.perf_counter()
    body = _body(collect(audit.model, _prefixed(chunks, prefix), (k,), dtype=torch.float32), chunks, len(prefix))
    audit.timings["T5_collect_s"] = time.perf_counter() - started
    audit.extra["secret_basis_t5"] = {"pairs_available": int(len(body)), "documents": len({c.doc_id for c in chunks})}
    return body


def _t3(audit, side, k, state) -> None:
    cfg, pub, defence = audit.config, state["pub"], state["defence"]
    p = pub.prefix_len
    tb, eb = pub.train.chunk_bounds(), audit.test.chunk_bounds()
    x_pub, y = pub.train.side(side)[k], pub.train.target(side)
    x_obs = audit.test.side(side)[k]
    all_rows = np.ones(len(audit.test), bool)
    model = audit.model
    if side == "input":
        a1 = attackers.embedding_topk(model.model.embed_tokens.weight, x_obs)
    else:
        a1 = attackers.lens_topk(model.model.norm, model.lm_head, x_obs)
    audit._row((side, k, "T3", "A1", defence), a1, all_rows, y, {})
    guesses = [a1]
    for name, kind in (("A2", "mlp"), ("A3", "seq")):
        if kind == "seq" and not cfg.seq_attacker:
            continue
        fitted = _fit_or_reuse(pub.fitted, (side, name), kind, x_pub, y, tb, cfg.train)
        pred = attackers.predict(fitted, x_obs, eb)
        audit._row((side, k, "T3", name, defence), pred, all_rows, y, _info(fitted))
        guesses.insert(0, pred)
    obs_full = state["obs_full"]
    full_rows = obs_full.side(side)[k]
    if side == "input":
        stack = exact.head_stack(model, k)
        pred, info = _pred_a4_input(audit, stack, full_rows, obs_full, p, np.concatenate(guesses[:-1], 1), cfg.inexact)
        audit._row((side, k, "T3", "A4", defence), pred, _a4_mask(audit), y, info)
    else:
        audit._row((side, k, "T3", "A4", defence), _pred_a4_output(audit, full_rows, obs_full, p), all_rows, y,
                   {"a4": "public tail + norm + LM head on the keyed states"})
    _inner_products(audit, side, k, state)


def _a2(audit, pub: _Public, side: str, k: int):
    """A2 trained on the public-basis activations of the attacker's text (what every aligned attack feeds)."""
    return _fit_or_reuse(pub.fitted, (side, "A2"), "mlp", pub.train.side(side)[k], pub.train.target(side),
                         pub.train.chunk_bounds(), audit.config.train)


def _inner_products(audit, side, k, state) -> None:
    """A6: inner products with the template's states (an orthogonal key keeps them)."""
    cfg, pub, defence = audit.config, state["pub"], state["defence"]
    p, y = pub.prefix_len, pub.train.target(side)
    tb, eb = pub.train.chunk_bounds(), audit.test.chunk_bounds()
    x_pub, x_obs = pub.train.side(side)[k], audit.test.side(side)[k]
    anchors_pub, anchors_obs = pub.train_full.side(side)[k][:p], state["obs_full"].side(side)[k][:p]
    fitted = _fit_or_reuse(pub.fitted, (side, "A6"), "mlp", inner_products(x_pub, anchors_pub), y, tb, cfg.train)
    pred = attackers.predict(fitted, inner_products(x_obs, anchors_obs), eb)
    audit._row((side, k, "T3", f"A6 inner products ({p} anchors)", defence), pred, np.ones(len(x_obs), bool), y,
               _info(fitted))


def _aligned(audit, side, k, state) -> None:
    """A8 and A9 on each set of unlabelled traffic whose threat (T3 or T5) this audit runs; A4 after A9 on T3's
    largest."""
    traffic = [t for t in _traffic(audit, side, k, state) if t[0] in state["config"].threats]
    largest_t3 = max((i for i, t in enumerate(traffic) if t[0] == "T3"), default=None)
    for i, (threat, label, observed) in enumerate(traffic):
        _moments(audit, side, k, state, threat, label, observed)
        _whitened(audit, side, k, state, threat, label, observed, a4=i == largest_t3 and state["config"].a9_a4)


def _traffic(audit, side, k, state) -> list[tuple[str, str, dict]]:
    """(threat, label, rows) of the unlabelled keyed traffic A8 and A9 align to the attacker's public statistics.

    T3: the attacked sessions themselves, and on the input side also other sessions (the other text, whose
    documents are disjoint from the attacker's own). T5: traffic of exactly the attacker's own documents,
    unpaired: an observer that knows which texts were sent but not which row is which.
    """
    pub, other = state["pub"], "output" if side == "input" else "input"
    test = audit.test
    sessions = {"x": test.side(side)[k], "bounds": test.chunk_bounds(), "other": test.side(other)[k]}
    out = [("T3", f"{len(test)} tokens of traffic", sessions)]
    if side == "input" and pub.t5 is not None:
        extra = keyed_view(pub.t5, state["a"])
        ends = [e for _, e in extra.chunk_bounds()]
        # The first whole chunks holding N tokens, as attacker_text draws them (all of it where it holds fewer).
        cuts = sorted({next((e for e in ends if e >= n), len(extra)) for n in state["config"].traffic_tokens})
        for cut in cuts:
            bounds = test.chunk_bounds() + [(s + len(test), e + len(test)) for s, e in extra.chunk_bounds() if e <= cut]
            rows = np.concatenate([test.inputs[k], extra.inputs[k][:cut]])
            # The other text's returned states were not collected: no "cross" statistic on this set.
            out.append(("T3", f"{len(rows)} tokens of traffic", {"x": rows, "bounds": bounds, "other": None}))
    own = state["obs_train"]
    out.append(("T5", f"its own text unpaired, {len(own)} tokens",
                {"x": own.side(side)[k], "bounds": own.chunk_bounds(), "other": own.side(other)[k]}))
    return out


def _moments(audit, side, k, state, threat, label, observed) -> None:
    """A8: covariance eigenvectors of the traffic and of the public activations (an orthogonal key only)."""
    pub, defence = state["pub"], state["defence"]
    r = moment_alignment(pub.train.side(side)[k], observed["x"])
    error = _rotation_error(r, state)
    state.setdefault("alignment_error", {})[f"{side}, {label}"] = error
    x_obs = audit.test.side(side)[k]
    pred = attackers.predict(_a2(audit, pub, side, k), (x_obs.astype(np.float32) @ r).astype(np.float16),
                             audit.test.chunk_bounds())
    audit._row((side, k, threat, f"A8 moment alignment ({label}) + A2", defence), pred,
               np.ones(len(audit.test), bool), pub.train.target(side), {"rotation_error": error,
                                                                          "traffic_tokens": int(len(observed["x"]))})


def _whitened(audit, side, k, state, threat, label, observed, a4: bool) -> None:
    """A9: whitening + orthogonal alignment (privacy/whiten.py) from unlabelled traffic, then A2 (and A4)."""
    cfg, pub, defence = audit.config, state["pub"], state["defence"]
    p, y, eb = pub.prefix_len, pub.train.target(side), audit.test.chunk_bounds()
    other = "output" if side == "input" else "input"
    public = {"x": pub.train.side(side)[k], "bounds": pub.train.chunk_bounds(), "other": pub.train.side(other)[k],
              "anchors": pub.train_full.side(side)[k][:p]}
    anchors_obs = state["obs_full"].side(side)[k][:p].astype(np.float64)
    truth = _body(_rounded(pub.test_full), audit.corpus.test, p).side(side)[k].astype(np.float64)
    found, scores = best_alignment(public, {**observed, "anchors": anchors_obs})
    mapped = found(audit.test.side(side)[k])
    info = {"method": found.method, "anchor_residual": scores, "traffic_tokens": int(len(observed["x"])),
            "reconstruction_error": float(np.linalg.norm(mapped - truth) / np.linalg.norm(truth))}
    state.setdefault("a9", {})[f"{side}, {label}"] = info
    pred = attackers.predict(_a2(audit, pub, side, k), mapped.astype(np.float16), eb)
    name = f"A9 whitening + {found.method} ({label})"
    everything = np.ones(len(audit.test), bool)
    audit._row((side, k, threat, f"{name} + A2", defence), pred, everything, y, info)
    if not a4:
        return
    full = found(state["obs_full"].side(side)[k]).astype(np.float32)
    if side == "input":
        a4_pred, a4_info = _pred_a4_input(audit, exact.head_stack(audit.model, k), full, state["obs_full"], p, pred,
                                          cfg.inexact)
        audit._row((side, k, threat, f"{name} + A4", defence), a4_pred, _a4_mask(audit), y, {**info, **a4_info})
    else:
        audit._row((side, k, threat, f"{name} + A4", defence), _pred_a4_output(audit, full, state["obs_full"], p),
                   everything, y, info)


def _rotation_error(r: np.ndarray, state) -> float:
    """Relative Frobenius error of an estimate R of A^-1 (observed @ R = public)."""
    inverse = state["inverse"]
    return float(np.linalg.norm(r - inverse) / np.linalg.norm(inverse))


def _norm_factor(layer) -> np.ndarray | None:
    """[d, d] the factor of a keyed layer's norm, as the host reads it from the cloud shard; None if plain."""
    norm = layer.post_attention_layernorm
    return torch.block_diag(*norm.factor.detach().double()).numpy() if isinstance(norm, KeyedRMSNorm) else None


def _t4(audit, side, k, keyed, state) -> None:
    cfg, defence, obs_full, p = audit.config, state["defence"], state["obs_full"], state["pub"].prefix_len
    layer = k  # the first cloud layer: the host holds it
    if "t4_r" not in state:
        keyed_layer = keyed.model.layers[layer]
        r, record, match = weight_matching(audit.model.model.layers[layer], keyed_layer, _norm_factor(keyed_layer))
        record["rotation_error"] = _rotation_error(r, state)
        record["permutation_recovered"] = float((match == state["neuron_perms"][layer].numpy()).mean())
        record["layer"] = layer
        state["t4"], state["t4_r"] = record, r
    r, record = state["t4_r"], state["t4"]
    derotated = (obs_full.side(side)[k].astype(np.float64) @ r).astype(np.float32)
    y = audit.test.target(side)
    key = (side, k, "T4", "A5 weight matching + A4", defence)
    if side == "input":
        exact_ok = record["weight_residual"] < 1e-3
        stack = exact.head_stack(audit.model, k)
        body = _body(replace(obs_full, inputs={k: derotated.astype(np.float16)}), audit.corpus.test, p)
        guesses = attackers.predict(_a2(audit, state["pub"], side, k), body.inputs[k], audit.test.chunk_bounds())
        search = cfg.exact if exact_ok else cfg.inexact
        pred, info = _pred_a4_input(audit, stack, derotated, obs_full, p, guesses, search)
        audit._row(key, pred, _a4_mask(audit), y, {**info, "a5": record})
    else:
        audit._row(key, _pred_a4_output(audit, derotated, obs_full, p), np.ones(len(audit.test), bool), y,
                   {"a5": record})


def _t5(audit, k, state) -> None:
    """A7 on the input side: N known (text, activation) pairs of the attacker's own text -> least squares."""
    pub, config, defence = state["pub"], state["config"], state["defence"]
    if pub.t5 is None:
        return
    cfg, p = audit.config, pub.prefix_len
    public = pub.t5.inputs[k].astype(np.float64)
    obs = keyed_view(pub.t5, state["a"]).inputs[k].astype(np.float64)
    x_obs, a2 = audit.test.inputs[k].astype(np.float64), _a2(audit, pub, "input", k)
    train_targets, obs_full = pub.train.tokens, state["obs_full"]
    stack = exact.head_stack(audit.model, k)
    everything = np.ones(len(audit.test), bool)
    sizes = sorted({min(n, len(public)) for n in config.t5_pairs})
    for n in sizes:
        t0 = time.perf_counter()
        r, *_ = np.linalg.lstsq(obs[:n], public[:n], rcond=None)  # minimum norm below d pairs
        info = {"known_pairs": int(n), "fit_seconds": round(time.perf_counter() - t0, 3),
                "rotation_error": _rotation_error(r, state)}
        pred = attackers.predict(a2, (x_obs @ r).astype(np.float16), audit.test.chunk_bounds())
        audit._row(("input", k, "T5", f"A7 N={n} + A2", defence), pred, everything, train_targets, info)
        if n >= min(config.t5_a4_from, sizes[-1]):
            rows = (obs_full.inputs[k].astype(np.float64) @ r).astype(np.float32)
            a4, a4_info = _pred_a4_input(audit, stack, rows, obs_full, p, pred, cfg.inexact)
            audit._row(("input", k, "T5", f"A7 N={n} + A4", defence), a4, _a4_mask(audit), train_targets,
                       {**info, **a4_info})
        audit.timings[f"T5_{defence}_N{n}_s"] = time.perf_counter() - t0
