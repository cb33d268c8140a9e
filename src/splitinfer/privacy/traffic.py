"""What a network observer with TLS intact can read from message sizes and times (threat T6), as pure functions.

The observer sees, for each WebSocket message, its direction, when it passed and how many bytes it had (TLS
adds a near-constant overhead per record, so the message length is what it learns). Nothing else: no
header, no tensor. A `Trace` is one generation's messages as a transport tap recorded them
(local/middle.py `RemoteMiddle.tap`), with the ground truth kept beside them for scoring only.

Three attacks, each trained on traffic the attacker generated itself (other prompts, or other runs) and
tested on traffic it did not see:
  (a) the accepted count of each decode step: k nearest neighbours over the step's sizes (and times);
  (b) the prompt's category: k nearest neighbours over per-generation features;
  (c) which of N known documents is being processed: the nearest of the attacker's own traces of them.
Chance is the attacker's best guess without the traffic: the majority class of its training labels ((a),
(b)), one in N for (c). The attacker is told which exchanges are decode steps (after the hello and the
prompt's chunks): an upper bound on what it could do by segmenting the stream itself.
This module knows no model and no network; metadata.py records the traces and makes the audit rows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

SIZES, TIMING = "sizes", "sizes and timing"


@dataclass(frozen=True)
class Trace:
    prompt_id: str
    category: str
    messages: tuple[tuple[str, float, int], ...]  # (direction "up"/"down", seconds, bytes), in order
    accepted: tuple[int, ...]  # ground truth per decode step (scoring only; the observer never sees it)
    prefill_exchanges: int  # exchanges between the hello and the first decode step (the prompt's chunks)


def exchanges(trace: Trace) -> list[tuple[int, int, float, float]]:
    """(up bytes, down bytes, up time, down time) per request and its reply, in order (one block in flight:
    every request is answered before the next goes); an unanswered last message (the close) is left out."""
    out, waiting = [], None
    for direction, t, n in trace.messages:
        if direction == "up":
            assert waiting is None, "two requests without a reply between them: record with one block in flight"
            waiting = (n, t)
        else:
            assert waiting is not None, "a reply without a request"
            out.append((waiting[0], n, waiting[1], t))
            waiting = None
    return out


def step_features(trace: Trace, row_bytes: int) -> np.ndarray:
    """[decode steps, 7]: per decode step i, what the observer has: its request and reply sizes, the size of
    the next request (which carries step i's keep list) split into whole rows and the rest, the round trip
    and the think time before the next request. Cover exchanges (ClientConfig.pad_steps) follow the decode
    steps; they have no accepted count to recover, so only the steps are scored."""
    ex = exchanges(trace)
    decode = ex[1 + trace.prefill_exchanges :]
    assert len(decode) >= len(trace.accepted), (len(decode), len(trace.accepted))
    decode = decode[: len(trace.accepted)]
    ups = [m for m in trace.messages if m[0] == "up"]
    first = 1 + trace.prefill_exchanges  # index of the first decode request among the requests
    rows = []
    for i, (up, down, t_up, t_down) in enumerate(decode):
        nxt = ups[first + i + 1] if first + i + 1 < len(ups) else ("up", t_down, 0)  # the close, if any
        rows.append([up, down, nxt[2] // row_bytes, nxt[2] % row_bytes, nxt[2], t_down - t_up, nxt[1] - t_down])
    return np.asarray(rows, dtype=np.float64).reshape(-1, 7)


def generation_features(trace: Trace) -> np.ndarray:
    """[10]: per generation: decode steps, the prompt's exchanges and bytes, mean and spread of decode
    request and reply sizes, mean and spread of round trips and think times."""
    ex = exchanges(trace)
    prefill, decode = ex[1 : 1 + trace.prefill_exchanges], ex[1 + trace.prefill_exchanges :]
    up = np.array([e[0] for e in decode] or [0.0])
    down = np.array([e[1] for e in decode] or [0.0])
    rtt = np.array([e[3] - e[2] for e in decode] or [0.0])
    think = np.array([b[2] - a[3] for a, b in zip(decode, decode[1:])] or [0.0])
    return np.array([len(decode), len(prefill), sum(e[0] for e in prefill), up.mean(), up.std(), down.mean(),
                     rtt.mean(), rtt.std(), think.mean(), think.std()])


# which columns each attacker reads: sizes only, or sizes and times
STEP_COLUMNS = {SIZES: [0, 1, 2, 3, 4], TIMING: [0, 1, 2, 3, 4, 5, 6]}
GENERATION_COLUMNS = {SIZES: [0, 1, 2, 3, 4, 5], TIMING: list(range(10))}


def knn(x_train: np.ndarray, y_train: list, x_test: np.ndarray, k: int) -> list:
    """Majority label of the k nearest training rows (Euclidean, each column scaled by its training spread;
    a constant column carries nothing and weighs nothing). Rows as near as the k-th all vote, so traffic
    that tells nothing apart (padded sizes) gets the training majority, not an arbitrary row's label. Ties go
    to the nearer neighbour's label."""
    mean, spread = x_train.mean(0), x_train.std(0)
    scale = np.where(spread > 0, spread, np.inf)
    a, b = (x_train - mean) / scale, (x_test - mean) / scale
    out = []
    for row in b:
        distance = ((a - row) ** 2).sum(1)
        order = np.argsort(distance, kind="stable")
        order = order[distance[order] <= distance[order[min(k, len(order)) - 1]] + 1e-12]
        votes = Counter(y_train[j] for j in order)
        best = max(votes.values())
        out.append(next(y_train[j] for j in order if votes[y_train[j]] == best))
    return out


def majority(labels: list):
    """The most common label (ties to the smallest): the guess of an attacker that sees nothing."""
    counts = Counter(labels)
    return min(counts, key=lambda label: (-counts[label], label))


@dataclass(frozen=True)
class Scored:
    """One attack on one test set: per-item hits, the chance guess's hits, and the items' documents."""

    hits: np.ndarray  # bool per test item
    chance_hits: np.ndarray  # bool per test item: the guess without traffic
    docs: np.ndarray  # the prompt each item belongs to (bootstrap unit)
    chance: object  # the guess without traffic (a label), or the 1/N rate for documents
    n_train: int
    train_coverage: float  # share of test labels that occur among the training labels


def attack_steps(train: list[Trace], test: list[Trace], features: str, row_bytes: int, k: int) -> Scored:
    """(a): each test decode step's accepted count, from the attacker's own traces' steps."""
    cols = STEP_COLUMNS[features]
    x_train = np.concatenate([step_features(t, row_bytes) for t in train])[:, cols]
    y_train = [a for t in train for a in t.accepted]
    x_test = np.concatenate([step_features(t, row_bytes) for t in test])[:, cols]
    y_test = np.array([a for t in test for a in t.accepted])
    pred = np.array(knn(x_train, y_train, x_test, k))
    guess = majority(y_train)
    docs = np.array([t.prompt_id for t in test for _ in t.accepted])
    return Scored(pred == y_test, y_test == guess, docs, guess, len(y_train), float(np.isin(y_test, y_train).mean()))


def attack_steps_lookup(train: list[Trace], test: list[Trace], row_bytes: int) -> Scored:
    """(a) by table: the accepted count most often seen in the attacker's own traffic with the same reply size
    and the same next request (its rows, and the rest: the header that carries the keep list); the training
    majority for a pair it never saw."""
    def keys(traces: list[Trace]) -> list[tuple]:
        return [(f[1], f[2], f[3]) for t in traces for f in step_features(t, row_bytes).tolist()]

    y_train = [a for t in train for a in t.accepted]
    seen: dict[tuple, list] = {}
    for key, label in zip(keys(train), y_train):
        seen.setdefault(key, []).append(label)
    guess = majority(y_train)
    pred = np.array([majority(seen[key]) if key in seen else guess for key in keys(test)])
    y_test = np.array([a for t in test for a in t.accepted])
    docs = np.array([t.prompt_id for t in test for _ in t.accepted])
    return Scored(pred == y_test, y_test == guess, docs, guess, len(y_train), float(np.isin(y_test, y_train).mean()))


def attack_category(train: list[Trace], test: list[Trace], features: str | list[int], k: int) -> Scored:
    """(b): each test generation's prompt category, from the attacker's own generations of other prompts;
    `features` names a GENERATION_COLUMNS set or lists generation_features' columns."""
    cols = GENERATION_COLUMNS[features] if isinstance(features, str) else list(features)
    x_train = np.stack([generation_features(t) for t in train])[:, cols]
    y_train = [t.category for t in train]
    pred = knn(x_train, y_train, np.stack([generation_features(t) for t in test])[:, cols], k)
    truth = [t.category for t in test]
    guess = majority(y_train)
    return Scored(np.array([p == c for p, c in zip(pred, truth)]), np.array([c == guess for c in truth]),
                  np.array([t.prompt_id for t in test]), guess, len(train),
                  float(np.mean([c in y_train for c in truth])))


def attack_document(known: list[Trace], test: list[Trace], features: str) -> Scored:
    """(c): which known document each test generation processes: the nearest of the attacker's own traces of
    the N documents (one each), by per-generation features and the sequence of decode request sizes."""
    cols = GENERATION_COLUMNS[features]
    width = max(len(exchanges(t)) for t in known + test)

    def vector(trace: Trace) -> np.ndarray:
        sizes = [e[0] for e in exchanges(trace)] + [0] * width
        return np.concatenate([generation_features(trace)[cols], sizes[:width]])

    ids = [t.prompt_id for t in known]
    pred = knn(np.stack([vector(t) for t in known]), ids, np.stack([vector(t) for t in test]), 1)
    rng = np.random.default_rng(0)  # chance: a uniform guess among the N, drawn once per test trace
    guesses = rng.choice(ids, size=len(test))
    return Scored(np.array([p == t.prompt_id for p, t in zip(pred, test)]),
                  np.array([g == t.prompt_id for g, t in zip(guesses, test)]), np.array([t.prompt_id for t in test]),
                  1 / len(set(ids)), len(known), float(np.mean([t.prompt_id in ids for t in test])))
