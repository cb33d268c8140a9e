"""model/arena.py: a stack's integer weights move into one huge-page block in the order a step reads them, keep
their values and identity, outlive every reference to the block, and leave the step's output bit for bit."""

from __future__ import annotations

import gc

import pytest
import torch

from splitinfer import kernels
from splitinfer.model import arena, linears
from splitinfer.model.native_layer import NativeLayer

from model.test_native_layer import PARENTS, cloud_stack, run_blocks

needs_native = pytest.mark.skipif(not kernels.available(), reason="splitinfer's kernels do not run on this CPU")


def test_gathered_tensors_keep_their_values_and_identity_in_one_aligned_block():
    torch.manual_seed(0)
    tensors = [torch.randint(-127, 128, (n, 64), dtype=torch.int8) for n in (3, 100, 7)] + [torch.randn(5, 3)]
    expected = [t.clone() for t in tensors]
    ids = [id(t) for t in tensors]
    assert arena.gather(tensors) == sum(t.nbytes for t in tensors)
    gc.collect()  # nothing but the tensors holds the block
    assert [id(t) for t in tensors] == ids and all(torch.equal(t, e) for t, e in zip(tensors, expected))
    starts = [t.data_ptr() for t in tensors]
    assert starts[0] % arena.ALIGN == 0 and all(s % 64 == 0 for s in starts)
    assert starts == sorted(starts) and starts[-1] - starts[0] < 2 * sum(t.nbytes for t in tensors)  # in order, one block
    tensors[1][0, 0] = 5  # still ordinary writable tensors
    assert tensors[1][0, 0] == 5 and torch.equal(tensors[0], expected[0])


def test_gather_refuses_views_and_repeats_and_moves_nothing_when_turned_off(monkeypatch):
    t = torch.zeros(8, 8, dtype=torch.int8)
    with pytest.raises(ValueError):
        arena.gather([t, t])
    with pytest.raises(ValueError):
        arena.gather([torch.zeros(8, 8).t()])
    monkeypatch.setenv(arena.ENV, "0")
    before = t.data_ptr()
    assert arena.gather([t]) == 0 and t.data_ptr() == before


@needs_native
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_loaded_stack_streams_one_block_in_order_with_the_bits_of_its_own_allocations(tmp_path, monkeypatch, weights):
    stack = cloud_stack(tmp_path / "arena", "llama", weights)
    assert all(isinstance(layer, NativeLayer) for layer in stack.layers)
    starts = [w.data_ptr() for layer in stack.layers for w in arena.packed_weights(layer)]
    assert len(starts) == 4 * len(stack.layers)  # q/k/v, o, gate/up, down a layer
    assert starts == sorted(starts) and starts[0] % arena.ALIGN == 0
    monkeypatch.setenv(arena.ENV, "0")
    apart = cloud_stack(tmp_path / "apart", "llama", weights)
    assert not all(w.data_ptr() % arena.ALIGN == 0 for layer in apart.layers for w in arena.packed_weights(layer))
    hidden = torch.randn(1, 6 + len(PARENTS), stack.config.hidden_size, generator=torch.Generator().manual_seed(3))
    out, kv = run_blocks(stack, hidden, 6)
    out_apart, kv_apart = run_blocks(apart, hidden, 6)
    assert torch.equal(out, out_apart)
    assert all(torch.equal(a, b) for pair, other in zip(kv, kv_apart) for a, b in zip(pair, other))


def test_a_kernel_without_huge_pages_still_gets_one_block(monkeypatch):
    import mmap

    def refuse(self, *args):
        raise OSError(22, "Invalid argument")  # madvise(MADV_HUGEPAGE) where the kernel has no THP

    class Mapping(mmap.mmap):
        madvise = refuse

    monkeypatch.setattr(arena.mmap, "mmap", Mapping)
    tensors = [torch.arange(300, dtype=torch.int32), torch.ones(70)]
    expected = [t.clone() for t in tensors]
    assert arena.gather(tensors) == sum(t.nbytes for t in tensors)
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected)) and tensors[0].data_ptr() % arena.ALIGN == 0


@needs_native
def test_loaded_halves_hold_one_copy_of_an_int8_weight_and_hand_freed_memory_back(tmp_path, monkeypatch):
    from splitinfer.model.shards import load_cloud, load_local
    from splitinfer.model.source import SourceModel
    from splitinfer.model.prepare import prepare
    from splitinfer.model.formats import WeightFormats
    from tiny import tiny_model

    model = tiny_model("llama")
    out = prepare(SourceModel("tiny-llama", model.config, model, None), tmp_path / "shards", 2, 1, "float32",
                  weights=WeightFormats.parse("int8,lm_head=int8"))
    trims = []
    monkeypatch.setattr(arena, "return_freed", lambda: trims.append(1) or True)
    cloud, local = load_cloud(out / "cloud"), load_local(out / "local")
    assert len(trims) == 2  # once a half
    products = [m for top in (cloud.stack, local.head, local.tail, local.lm_head) for m in top.modules()
                if isinstance(m, linears.Int8Linear)]
    assert products and all(m.qweight is None and m._w8a8 is not None for m in products)
    from safetensors.torch import load_file

    stored = load_file(str(out / "local" / "weights.safetensors"))  # the shard's integers read back whole
    assert torch.equal(local.lm_head.int8_weight(), stored["lm_head.qweight"])
    assert torch.equal(local.lm_head.stored_state()["scale"], stored["lm_head.scale"])
