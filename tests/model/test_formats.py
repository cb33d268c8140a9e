"""Weight formats (model/formats.py): parsing, storage, and the row invariance speculation's exactness
rests on: every row of a multi-row product or step has the bits the same row gets alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitinfer.errors import ConfigError, ModelError
from splitinfer.clients import open_client
from splitinfer.masks import chain_allowed, tree_allowed, tree_depths
from splitinfer import kernels
from splitinfer.model import formats, linears
from splitinfer.model.formats import WeightFormats
from splitinfer.model.linears import Int4Linear, Int8Linear
from splitinfer.model.manifest import read_manifest
from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_cloud, load_local
from splitinfer.model.source import SourceModel

from tiny import tiny_model

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71]


def test_weights_spec_parses_parts_and_refuses_unknown_ones():
    assert WeightFormats.parse("int8") == WeightFormats("int8", "int8", "int8")
    assert WeightFormats.parse("int4,lm_head=int8") == WeightFormats("int4", "int4", "int8")
    assert WeightFormats.parse("float32,cloud=int4").spec() == "local=float32,cloud=int4,lm_head=float32"
    with pytest.raises(ConfigError, match="not a part"):
        WeightFormats.parse("int8,head=int4")
    with pytest.raises(ConfigError, match="not one of"):
        WeightFormats.parse("int3")
    with pytest.raises(ConfigError, match="leaves"):
        WeightFormats.parse("cloud=int4")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_stored_state_stands_for_the_weight(fmt):
    torch.manual_seed(0)
    weight = torch.randn(96, 128)
    back = formats.dequantize(formats.quantize(weight, fmt))
    # int8: half a step of max|w|/127 per row; int4: half a step of (max - min)/15 per group of 32.
    bound = weight.abs().amax(1, keepdim=True) / 127 / 2 if fmt == "int8" else (weight.amax() - weight.amin()) / 15 / 2
    assert (back - weight).abs().le(bound * 1.001).all()


# Every integer test runs on both kernels of its format: model/w4a8.py's and model/w8a8.py's (where this CPU
# runs them), and PyTorch's ("int4-pytorch") and FBGEMM's ("int8-fbgemm").
KERNELS = ["int8", "int8-fbgemm", "int4", "int4-pytorch"]


def _kernel(fmt: str, monkeypatch) -> str:
    """The stored format of a test's `fmt`; '-pytorch' / '-fbgemm' make it take the library's kernel."""
    if fmt.endswith("-pytorch"):
        monkeypatch.setattr(kernels.build._STATE, "chosen", kernels.KernelSet(w4a8=False))
    if fmt.endswith("-fbgemm"):
        monkeypatch.setattr(kernels.build._STATE, "chosen", kernels.KernelSet(w8a8=False))
    return fmt.removesuffix("-pytorch").removesuffix("-fbgemm")


def _linear(fmt: str, out_features: int, in_features: int) -> torch.nn.Module:
    state = formats.quantize(torch.randn(out_features, in_features), fmt)
    module = linears.quant_module(fmt, in_features, out_features, bias=False)  # the kernel chosen here
    module.load_state_dict(state)
    module.finish()
    return module


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", KERNELS)
@pytest.mark.parametrize("shape", [(96, 64), (192, 576), (576, 1536)])
def test_every_row_of_a_product_has_the_bits_it_has_alone(fmt, shape, threads, monkeypatch):
    fmt = _kernel(fmt, monkeypatch)
    torch.manual_seed(1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        module = _linear(fmt, *shape)
        x = torch.randn(64, shape[1]) * 3
        with torch.inference_mode():
            alone = torch.cat([module(x[i : i + 1]) for i in range(64)])
            for rows in range(1, 65):
                assert torch.equal(module(x[:rows]), alone[:rows]), rows
    finally:
        torch.set_num_threads(before)


def test_int8_takes_fbgemm_with_the_sums_of_int_mm(monkeypatch):
    """FBGEMM's packed product (scales 1) and torch._int_mm hand the epilogue the same float(acc): the
    kernel can differ between machines without changing a bit (kernels/w8a8.py's too: tests/kernels/test_w8a8.py)."""
    torch.manual_seed(2)
    if not linears.fbgemm_works():
        pytest.skip("this torch has no FBGEMM int8 product")
    module = _linear(_kernel("int8-fbgemm", monkeypatch), 192, 576)
    assert isinstance(module, linears.FbgemmLinear)
    library = linears.IntMMLinear(576, 192)
    library.load_state_dict(module.stored_state())
    library.finish()
    x = torch.randn(9, 576) * 3
    with torch.inference_mode():
        assert torch.equal(module(x), library(x))


def _prepare(tmp_path, family: str, weights: str):
    model = tiny_model(family)
    out = tmp_path / f"{family}-{weights}"
    prepare(SourceModel(f"tiny-{family}", model.config, model, None), out, 2, 1, "float32",
            weights=WeightFormats.parse(weights))
    return model, out


def _block(stack, cache_rows: int, hidden: torch.Tensor, allowed: np.ndarray, positions: torch.Tensor):
    """hidden [1, cache_rows + q, d]: the first cache_rows committed, then the block; -> block output."""
    cache = stack.new_cache()
    if cache_rows:
        stack(hidden[:, :cache_rows], torch.arange(cache_rows), chain_allowed(cache_rows), cache)
        cache.commit_all()
    return stack(hidden[:, cache_rows:], positions, allowed, cache)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma3"])
@pytest.mark.parametrize("fmt", KERNELS)
def test_every_row_of_a_step_has_the_bits_it_has_alone(tmp_path, family, fmt, monkeypatch):
    """A tree of 64 rows on 0, 9 and 40 cached rows (mistral's window is 12, gemma3's 6): each row's output
    equals, bit for bit, the last row of a sequential chain along its path."""
    _, shards = _prepare(tmp_path, family, _kernel(fmt, monkeypatch))
    stack = load_cloud(shards / "cloud").stack
    rng = np.random.default_rng(0)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, 64)]
    depths = tree_depths(parents)
    for cached in (0, 9, 40):
        torch.manual_seed(cached)
        hidden = torch.randn(1, cached + 64, stack.config.hidden_size)
        positions = torch.tensor([cached + d for d in depths])
        tree = _block(stack, cached, hidden, tree_allowed(parents), positions)
        for row in (0, 1, 5, 17, 40, 63):
            path = [row]
            while parents[path[0]] >= 0:
                path.insert(0, parents[path[0]])
            chain = torch.cat([hidden[:, :cached], hidden[:, cached + torch.tensor(path)]], dim=1)
            alone = _block(stack, cached, chain, chain_allowed(len(path)), torch.arange(cached, cached + len(path)))
            assert torch.equal(tree[0, row], alone[0, -1]), (cached, row)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", ["int8", "int8-fbgemm", "int4", "int4-pytorch", "int4,lm_head=int8", "bfloat16"])
def test_speculation_is_token_identical_to_sequential_in_each_format(tmp_path, family, weights, monkeypatch):
    _, shards = _prepare(tmp_path, family, _kernel(weights, monkeypatch))
    client = open_client(local_only=True, shards=shards)
    sequential = client.generate(PROMPT, max_new_tokens=24, stop_ids=set(), strategy="sequential")
    for strategy in ("tree-nohead", "lookahead"):
        got = client.generate(PROMPT, max_new_tokens=24, stop_ids=set(), strategy=strategy)
        assert got.token_ids == sequential.token_ids, strategy


def test_shards_record_each_part_and_store_only_its_own(tmp_path):
    model, shards = _prepare(tmp_path, "llama", "int4,cloud=int8,lm_head=bfloat16")
    assert read_manifest(shards / "local", "local")["weights"] == {"local": "int4", "cloud": "int8", "lm_head": "bfloat16"}
    local, cloud = load_local(shards / "local"), load_cloud(shards / "cloud")
    assert isinstance(local.head.layers[0].self_attn.fused_qkv, Int4Linear)  # q/k/v fused at load (model/fused.py)
    assert isinstance(cloud.stack.layers[0].self_attn.fused_qkv, Int8Linear)  # one smoothing for q/k/v at prepare
    assert isinstance(cloud.stack.layers[0].mlp.fused_gate_up, Int8Linear)
    assert isinstance(cloud.stack.layers[0].mlp.down_proj, Int8Linear)
    assert local.lm_head.weight.dtype == torch.bfloat16
    expected = model.lm_head.weight.detach().to(torch.bfloat16)
    assert torch.equal(local.lm_head.weight, expected)


def test_int4_needs_a_width_divisible_by_its_group():
    with pytest.raises(ModelError, match="divisible by 32"):
        formats.quantize(torch.randn(8, 48), "int4")


def test_integer_modules_refuse_a_device_without_their_kernels():
    # Shards never get there (formats.for_device dequantizes first: tests/model/test_formats_device.py).
    module = torch.nn.Sequential(Int8Linear(64, 32))
    with pytest.raises(ModelError, match="CPU kernels"):
        linears.finish(module, "meta")


def test_int8_is_calibrated_and_the_transformers_reference_reads_every_format(tmp_path):
    from splitinfer.model.shards import load_whole_hf

    model, shards = _prepare(tmp_path, "qwen2", "int8,local=int4")
    local = load_local(shards / "local")
    assert local.lm_head.smooth is not None  # SmoothQuant's factors from the calibration pass
    whole = load_whole_hf(shards)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        ours = open_client(local_only=True, shards=shards).generate(PROMPT, max_new_tokens=1, stop_ids=set())
        reference = whole(ids).logits[0, -1]
    # The same values through transformers' float kernels: the same first token, logits close.
    assert int(reference.argmax()) == ours.token_ids[0]
    assert not torch.allclose(whole.lm_head.weight, model.lm_head.weight)  # the int8 values, not the source's


@pytest.mark.parametrize("weights, warned", [("bfloat16", True), ("int8,lm_head=bfloat16", True), ("int4", False)])
def test_loading_bfloat16_weights_on_a_cpu_warns_that_speculation_is_not_exact(tmp_path, caplog, weights, warned):
    _, shards = _prepare(tmp_path, "llama", weights)
    load_local(shards / "local")
    assert ("speculative output may differ from sequential output" in caplog.text) is warned
