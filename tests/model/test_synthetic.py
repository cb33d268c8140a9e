"""model/synthetic.py: seeded random shards in a config's shape load and run like prepared ones, are marked
synthetic, match across separate makes, and are refused by the commands that produce text."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from splitinfer.cli import main
from splitinfer.model.manifest import WEIGHTS, sha256_file
from splitinfer.model.shards import load_cloud, load_local
from splitinfer.model.synthetic import prepare_synthetic, tensor_layout
from splitinfer.model.stack import config_from_dict
from tiny import COMMON

TINY = {"model_type": "mistral", **COMMON, "sliding_window": 12, "_note": "left out of the shard"}


def tiny_config(tmp_path, **changes):
    path = tmp_path / "tiny-config.json"
    path.write_text(json.dumps({**TINY, **changes}))
    return path


def test_shards_load_run_and_are_marked(tmp_path):
    out = prepare_synthetic(str(tiny_config(tmp_path)), tmp_path / "s", seed=3, dtype="float32", cloud_dtype="bfloat16")
    local_m = json.loads((out / "local" / "manifest.json").read_text())
    cloud_m = json.loads((out / "cloud" / "manifest.json").read_text())
    for m, dtype in ((local_m, "float32"), (cloud_m, "bfloat16")):
        assert m["synthetic"] is True and m["synthetic_source"]["seed"] == 3 and m["dtype"] == dtype
        assert m["model_id"] == "synthetic/tiny-config" and not m["has_tokenizer"]
    assert local_m["cloud_fingerprint"] == cloud_m["cloud_fingerprint"]
    assert "_note" not in json.loads((out / "local" / "config.json").read_text())
    for side in ("local", "cloud"):  # the hashes written on the way are the files' own
        assert json.loads((out / side / "manifest.json").read_text())["files"][WEIGHTS] == sha256_file(out / side / WEIGHTS)
    local, cloud = load_local(out / "local"), load_cloud(out / "cloud")  # verify=True: hashes checked
    assert set(load_file(str(out / "cloud" / WEIGHTS))) == {
        k for k in tensor_layout(config_from_dict(TINY)) if k.startswith("model.layers.") and 1 < int(k.split(".")[2]) < 4}
    assert cloud.stack.start == 2 and cloud.stack.end == 4 and next(cloud.stack.parameters()).dtype == torch.bfloat16
    weights = load_file(str(out / "local" / WEIGHTS))
    assert torch.all(weights["model.norm.weight"] == 1)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert 0.015 < float(q.std()) < 0.025 and float(q.abs().max()) <= 0.02 * 3**0.5 + 1e-6
    with torch.inference_mode():  # a whole split step on random weights stays finite
        n = 9
        causal = np.tril(np.ones((n, n), dtype=bool))
        hidden = local.head(local.embed(torch.arange(n)[None]), torch.arange(n), causal, local.head.new_cache())
        hidden = cloud.stack(hidden.to(torch.bfloat16), torch.arange(n), causal, cloud.stack.new_cache()).float()
        logits = local.logits(local.tail(hidden, torch.arange(n), causal, local.tail.new_cache()))
    assert logits.shape == (n, TINY["vocab_size"]) and torch.isfinite(logits).all()


def test_seeded_and_separately_made_sides_match(tmp_path):
    config = str(tiny_config(tmp_path, tie_word_embeddings=True, model_type="qwen2"))
    a = prepare_synthetic(config, tmp_path / "a", seed=1, sides=("local",))
    b = prepare_synthetic(config, tmp_path / "b", seed=1, sides=("cloud",))
    c = prepare_synthetic(config, tmp_path / "c", seed=2)
    assert not (a / "cloud").exists() and not (b / "local").exists()
    fp = {name: json.loads((d / side / "manifest.json").read_text())["cloud_fingerprint"]
          for name, d, side in (("a", a, "local"), ("b", b, "cloud"), ("c", c, "local"))}
    assert fp["a"] == fp["b"] != fp["c"]  # same arguments shake hands; another seed does not
    assert sha256_file(a / "local" / WEIGHTS) == sha256_file(prepare_synthetic(config, tmp_path / "d", 1) / "local" / WEIGHTS)
    assert sha256_file(a / "local" / WEIGHTS) != sha256_file(c / "local" / WEIGHTS)
    assert "lm_head.weight" not in load_file(str(a / "local" / WEIGHTS))  # tied: the embedding's
    load_local(a / "local")


def test_packaged_names_resolve_to_their_shapes():
    from splitinfer.model.synthetic import synthetic_config

    label, data = synthetic_config("mistral-7b-v0.1")
    shapes = tensor_layout(config_from_dict(data))  # meta device: no storage
    assert label == "mistral-7b-v0.1" and shapes["model.embed_tokens.weight"] == (32000, 4096)
    assert shapes["model.layers.0.mlp.up_proj.weight"] == (14336, 4096) and len(shapes) == 2 + 1 + 32 * 9


def test_cli_prepares_and_text_commands_refuse(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["prepare", "--synthetic", str(tiny_config(tmp_path)), "--seed", "5", "--out", str(out),
                 "--head-layers", "1", "--tail-layers", "1"]) == 0
    assert "synthetic local shard" in capsys.readouterr().out
    for argv in (["generate", "--prompt", "hi", "--shard", str(out / "local"), "--server", "ws://127.0.0.1:9"],
                 ["generate", "--prompt", "hi", "--local-only", "--shards", str(out)],
                 ["chat", "--shard", str(out / "local"), "--server", "ws://127.0.0.1:9"],
                 ["demo", "--shards", str(out)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "synthetic weights" in err and f"splitinfer {argv[0]}` refuses" in err
    assert main(["prepare", "--synthetic", str(tiny_config(tmp_path)), "--out", str(out), "--sides", "middle"]) == 2
    assert "--sides takes local, cloud or both" in capsys.readouterr().err
    assert main(["prepare", "--synthetic", "no-such-model", "--out", str(out)]) == 2
    assert "mistral-7b-v0.1" in capsys.readouterr().err  # the names it knows


@pytest.mark.parametrize("spec, tied", [("int8", False), ("int4,lm_head=int8", True), ("bfloat16,lm_head=float32", False)])
def test_weight_formats(tmp_path, spec, tied):
    """`--weights` as prepare lays it out (model/formats.py): integer state under the linears' names, the LM
    head in its own format (stored for a tied model too), loaded into the modules that multiply by them."""
    from splitinfer.model import formats

    config = str(tiny_config(tmp_path, tie_word_embeddings=tied))
    weights = formats.WeightFormats.parse(spec)
    out = prepare_synthetic(config, tmp_path / "s", seed=0, weights=weights)
    manifest = json.loads((out / "cloud" / "manifest.json").read_text())
    assert manifest["weights"] == weights.as_dict() and manifest["dtype"] == "float32"
    stored = load_file(str(out / "local" / WEIGHTS))
    head_format = formats.stored_format(stored, "lm_head.") or str(stored["lm_head.weight"].dtype).removeprefix("torch.")
    assert head_format == weights.lm_head
    layer_format = formats.stored_format(stored, "model.layers.0.mlp.up_proj.")
    assert (layer_format or str(stored["model.layers.0.mlp.up_proj.weight"].dtype).removeprefix("torch.")) == weights.local
    assert stored["model.embed_tokens.weight"].dtype == torch.float32  # the embedding stays in the compute dtype
    if weights.local == "int8":  # smoothed, as a calibrated prepare stores it: a factor an input channel
        assert stored["model.layers.0.mlp.up_proj.smooth"].shape == (TINY["hidden_size"],)
    local, cloud = load_local(out / "local"), load_cloud(out / "cloud")
    with torch.inference_mode():
        n = 5
        causal = np.tril(np.ones((n, n), dtype=bool))
        hidden = local.head(local.embed(torch.arange(n)[None]), torch.arange(n), causal, local.head.new_cache())
        hidden = cloud.stack(hidden, torch.arange(n), causal, cloud.stack.new_cache())
        logits = local.logits(local.tail(hidden, torch.arange(n), causal, local.tail.new_cache()))
    assert torch.isfinite(logits).all()
