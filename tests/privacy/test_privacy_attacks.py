"""Attackers on a tiny random Llama: known-weights matching recovers everything, and only with the weights."""

from __future__ import annotations

import copy

import numpy as np
import torch
from tiny import tiny_model

from splitinfer.privacy import attackers, exact
from splitinfer.privacy.collect import layer_outputs


def _states(model, tokens, k):
    _, hidden = layer_outputs(model, torch.tensor([tokens]))
    return hidden[k - 1].to(torch.float16).numpy()


def test_a4_recovers_every_token_with_public_weights_and_not_without():
    model = tiny_model("llama")
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, model.config.vocab_size, size=40).tolist()
    k = 2
    observed = _states(model, tokens, k)
    books = exact.codebooks(model, (1, k), prefix=[3], block=32)
    assert books[k].shape == (model.config.vocab_size, model.config.hidden_size)
    no_guess = np.zeros((len(tokens), 1), dtype=np.int64)
    stats = exact.ExactStats()
    pred = exact.match_chunk(exact.head_stack(model, k), model.model.embed_tokens, books[k], observed, no_guess,
                             exact.ExactConfig(blocks=(4, 16)), stats)
    assert (pred[:, 0] == np.array(tokens)).all()
    assert stats.unmatched == 0 and stats.positions == len(tokens)

    # The same attacker against other (private) local weights finds no exact match.
    private = copy.deepcopy(model)
    with torch.no_grad():
        for p in private.model.layers[0].parameters():
            p.add_(0.5 * torch.randn_like(p))
    stats = exact.ExactStats()
    exact.match_chunk(exact.head_stack(model, k), model.model.embed_tokens, books[k], _states(private, tokens, k),
                      no_guess, exact.ExactConfig(blocks=(4, 16), max_candidates=32), stats)
    assert stats.unmatched == len(tokens)


def test_output_side_a4_reproduces_the_clients_greedy_tokens():
    model = tiny_model("llama")
    tokens = list(range(5, 35))
    logits, hidden = layer_outputs(model, torch.tensor([tokens]))
    n, m = len(model.model.layers), 2
    returned = hidden[n - m - 1].numpy()
    pred = exact.lens_through_tail(exact.tail_stack(model, m), model.model.norm, model.lm_head, returned)
    assert (pred[:, 0] == logits.argmax(-1).numpy()).all()


def test_learned_attackers_beat_chance_on_separable_states():
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(12, 16)).astype(np.float32) * 3
    y = rng.integers(0, 12, size=1200)
    x = (centers[y] + rng.normal(size=(1200, 16))).astype(np.float16)
    bounds = [(s, s + 40) for s in range(0, 1200, 40)]
    config = attackers.TrainConfig(hidden=32, epochs=8, batch_rows=32, batch_chunks=2)
    train_b, test_b = bounds[:20], [(s - 800, e - 800) for s, e in bounds[20:]]
    for kind in ("mlp", "seq"):
        fitted = attackers.fit(kind, x[:800], y[:800] + 100, train_b, config)
        pred = attackers.predict(fitted, x[800:], test_b)
        assert (pred[:, 0] == y[800:] + 100).mean() > 0.6, kind  # chance is 1/12


def test_attackers_train_on_a_handful_of_rows():
    # A chosen-plaintext set smaller than one batch gives one optimiser step per epoch (the LR-schedule
    # crash of an earlier full audit); it must train and predict, not raise.
    x = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float16)
    y = np.array([3, 4, 3, 5, 4])
    for kind in ("mlp", "seq"):
        fitted = attackers.fit(kind, x, y, [(0, 3), (3, 5)], attackers.TrainConfig(hidden=16, epochs=2))
        assert fitted.epochs_run == 2
        pred = attackers.predict(fitted, x, [(0, 3), (3, 5)])
        assert pred.shape == (5, 3) and set(pred.ravel()) <= {3, 4, 5}
