"""model/rows.py: the few-rows product computes F.linear's result, and only where it is meant to."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitinfer.model import rows
from splitinfer.model.shards import load_cloud, load_local
from tiny import prepare_tiny


@pytest.mark.parametrize("q", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(q, bias):
    gen = torch.Generator().manual_seed(q)
    weight = torch.randn(96, 48, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(1, q, 48, generator=gen)
    out = rows.linear(x, weight, b)
    assert out.shape == (1, q, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    out.view(1, q, 8, 12)  # HF attention views its projections: the result must allow it


def test_only_a_few_float32_cpu_rows_take_the_other_form():
    w = torch.randn(8, 4)
    assert [q for q in range(1, 10) if rows.small_rows(torch.randn(q, 4), w)] == list(range(1, rows.SMALL_ROWS_MAX + 1))
    assert rows.small_rows(torch.randn(1, 3, 4), w)  # leading dims count as rows
    assert not rows.small_rows(torch.randn(3, 4, dtype=torch.float64), w.double())
    assert not rows.small_rows(torch.randn(3, 4).bfloat16(), w.bfloat16())


def test_use_row_kernels_switches_plain_linears_and_keeps_their_weights():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), Custom(6, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows.use_row_kernels(model)
    assert type(model[0]) is rows.RowsLinear and type(model[2]) is Custom
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), model[2](F.relu(F.linear(x, model[0].weight, model[0].bias))))


def test_loaded_shards_use_the_few_rows_form(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    linears = [m for half in (load_local(shards / "local"), load_cloud(shards / "cloud"))
               for m in vars(half).values() if isinstance(m, nn.Module) for m in m.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is rows.RowsLinear for m in linears)
