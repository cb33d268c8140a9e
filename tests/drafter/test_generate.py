"""The drafter's batched generator: each left-padded row continues as the model alone would, its features are
the model's own pre-norm features, and sampling is a seeded top-k/top-p draw."""

from __future__ import annotations

import pytest
import torch

from splitinfer.drafter.generate import Sampling, generate_rows, next_tokens

from tiny import hf_greedy, min_margin, tiny_model

PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 4, 11, 2], [60], [14, 2, 9, 9, 30]]  # ragged: padding up to 7 rows


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_rows_equal_the_model_alone_and_carry_its_features(family):
    model = tiny_model(family)
    rows = generate_rows(model, PROMPTS, 10, pad_id=0, eos_ids=set())
    for prompt, (tokens, features) in zip(PROMPTS, rows):
        expected = hf_greedy(model, prompt, 10)
        assert min_margin(model, prompt, expected) > 1e-3  # not a tie: the comparison means something
        assert tokens == prompt + expected
        seen = []
        handle = model.model.norm.register_forward_hook(lambda m, args, out: seen.append(args[0]))
        with torch.no_grad():
            model(torch.tensor([tokens[:-1]]))
        handle.remove()
        assert seen[0].shape[1] == features.shape[0] == len(tokens) - 1
        torch.testing.assert_close(features.float(), seen[0][0], atol=2e-2, rtol=1e-2)  # float16 storage


def test_a_row_stops_at_its_first_end_token_and_the_others_go_on():
    model = tiny_model("llama")
    free = generate_rows(model, PROMPTS, 10, pad_id=0, eos_ids=set())
    stop = free[1][0][len(PROMPTS[1]) + 3]  # the 4th token row 1 generates becomes an end token
    rows = generate_rows(model, PROMPTS, 10, pad_id=0, eos_ids={stop})
    for prompt, (tokens, features), (free_tokens, _) in zip(PROMPTS, rows, free):
        continuation = free_tokens[len(prompt) :]
        end = continuation.index(stop) + 1 if stop in continuation else len(continuation)
        assert tokens == prompt + continuation[:end] and features.shape[0] == len(tokens) - 1
    assert len(rows[1][0]) < len(free[1][0])  # row 1 did stop early


def test_sampling_is_seeded_and_draws_within_the_nucleus():
    model = tiny_model("llama")
    sampling = Sampling(temperature=1.5)
    a = generate_rows(model, PROMPTS, 12, pad_id=0, eos_ids=set(), sampling=sampling, seed=3)
    b = generate_rows(model, PROMPTS, 12, pad_id=0, eos_ids=set(), sampling=sampling, seed=3)
    c = generate_rows(model, PROMPTS, 12, pad_id=0, eos_ids=set(), sampling=sampling, seed=4)
    greedy = generate_rows(model, PROMPTS, 12, pad_id=0, eos_ids=set())
    assert [t for t, _ in a] == [t for t, _ in b]
    assert [t for t, _ in a] != [t for t, _ in c] and [t for t, _ in a] != [t for t, _ in greedy]

    logits = torch.tensor([[4.0, 3.0, 0.0, -9.0, 2.0]] * 4000)
    draws = next_tokens(logits, Sampling(temperature=1.0, top_p=0.9, top_k=4), torch.Generator().manual_seed(0))
    probs = logits[0].softmax(-1)
    # Sorted mass 0.64, 0.87, 0.96: token 4 completes 0.9, token 2 is outside the nucleus, token 3 past top_k.
    assert set(draws.tolist()) == {0, 1, 4}
    kept = probs[[0, 1, 4]] / probs[[0, 1, 4]].sum()
    for token, p in zip((0, 1, 4), kept.tolist()):
        assert abs(float((draws == token).float().mean()) - p) < 0.03


def test_fused_rows_carry_the_requested_hidden_states():
    model = tiny_model("llama")
    plain = generate_rows(model, PROMPTS, 8, pad_id=0, eos_ids=set())
    rows = generate_rows(model, PROMPTS, 8, pad_id=0, eos_ids=set(), fused_layers=(1, 4))
    for (tokens, features), (same_tokens, same_features, fused) in zip(plain, rows):
        assert tokens == same_tokens and torch.equal(features, same_features)
        with torch.no_grad():
            states = model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        expected = torch.cat([states[1][0], states[4][0]], dim=-1)  # outputs of layers 0 and 3
        assert fused.shape == expected.shape == (len(tokens) - 1, 2 * model.config.hidden_size)
        torch.testing.assert_close(fused.float(), expected, atol=2e-2, rtol=1e-2)  # float16 storage
