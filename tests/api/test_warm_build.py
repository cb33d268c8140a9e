"""drafter recycling on the tiny chat model (it has a tokenizer): deterministic for a seed, with a manifest
that names the model and the data, and found again by the model's fingerprint."""

from __future__ import annotations

import pytest
import torch

from splitinfer.errors import ConfigError
from splitinfer.decoding.warm import RecyclingTable, aggregate_successors, shipped_recycling_table, shipped_table_dirs
from splitinfer.model.manifest import model_identity
from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_whole_hf
from splitinfer.model.source import SourceModel
from splitinfer.recycling import build_from_drafter_data, build_recycling_table
from splitinfer.clients import open_client


def test_build_is_deterministic_and_the_table_loads_for_its_model_only(chat_shards, tmp_path):
    first = build_recycling_table(chat_shards, prompts=3, max_new_tokens=6, k=4, seed=5)
    again = build_recycling_table(chat_shards, prompts=3, max_new_tokens=6, k=4, seed=5)
    other = build_recycling_table(chat_shards, prompts=3, max_new_tokens=6, k=4, seed=6)
    assert first.successors == again.successors
    assert first.manifest["data_sha256"] == again.manifest["data_sha256"] != other.manifest["data_sha256"]
    m = first.manifest
    assert m["prompts"] == 3 and m["seed"] == 5 and m["k"] == 4 and m["table_tokens"] == len(first.successors)
    assert all(len(ids) <= 4 for ids, _ in first.successors.values())
    # The greedy replies ship with the table, searchable by suffix.
    assert len(first.replies.docs) == 3 and m["replies"] == 3 and m["reply_tokens"] == m["generated_tokens"]
    first.save(tmp_path / "tiny")
    identity = model_identity(open_client(local_only=True, shards=chat_shards).local.manifest)
    assert m["model_fingerprint"] == identity
    found = shipped_recycling_table(identity, [tmp_path / "tiny"])
    assert found.successors.keys() == first.successors.keys()
    assert shipped_recycling_table("another model", [tmp_path / "tiny"]) is None


def test_the_table_loads_for_the_same_model_cut_at_another_split(chat_shards, tmp_path):
    # The table holds token ids only: a shard of the same model with other head and tail depths (another
    # cloud fingerprint) gets it, as the draft head does.
    local = open_client(local_only=True, shards=chat_shards).local
    model = load_whole_hf(chat_shards)
    prepare(SourceModel("tiny-chat", model.config, model, local.tokenizer), tmp_path / "split-1-3", 1, 3, "float32")
    other = open_client(local_only=True, shards=tmp_path / "split-1-3").local
    assert other.fingerprint != local.fingerprint
    build_recycling_table(chat_shards, prompts=2, max_new_tokens=4, k=4, seed=1).save(tmp_path / "table")
    assert shipped_recycling_table(model_identity(other.manifest), [tmp_path / "table"]) is not None


def test_every_shipped_table_loads_and_names_its_model_and_data():
    for folder in shipped_table_dirs():
        table = RecyclingTable.load(folder)
        for key in ("model_fingerprint", "data_sha256", "seed", "prompts", "generated_tokens", "created", "command"):
            assert key in table.manifest, (folder, key)
        assert len(table.successors) == table.manifest["table_tokens"]
        assert len(table.replies.order) == table.manifest["reply_tokens"] == sum(map(len, table.replies.docs))


def test_a_table_from_drafter_data_reads_each_row_out_as_the_model_does(chat_shards, tmp_path):
    model = load_whole_hf(chat_shards).requires_grad_(False)
    seen = []
    handle = model.model.norm.register_forward_hook(lambda mod, args, out: seen.append(args[0][0]))
    sequences = []
    with torch.inference_mode():
        for seed in range(3):
            tokens = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(seed))
            logits = model(tokens[None]).logits[0]
            # As drafter train stores them: the features of every row but the last (row r predicts token r + 1).
            sequences.append(({"tokens": tokens.tolist(), "prompt_len": 4, "features": seen[-1][:-1].clone()}, logits[:-1]))
    handle.remove()
    data = {"sequences": [s for s, _ in sequences], "sha256": "d" * 64, "generated_tokens": 24,
            "config": {"tokens": 24, "prompts": 3, "seed": 7, "max_new_tokens": 8, "sampled_share": 0.5}}
    torch.save(data, tmp_path / "data.pt")
    table = build_from_drafter_data(chat_shards, tmp_path / "data.pt", k=4)
    expected, _ = aggregate_successors([(s["tokens"][:-1], logits) for s, logits in sequences], 4)
    assert table.successors.keys() == expected.keys()
    for token, (ids, ps) in expected.items():
        assert table.successors[token][0] == ids
        assert table.successors[token][1] == pytest.approx(ps, abs=1e-5)
    m = table.manifest
    assert m["data_sha256"] == "d" * 64 and m["seed"] == 7 and m["prompts"] == 3 and m["rows"] == 33
    assert table.replies.docs == [s["tokens"][4:] for s, _ in sequences] and m["reply_tokens"] == 24
    assert m["model_fingerprint"] == model_identity(open_client(local_only=True, shards=chat_shards).local.manifest)
    with pytest.raises(ConfigError, match="drafter train"):
        build_from_drafter_data(chat_shards, tmp_path / "missing.pt", k=4)
