"""bench acceptance: depth counting on hand-made steps, and a run over a tiny model that must stay exact."""

from __future__ import annotations

import pytest

from splitinfer.bench.acceptance import _merge, depth_counts, markdown, measure
from splitinfer.errors import ConfigError

from tiny import prepare_tiny


def test_depth_counts_test_a_depth_only_where_the_draft_reached_it():
    # step 1: 2 accepted, a third offered (rejected); step 2: 0 accepted, nothing offered;
    # step 3: 3 accepted, but only 1 more token was emitted (the limit): depth 2 and 3 never counted.
    counts = depth_counts([(2, True), (0, False), (3, True)], emitted=3 + 1 + 2)
    assert counts["tries"] == {1: 2, 2: 1, 3: 1}
    assert counts["hits"] == {1: 2, 2: 1}
    merged = _merge([counts])
    assert merged["acceptance_by_depth"] == {1: 1.0, 2: 1.0, 3: 0.0}
    assert merged["tokens_per_step"] == pytest.approx(6 / 3, abs=1e-3)


def test_measure_runs_every_source_exactly_and_reports_by_category(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 2, 1)
    repeated = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7] * 3
    prompts = [{"id": "a", "category": "grounded", "prompt": repeated},
               {"id": "b", "category": "code", "prompt": [5, 6, 7, 8, 9, 10, 11]}]
    sources = measure(shards, prompts, ["suffix", "suffix-memory", "recycling", "tree", "sequential"], 6, 20)
    assert set(sources["tree"]["by_category"]) == {"grounded", "code"}
    assert sources["sequential"]["all"]["tokens_per_step"] == 1.0 and not sources["sequential"]["fixed_nodes"]
    # Steps times tokens per step add up to the tokens after the first one, for every source.
    for s in sources.values():
        assert sum(v["tokens"] for v in s["per_prompt"].values()) == 2 * 19
    assert sources["tree"]["all"]["tokens_per_step"] > 1.0  # the repeated prompt is copied
    report = {"model": "tiny", "command": "c", "setup": "s", "sources": sources}
    assert "| tree |" in markdown(report)
    with pytest.raises(ConfigError, match="recycling table"):
        measure(shards, prompts, ["tree-warm"], 6, 20)


def test_head_sources_measure_a_given_head_exactly_and_need_one(tmp_path):
    from splitinfer.clients import open_client
    from splitinfer.model.manifest import model_identity

    from tiny import random_head

    _, shards = prepare_tiny(tmp_path, "llama", 2, 1)
    local = open_client(local_only=True, shards=shards).local
    random_head(local, vocab=40).save(tmp_path / "head", extra={"model_fingerprint": model_identity(local.manifest)})
    prompts = [{"id": "a", "category": "code", "prompt": [5, 6, 7, 8, 9, 10, 11]}]
    sources = measure(shards, prompts, ["head"], 6, 20, head_dir=tmp_path / "head")
    assert sources["head"]["all"]["steps"] >= 1 and sources["head"]["fixed_nodes"]
    with pytest.raises(ConfigError, match="needs a draft head"):
        measure(shards, prompts, ["head"], 6, 20)
    random_head(local, vocab=40).save(tmp_path / "other", extra={"model_fingerprint": "another model"})
    with pytest.raises(ConfigError, match="another model"):
        measure(shards, prompts, ["head"], 6, 20, head_dir=tmp_path / "other")


def test_a_node_sweep_is_one_run_with_a_row_per_size(tmp_path):
    from splitinfer.bench.acceptance import source_spec

    assert source_spec("tree", 16) == ("tree", 16) and source_spec("tree@8", 16) == ("tree", 8)
    for bad in ("tree@0", "tree@x", "tree@", "sequential@8"):
        with pytest.raises(ConfigError):
            source_spec(bad, 16)
    _, shards = prepare_tiny(tmp_path, "llama", 2, 1)
    prompts = [{"id": "a", "category": "code", "prompt": [3, 17, 42, 5, 88, 21, 9, 60, 33, 7] * 3}]
    sources = measure(shards, prompts, ["tree@1", "tree@8"], 6, 20)
    assert [sources[s]["nodes"] for s in ("tree@1", "tree@8")] == [1, 8]
    # One node a step can accept at most one draft token; eight can accept more on a copied prompt.
    assert sources["tree@1"]["all"]["tokens_per_step"] <= 2.0
    assert max(sources["tree@1"]["all"]["acceptance_by_depth"]) == 1
    assert sources["tree@8"]["all"]["tokens_per_step"] > sources["tree@1"]["all"]["tokens_per_step"]
