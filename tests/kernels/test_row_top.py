"""model/row_top.cpp: each row's k largest logits in torch.topk's order (ties: the lower index first) with
torch.softmax's probabilities, and Token Recycling's successor table the same with it as without."""

from __future__ import annotations

import pytest
import torch

from splitinfer.decoding.sources import TokenRecycling
from splitinfer import kernels

needs_native = pytest.mark.skipif(not kernels.available(), reason="splitinfer's kernels do not run on this CPU")


SUBNORMAL = 1.2e-38  # below float's smallest normal number probabilities have fewer bits than rtol asks


def row_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.splitinfer.row_top(logits, k)


def hard_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random rows, with exact ties at the top and below it, -inf entries and +-1e4 magnitudes in some."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    for r in range(rows):
        kind = r % 4
        cols = torch.randperm(vocab, generator=g)
        if kind == 1:  # the maximum, and a value inside the top few, each several times
            x[r, cols[:3]] = x[r].max() + 1
            x[r, cols[3:6]] = x[r].max() - 0.5
        elif kind == 2:  # most of the row -inf (a masked vocabulary), ties among what is left
            x[r, cols[: vocab * 3 // 4]] = float("-inf")
            x[r, cols[vocab * 3 // 4 : vocab * 3 // 4 + 4]] = 2.0
        elif kind == 3:  # large magnitudes: only the largest few have any probability
            x[r] = (torch.rand(vocab, generator=g) * 2 - 1) * 1e4
            x[r, cols[:2]] = 1e4
    return x


def reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's top k, ties broken lowest index first (a stable sort on the values, descending)."""
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    return ids, torch.softmax(logits, dim=-1).gather(-1, ids)


@needs_native
@pytest.mark.parametrize("vocab", [49152, 1000, 17])
@pytest.mark.parametrize("rows", [1, 2, 11, 33])
@pytest.mark.parametrize("k", [1, 8])
def test_ids_and_probs_are_torchs(rows, vocab, k):
    logits = hard_logits(rows, vocab, seed=rows * vocab + k)
    ids, probs = row_top(logits, k)
    assert ids.dtype == torch.long and probs.dtype == torch.float32 and ids.shape == probs.shape == (rows, k)
    want_ids, want_probs = reference(logits, k)
    assert torch.equal(ids, want_ids)
    assert torch.equal(ids[:, 0], logits.argmax(-1))
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=SUBNORMAL)
    # Without ties the order is torch.topk's own.
    plain = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(k))
    assert torch.equal(row_top(plain, k)[0], plain.topk(k, dim=-1).indices)


@needs_native
def test_ties_come_out_lowest_index_first():
    logits = torch.zeros(3, 40)
    logits[0, [5, 30, 2, 17]] = 1.0  # four equal maxima
    logits[1] = 7.0  # all equal: the first k indices
    logits[2, [39, 16, 0]] = float("-inf")  # the rest tie at 0
    ids, probs = row_top(logits, 8)
    assert ids[0].tolist()[:4] == [2, 5, 17, 30] and ids[0].tolist()[4:] == [0, 1, 3, 4]
    assert ids[1].tolist() == list(range(8)) and ids[2].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    torch.testing.assert_close(probs[1], torch.full((8,), 1 / 40), rtol=1e-6, atol=0)
    torch.testing.assert_close(probs[2], torch.full((8,), 1 / 37), rtol=1e-6, atol=0)


@needs_native
def test_k_up_to_64_and_strided_rows():
    wide = torch.randn(5, 3000)
    logits = wide[:, 100:2100]  # rows contiguous, a row stride of 3000
    ids, probs = row_top(logits, 64)
    want_ids, want_probs = reference(logits.contiguous(), 64)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=0)
    assert torch.equal(row_top(logits[:, :64].contiguous(), 64)[0], reference(logits[:, :64], 64)[0])  # k == V


@needs_native
def test_nan_does_not_crash():
    logits = torch.randn(4, 100)
    logits[0, 3] = float("nan")
    logits[1] = float("nan")
    logits[2] = float("-inf")
    ids, probs = row_top(logits, 8)
    assert ids.shape == (4, 8) and bool(((ids >= 0) & (ids < 100)).all())
    assert torch.equal(ids[3], logits[3].topk(8).indices)


@needs_native
@pytest.mark.parametrize(
    "logits, k, message",
    [
        (torch.randn(2, 100, dtype=torch.float64), 8, "float32"),
        (torch.randn(2, 100).half(), 8, "float32"),
        (torch.randn(100), 8, r"\[rows, vocab\]"),
        (torch.randn(2, 3, 100), 8, r"\[rows, vocab\]"),
        (torch.randn(100, 2).t(), 1, "contiguous rows"),
        (torch.randn(2, 5), 8, "at most the vocabulary"),
        (torch.randn(2, 100), 0, "k must be 1..64"),
        (torch.randn(2, 100), 65, "k must be 1..64"),
    ],
)
def test_bad_input_raises_a_clear_error(logits, k, message):
    with pytest.raises(RuntimeError, match=message):
        row_top(logits, k)


@needs_native
def test_token_recycling_keeps_the_same_table_with_the_kernel(monkeypatch):
    logits = torch.randn(11, 49152, generator=torch.Generator().manual_seed(3)) * 4  # no ties: topk's order is defined
    logits[:, ::7] = float("-inf")
    logits[3] *= 2500  # magnitudes up to ~1e4: all but the largest few probabilities are 0
    tokens = list(range(100, 111))
    native_table = TokenRecycling(k=8)
    native_table.observe(tokens, logits)
    with kernels.choosing(kernels.KernelSet(row_top=False)):
        torch_table = TokenRecycling(k=8)
    torch_table.observe(tokens, logits)
    assert native_table._next.keys() == torch_table._next.keys()
    for token in tokens:
        (ids, ps), (want_ids, want_ps) = native_table._next[token], torch_table._next[token]
        # The torch path ranks probabilities: where they are 0 it orders tied zeros its own way, the kernel by logit.
        ranked = sum(p > 0 for p in want_ps)
        assert ranked >= 1 and ids[:ranked] == want_ids[:ranked]
        assert ps == pytest.approx(want_ps, rel=1e-5, abs=SUBNORMAL)
