"""`drafter train` on the shipped model at a toy size: it trains, resumes to the same head, and records itself."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace

import pytest
import torch
from safetensors.torch import load_file

from splitinfer.drafter import data as drafter_data
from splitinfer.drafter import train, training
from splitinfer.drafter import corpus
from splitinfer.drafter.schedule import STABLE
from splitinfer.drafter.corpus import benchmark_prompts, build_prompts, check_no_overlap
from splitinfer.errors import ConfigError
from splitinfer.model.drafthead import HEAD_WEIGHTS

TOY = train.TrainConfig(tokens=24, prompts=8, steps=4, max_new_tokens=6, generate_batch=4, batch=2, window=16,
                        draft_vocab_size=256, intermediate_size=64, checkpoint_every=2, warmup_steps=1)


def test_prompts_never_contain_benchmark_prompts():
    prompts = build_prompts(40, seed=0)
    assert len(prompts) == 40 and len(set(prompts)) > 20
    check_no_overlap(prompts, benchmark_prompts())
    with pytest.raises(ConfigError):
        check_no_overlap(prompts + ["Please: " + benchmark_prompts()[0]], benchmark_prompts())


def test_corpus_2_leaves_out_every_fill_on_an_evaluated_topic_and_corpus_1_kept_them():
    evaluated = corpus.evaluation_prompts()
    assert len(evaluated) == 30
    fills = [fill for _, fills in corpus.SYNTHETIC for fill in fills]
    kept = [fill for _, fills in corpus.SYNTHETIC for fill in corpus._fills(fills, 2)]
    assert not [(f, p) for f in kept for p in evaluated if corpus.on_topic(f, p)]
    assert {"a lighthouse keeper", "why the sky is blue"} <= set(fills) - set(kept)
    assert len(set(kept)) > 0.85 * len(set(fills))  # the rest stay (85 of 96)
    old, new = build_prompts(400, seed=0, corpus=1), build_prompts(400, seed=0, corpus=2)
    assert any("lighthouse keeper" in p for p in old) and not any("lighthouse keeper" in p for p in new)
    assert corpus.on_topic("a lighthouse keeper", "A story about a lonely lighthouse keeper.")
    assert not corpus.on_topic("a baker who wakes up early", "Compose a limerick about a baker whose bread would not rise.")
    with pytest.raises(ConfigError, match="corpus version"):
        build_prompts(4, seed=0, corpus=3)
    with pytest.raises(ValueError, match="corpus"):
        train.TrainConfig(corpus=0)


def test_train_drafter_resumes_to_the_same_head_and_writes_a_manifest(smollm2_shards, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    straight = train.run_training(smollm2_shards, tmp_path / "straight", TOY)
    for field in ("model_fingerprint", "data_sha256", "generated_tokens", "seed", "steps", "train_wall_s", "losses"):
        assert field in straight, field
    assert straight["steps"] == 4 and straight["generated_tokens"] >= 24 and len(straight["losses"]["curve"]) == 4

    interrupted = tmp_path / "interrupted"
    real_step = training._step_loss
    calls = {"n": 0}

    def failing_step(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # stopped after the checkpoint at step 2
        return real_step(*args)

    monkeypatch.setattr(training, "_step_loss", failing_step)
    with pytest.raises(KeyboardInterrupt):
        train.run_training(smollm2_shards, interrupted, TOY)
    monkeypatch.setattr(training, "_step_loss", real_step)
    resumed = train.run_training(smollm2_shards, interrupted, TOY)
    assert resumed["data_sha256"] == straight["data_sha256"]
    a, b = load_file(str(tmp_path / "straight" / HEAD_WEIGHTS)), load_file(str(interrupted / HEAD_WEIGHTS))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((interrupted / "manifest.json").read_text())["losses"] == straight["losses"]
    with pytest.raises(ConfigError):  # the data was made with other options
        train.run_training(smollm2_shards, interrupted, replace(TOY, seed=1))


def test_the_shipped_head_is_made_for_the_shipped_model_and_prepare_installs_only_a_match(smollm2_shards, tmp_path):
    from splitinfer.local.client import load_draft_head
    from splitinfer.model.commands import install_shipped_drafter
    from splitinfer.model.drafthead import DRAFTER_DIR
    from splitinfer.model.manifest import model_identity, read_manifest
    from splitinfer.model.shards import load_local

    from tiny import prepare_tiny

    local = tmp_path / "local"
    local.mkdir()
    for name in ("manifest.json", "config.json"):  # what install reads: the model's identity
        (local / name).write_text((smollm2_shards / "local" / name).read_text())
    assert "installed" in install_shipped_drafter(local)
    shipped = json.loads((local / DRAFTER_DIR / "manifest.json").read_text())
    assert shipped["model_fingerprint"] == model_identity(read_manifest(smollm2_shards / "local", "local"))
    # `splitinfer drafter train --tokens 200000 --prompts 2400 --schedule cosine` remakes it (the data the shipped
    # successor table was built from): every other recorded option is today's default.
    recipe = {k: v for k, v in asdict(train.TrainConfig(tokens=200_000, prompts=2400, schedule="cosine")).items()
              if k != "device"}
    assert train.made_with(shipped["config"], recipe) == recipe and shipped["steps"] == recipe["steps"]
    # The successor table and its replies were built from the same data run (`drafter recycling --from-data`).
    assert json.loads((local / DRAFTER_DIR / "recycling.json").read_text())["data_sha256"] == shipped["data_sha256"]
    head = load_draft_head(load_local(smollm2_shards / "local"), local, "auto")
    assert head is not None and head.config.draft_vocab_size == train.TrainConfig().draft_vocab_size
    _, tiny = prepare_tiny(tmp_path, "llama", 1, 1)
    assert "no shipped draft head matches" in install_shipped_drafter(tiny / "local")
    assert not (tiny / "local" / DRAFTER_DIR).exists()


def test_a_bfloat16_generator_is_a_cast_copy_and_leaves_the_model_alone():
    from tiny import tiny_model

    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert drafter_data.generator_model(model, "float32") is model
    copy = drafter_data.generator_model(model, "bfloat16")
    assert copy is not model and all(p.dtype == torch.bfloat16 for p in copy.parameters())
    assert all(torch.equal(v, model.state_dict()[k]) and v.dtype == torch.float32 for k, v in before.items())
    with pytest.raises(ValueError, match="generate_dtype"):
        train.TrainConfig(generate_dtype="int8")


def test_bfloat16_data_records_its_dtype_and_is_not_mixed_with_float32_data(smollm2_shards, tmp_path):
    torch.set_num_threads(1)
    config = replace(TOY, steps=2, generate_dtype="bfloat16")
    manifest = train.run_training(smollm2_shards, tmp_path, config)
    data = torch.load(tmp_path / train.DATA, weights_only=False)
    assert data["config"]["generate_dtype"] == "bfloat16" and manifest["config"]["generate_dtype"] == "bfloat16"
    features = [s["features"] for s in data["sequences"]]
    assert all(f.dtype == torch.float16 and bool(torch.isfinite(f).all()) for f in features)
    assert manifest["generated_tokens"] >= 24 and manifest["steps"] == 2
    with pytest.raises(ConfigError, match="other options"):  # float32 data would need its own --out
        train.run_training(smollm2_shards, tmp_path, replace(config, generate_dtype="float32"))


def test_a_run_extended_with_more_steps_ends_with_the_head_of_the_longer_run(smollm2_shards, tmp_path):
    torch.set_num_threads(1)
    short = replace(TOY, steps=4, decay_share=0.5, checkpoint_every=1)  # warm-up 1 step, decay from step 2
    long = replace(short, steps=8)
    straight, extended = tmp_path / "straight", tmp_path / "extended"
    train.run_training(smollm2_shards, straight, long)
    extended.mkdir()
    shutil.copy(straight / train.DATA, extended / train.DATA)  # the same data, not made twice
    train.run_training(smollm2_shards, extended, short)
    assert torch.load(extended / STABLE, weights_only=False)["step"] == 2
    manifest = train.run_training(smollm2_shards, extended, long)  # resumes from step 2, before the decay
    a, b = load_file(str(straight / HEAD_WEIGHTS)), load_file(str(extended / HEAD_WEIGHTS))
    assert all(torch.equal(a[k], b[k]) for k in a) and manifest["steps"] == 8
    with pytest.raises(ConfigError, match="resume with the --steps it was made with"):
        train.run_training(smollm2_shards, extended, replace(long, steps=9, schedule="cosine"))


def test_a_fused_head_trains_on_the_states_that_cross_the_wire(smollm2_shards, tmp_path):
    """--fuse keeps the head layers' and the cloud layers' outputs with the data and trains the head's fuse
    projection on them (it starts at zero, so a step that moved it read them)."""
    torch.set_num_threads(1)
    manifest = train.run_training(smollm2_shards, tmp_path, replace(TOY, fuse=True))
    assert list(manifest["head"]["fused_layers"]) == [2, 28] and manifest["config"]["fuse"]
    data = torch.load(tmp_path / train.DATA, weights_only=False)
    assert all(s["fused"].shape == (s["features"].shape[0], 2 * 576) for s in data["sequences"])
    assert load_file(str(tmp_path / HEAD_WEIGHTS))["fuse.weight"].abs().max() > 0
    with pytest.raises(ConfigError, match="other options"):
        train.run_training(smollm2_shards, tmp_path, TOY)  # data without the states cannot be reused


def test_a_run_trains_on_finished_runs_data_beside_its_own_and_records_every_part(smollm2_shards, tmp_path):
    """--with-data: another finished run's data join this run's (each part holds out its own every n-th
    sequence); the manifest counts every part and names each; a run that is not finished, of other options
    that change the features, or whose data changed since its manifest is refused."""
    torch.set_num_threads(1)
    first = train.run_training(smollm2_shards, tmp_path / "first", replace(TOY, steps=2))
    alone = train.run_training(smollm2_shards, tmp_path / "alone", replace(TOY, seed=1, steps=2))
    both = train.run_training(smollm2_shards, tmp_path / "both", replace(TOY, seed=1, steps=2, with_data=str(tmp_path / "first")))
    assert both["data_sha256"] == alone["data_sha256"]
    assert both["generated_tokens"] == first["generated_tokens"] + alone["generated_tokens"]
    assert both["training_pairs"] == first["training_pairs"] + alone["training_pairs"]
    assert both["with_data"] == [{"out": str(tmp_path / "first"), "source": "templates",
                                  **{k: first[k] for k in ("data_sha256", "generated_tokens", "prompts", "generate_wall_s")}}]
    a, b = load_file(str(tmp_path / "alone" / HEAD_WEIGHTS)), load_file(str(tmp_path / "both" / HEAD_WEIGHTS))
    assert not all(torch.equal(a[k], b[k]) for k in a)  # the other run's windows were drawn too
    data = torch.load(tmp_path / "first" / train.DATA, weights_only=False)["sequences"]
    flagged = drafter_data.flag_heldout([dict(s) for s in data], TOY.heldout_every)
    assert [s["heldout"] for s in flagged] == [i % 25 == 24 for i in range(len(data))]
    with pytest.raises(ConfigError, match="no finished drafter run"):
        train.run_training(smollm2_shards, tmp_path / "both", replace(TOY, seed=1, steps=2, with_data=str(tmp_path / "none")))
    with pytest.raises(ConfigError, match="fused otherwise"):
        train.run_training(smollm2_shards, tmp_path / "fused", replace(TOY, steps=2, fuse=True, with_data=str(tmp_path / "first")))
    data = torch.load(tmp_path / "first" / train.DATA, weights_only=False)
    data["sequences"] = data["sequences"][:-1]
    torch.save(data, tmp_path / "first" / train.DATA)
    with pytest.raises(ConfigError, match="no longer match"):
        train.run_training(smollm2_shards, tmp_path / "both", replace(TOY, seed=1, steps=2, with_data=str(tmp_path / "first")))
