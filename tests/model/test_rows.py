"""model/rows.py: the packed CPU linear computes F.linear's result, follows weight edits, and is used."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitinfer.model import rows
from splitinfer.model.shards import load_cloud, load_local
from tiny import prepare_tiny

pytestmark = pytest.mark.skipif(not rows.ONEDNN, reason="this torch build has no oneDNN linear")


@pytest.mark.parametrize("q", [1, 2, 3, 4, 5, 8, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(q, bias):
    gen = torch.Generator().manual_seed(q)
    layer = rows.use_row_kernels(nn.Linear(48, 96, bias=bias)).requires_grad_(False)
    x = torch.randn(1, q, 48, generator=gen)
    with torch.inference_mode():
        out = layer(x)
    assert type(layer) is rows.RowsLinear and (layer._packed is not None) == (q >= rows.PACKED_MIN_ROWS)
    assert out.shape == (1, q, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    out.view(1, q, 8, 12)  # HF attention views its projections: the result must allow it


def test_bfloat16_packed_linear_matches_f_linear():
    layer = rows.use_row_kernels(nn.Linear(64, 32)).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=2e-2, atol=2e-2)
    assert layer._packed is not None


def test_the_packed_copy_follows_in_place_edits_and_replaced_weights():
    layer = rows.use_row_kernels(nn.Linear(16, 8, bias=False)).requires_grad_(False)
    x = torch.randn(rows.PACKED_MIN_ROWS, 16)
    layer(x)
    assert layer._packed is not None
    with torch.no_grad():
        layer.weight.mul_(2)  # in place, as privatize does
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    layer.weight = nn.Parameter(torch.randn(4, 16), requires_grad=False)  # replaced, as tensor parallel does
    assert layer(x).shape == (rows.PACKED_MIN_ROWS, 4)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_a_deep_copy_drops_the_packed_copy_and_repacks():
    layer = rows.use_row_kernels(nn.Linear(8, 4)).requires_grad_(False)
    x = torch.randn(2, 8)
    layer(x)
    twin = copy.deepcopy(layer)
    assert twin._packed is None
    torch.testing.assert_close(twin(x), layer(x))


def test_autograd_and_other_dtypes_keep_f_linear():
    layer = rows.use_row_kernels(nn.Linear(8, 4))
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()  # training (the draft head) needs gradients: no packed copy
    assert layer._packed is None and x.grad is not None
    assert not rows.packs(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))


def test_use_row_kernels_switches_plain_linears_and_keeps_their_weights():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), Custom(6, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows.use_row_kernels(model)
    assert type(model[0]) is rows.RowsLinear and type(model[2]) is Custom
    model(torch.randn(3, 4))
    assert set(model.state_dict()) == set(before)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_loaded_shards_use_the_packed_linear(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    linears = [m for half in (load_local(shards / "local"), load_cloud(shards / "cloud"))
               for m in vars(half).values() if isinstance(m, nn.Module) for m in m.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is rows.RowsLinear for m in linears)
