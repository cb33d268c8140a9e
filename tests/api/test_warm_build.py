"""build-recycling on the tiny chat model (it has a tokenizer): deterministic for a seed, with a manifest
that names the model and the data, and found again by the model's fingerprint."""

from __future__ import annotations

from splitinfer.recycling import build_recycling_table
from splitinfer.decoding.warm import RecyclingTable, shipped_recycling_table, shipped_table_dirs
from splitinfer.inprocess import local_only_client


def test_build_is_deterministic_and_the_table_loads_for_its_model_only(chat_shards, tmp_path):
    first = build_recycling_table(chat_shards, prompts=3, max_new_tokens=6, k=4, seed=5)
    again = build_recycling_table(chat_shards, prompts=3, max_new_tokens=6, k=4, seed=5)
    other = build_recycling_table(chat_shards, prompts=3, max_new_tokens=6, k=4, seed=6)
    assert first.successors == again.successors
    assert first.manifest["data_sha256"] == again.manifest["data_sha256"] != other.manifest["data_sha256"]
    m = first.manifest
    assert m["prompts"] == 3 and m["seed"] == 5 and m["k"] == 4 and m["table_tokens"] == len(first.successors)
    assert all(len(ids) <= 4 for ids, _ in first.successors.values())
    first.save(tmp_path / "tiny")
    fingerprint = local_only_client(chat_shards).local.fingerprint
    assert m["model_fingerprint"] == fingerprint
    found = shipped_recycling_table(fingerprint, [tmp_path / "tiny"])
    assert found.successors.keys() == first.successors.keys()


def test_every_shipped_table_loads_and_names_its_model_and_data():
    for folder in shipped_table_dirs():
        table = RecyclingTable.load(folder)
        for key in ("model_fingerprint", "data_sha256", "seed", "prompts", "generated_tokens", "created", "command"):
            assert key in table.manifest, (folder, key)
        assert len(table.successors) == table.manifest["table_tokens"]
