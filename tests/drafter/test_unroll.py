"""The unrolled passes train and measure what the drafter runs: each pass equals the head chained on its own
predictions through its KV cache, node by node, as decoding/headsource.py drafts."""

from __future__ import annotations

import torch

from splitinfer.drafter.unroll import accuracy, pass_mask, unroll, window_tensors
from splitinfer.clients import open_client
from splitinfer.model.drafthead import HeadCache

from tiny import prepare_tiny, random_head


def _chained(head, feats, tokens, i, depth):
    """Row i drafted the way HeadDrafter does: the true pairs 0..i in the cache, then one node per depth
    reading its parent's predicted feature and attending to the cache and its ancestors."""
    allowed = torch.ones(i + 1, i + 1, dtype=torch.bool).tril()
    tip, keys, values = head(feats[:, : i + 1], tokens[:, 1 : i + 2], torch.arange(i + 1), allowed)
    cache = HeadCache(keys, values)
    h, out = tip[:, -1:], [tip[0, -1]]
    for e in range(1, depth):
        allowed = torch.ones(1, cache.length + 1, dtype=torch.bool)
        h, k, v = head(h, tokens[:, i + e + 1 : i + e + 2], torch.tensor([i + e]), allowed, cache)
        cache = HeadCache(torch.cat([cache.keys, k], 2), torch.cat([cache.values, v], 2))
        out.append(h[0, 0])
    return out


def test_unrolled_passes_equal_the_chained_drafter(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    head = random_head(open_client(local_only=True, shards=shards).local)
    torch.manual_seed(1)
    n, depth, d = 7, 3, head.config.hidden_size
    feats = torch.randn(1, n + depth, d)
    tokens = torch.randint(0, head.config.draft_vocab_size, (1, n + depth + 1))
    passes = unroll(head, feats, tokens, torch.tensor([n + depth]), depth)
    for i in (0, 3, n - 1):
        for e, expected in enumerate(_chained(head, feats, tokens, i, depth)):
            torch.testing.assert_close(passes[e].predicted[0, i], expected, rtol=1e-4, atol=1e-5)


def test_pass_mask_and_valid_rows():
    mask = pass_mask(3, 2)
    assert mask.shape == (3, 9)
    assert mask[1].tolist() == [True, True, False, False, True, False, False, True, False]
    sequences = [{"tokens": list(range(10)), "prompt_len": 2, "features": torch.zeros(9, 4)}]
    feats, tokens, rows, _ = window_tensors(sequences, [(0, 4)], 4, 2)
    assert feats.shape == (1, 6, 4) and tokens[0].tolist() == [4, 5, 6, 7, 8, 9, 0] and rows.tolist() == [5]


def test_accuracy_counts_each_depth_on_generated_rows(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    head = random_head(open_client(local_only=True, shards=shards).local)
    torch.manual_seed(2)
    sequences = [{"tokens": torch.randint(0, 64, (20,)).tolist(), "prompt_len": 5, "features": torch.randn(19, head.config.hidden_size)}]
    result = accuracy(head, sequences, depth=3, window=8, top_k=2)
    # 19 feature rows: depth e drafts tokens 2+e-1 .. 19, the generated ones from index 5.
    assert [r["rows"] for r in result["depth"]] == [15, 15, 15]
    assert all(0 <= r["top1"] <= r["topk"] <= 1 for r in result["depth"])


def test_a_fused_head_reads_its_fused_states_at_depth_one_only(tmp_path):
    """Fusion adds fuse(states) to the true features of pass 0 and nothing else: deeper passes read the head's
    own predictions, as at run time. A fused head with its zero initial projection drafts as the plain head."""
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    local = open_client(local_only=True, shards=shards).local
    head = random_head(local, fused_layers=(1, 2))
    torch.manual_seed(3)
    n, depth, d = 6, 3, head.config.hidden_size
    feats, fused = torch.randn(1, n + depth, d), torch.randn(1, n + depth, 2 * d)
    tokens = torch.randint(0, head.config.draft_vocab_size, (1, n + depth + 1))
    rows = torch.tensor([n + depth])
    moved = feats.clone()
    moved[:, :n] += head.fuse(fused[:, :n])
    with_fused, by_hand = unroll(head, feats, tokens, rows, depth, fused=fused), unroll(head, moved, tokens, rows, depth)
    plain = unroll(head, feats, tokens, rows, depth)
    for a, b, c in zip(with_fused, by_hand, plain):
        torch.testing.assert_close(a.predicted, b.predicted)
        assert (a.predicted - c.predicted).abs().max() > 1e-3  # the states really moved the drafts
    torch.nn.init.zeros_(head.fuse.weight)
    for a, c in zip(unroll(head, feats, tokens, rows, depth, fused=fused), plain):
        torch.testing.assert_close(a.predicted, c.predicted)
    sequences = [{"tokens": list(range(10)), "prompt_len": 2, "features": torch.zeros(9, d), "fused": torch.arange(9.0)[:, None].repeat(1, 2 * d)}]
    window = window_tensors(sequences, [(0, 4)], 3, 2)[3]
    assert window[0, :, 0].tolist() == [4.0, 5.0, 6.0, 7.0, 8.0]  # the states at the features' rows
