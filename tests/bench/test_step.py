"""bench/step.py: the step benchmark runs both implementations of each side on a tiny model, writes its
report, and its guard fails exactly when a ratio is over the margin (ratios are measured, never asserted)."""

import json

import pytest
import torch

from splitinfer.bench import anchors, step
from splitinfer.bench.step import StepBenchConfig
from tiny import prepare_tiny


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_both_sides_run_and_the_anchor_computes_the_same_layers(tmp_path, family):
    _, shards = prepare_tiny(tmp_path, family, 1, 1)
    sides = step.build_sides(shards, (5,), (3,))
    assert [s.name for s in sides] == ["cloud", "local"]
    # The anchor is plain transformers over the same weights: on the same causal block it computes the same
    # hidden states (cloud) and logits (local), and its cache rolls back as ours does.
    for side in sides:
        hidden = side.block(3)
        assert hidden.shape == (1, 3, side.d)
        for _ in range(2):
            torch.testing.assert_close(side.ours(3, hidden), side.anchor(3, hidden), rtol=1e-4, atol=1e-4)
    cloud = sides[0]
    assert all(type(m) is torch.nn.Linear for m in cloud.hf.modules() if isinstance(m, torch.nn.Linear))
    if family == "llama":  # the compute bound counts every weight product of the side, from the config
        c = cloud.stacks[0].config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        per_layer = 2 * c.hidden_size * c.num_attention_heads * head_dim + 3 * c.hidden_size * c.intermediate_size \
            + 2 * c.hidden_size * c.num_key_value_heads * head_dim
        assert cloud.product_flops(3) == 2 * 3 * per_layer * len(cloud.stacks[0].layers)


def test_the_report_and_the_guard(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    config = StepBenchConfig(rows=(1, 4), contexts=(8,), repeats=1, cpu=-1)
    report = step.run_step_bench(shards, tmp_path / "out", config, log=lambda _: None)
    saved = json.loads((tmp_path / "out" / "step.json").read_text())
    assert saved["rows"] == report["rows"] and len(report["rows"]) == 4
    row = report["rows"][0]
    assert row["splitinfer_ms"] > 0 and row["transformers_ms"] > 0 and row["bound_ms"] > 0
    assert row["compute_bound_ms"] > 0 and report["product_peak_gflops"] > 0
    assert set(row["breakdown_ms"]) == set(step.GROUPS)
    for r in report["rows"]:  # the step over its weights' bytes (the bound less the cached keys) plus its attention
        assert r["weights_bound_ms"] <= r["bound_ms"]
        below = r["weights_bound_ms"] + r["breakdown_ms"]["attention"]
        assert r["x_weights_attention"] == (round(r["splitinfer_ms"] / below, 2) if below else None)
    assert "| cloud | 8 | 1 |" in (tmp_path / "out" / "step.md").read_text()
    strict = step.guard(report, StepBenchConfig(max_ratio=1e-9))
    loose = step.guard(report, StepBenchConfig(max_ratio=1e9))
    assert not strict["passed"] and len(strict["failures"]) == 4 and loose["passed"]


def test_generations_compare_local_only_with_transformers_greedy(tmp_path):
    from splitinfer.clients import open_client
    from splitinfer.local.config import ClientConfig
    from splitinfer.model.shards import load_whole_hf

    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    client = open_client(local_only=True, shards=shards, config=ClientConfig(drafter="off"))
    out = anchors.generations(client, load_whole_hf(shards), {"a": [1, 5, 7], "b": [3, 3]}, 6, 1, log=lambda _: None)
    assert out["identical"] == "2 of 2" and len(out["runs"]) == 2 and out["ratio"] > 0


def test_one_side_of_a_synthetic_shard(tmp_path):
    """A synthetic shard (random weights in a config's shape) is timed like a model's; only the shards of the
    sides asked for are loaded, so a shard directory may hold one side."""
    from splitinfer.model.synthetic import prepare_synthetic
    from tiny import COMMON

    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"model_type": "llama", **COMMON}))
    shards = prepare_synthetic(str(config), tmp_path / "s", seed=0, sides=("local",))
    run = StepBenchConfig(rows=(1, 4), contexts=(8,), repeats=1, cpu=-1, sides=("local",), dtype="bfloat16")
    report = step.run_step_bench(shards, tmp_path / "out", run, log=lambda _: None)
    assert {r["side"] for r in report["rows"]} == {"local"} and report["dtype"] == "bfloat16"
    assert report["synthetic"]["config"] == "cfg" and "Synthetic weights" in (tmp_path / "out" / "step.md").read_text()
    cloud = prepare_synthetic(str(config), tmp_path / "c", seed=0, sides=("cloud",))  # no local shard: random inputs
    sides = step.build_sides(cloud, (5,), (3,), sides=("cloud",))
    assert [s.name for s in sides] == ["cloud"]
    torch.testing.assert_close(sides[0].ours(3, sides[0].block(3)), sides[0].anchor(3, sides[0].block(3)), rtol=1e-4, atol=1e-4)


def test_an_integer_format_is_bounded_by_its_stored_bytes(tmp_path):
    """A step's bytes bound counts an int8/int4 shard's stored state (buffers), and its flops the quantized
    linears: the same products as float32, about a quarter (int8) of the layers' bytes."""
    from splitinfer.model.formats import WeightFormats
    from splitinfer.model.synthetic import prepare_synthetic
    from tiny import COMMON

    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"model_type": "llama", **COMMON}))
    sides = {}
    for spec in ("float32", "int8"):
        shards = prepare_synthetic(str(config), tmp_path / spec, seed=0, sides=("local",), weights=WeightFormats.parse(spec))
        sides[spec] = step.build_sides(shards, (4,), (2,), sides=("local",))[0]
    f32, i8 = sides["float32"], sides["int8"]
    assert i8.product_flops(2) == f32.product_flops(2) > 0
    # integer products are bounded by the int8 dot-product peak, float ones (and all without it) by the float peak
    flops = f32.product_flops(2)
    assert f32.compute_bound_ms(2, 100.0, 400.0) == flops / 100.0 / 1e6
    assert i8.compute_bound_ms(2, 100.0, 400.0) == flops / 400.0 / 1e6
    assert i8.compute_bound_ms(2, 100.0, None) == flops / 100.0 / 1e6
    linear = sum(m.in_features * m.out_features for s in f32.stacks for m in s.modules() if isinstance(m, torch.nn.Linear))
    linear += f32.tail[1].in_features * f32.tail[1].out_features  # the LM head
    linears = [m for s in f32.stacks for m in s.modules() if isinstance(m, torch.nn.Linear)] + [f32.tail[1]]
    rows = sum(m.out_features for m in linears)
    # the siblings fused at load (model/fused.py) share one smoothing vector: q/k/v one, gate/up another
    shared = ("k_proj", "v_proj", "up_proj")
    columns = sum(m.in_features for s in f32.stacks for n, m in s.named_modules()
                  if isinstance(m, torch.nn.Linear) and not n.endswith(shared)) + f32.tail[1].in_features
    # int8: a byte a weight, a float32 scale a row, a float32 smoothing factor an input channel (SmoothQuant)
    assert f32.streamed_bytes() - i8.streamed_bytes() == linear * 4 - (linear + rows * 4 + columns * 4)
    i8.ours(2, i8.block(2)), i8.anchor(2, i8.block(2))
