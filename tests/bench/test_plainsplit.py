"""bench/plainsplit.py and bench/plaincloud.py: the plain transformers split decodes what transformers greedy
decodes, sends what splitinfer's split sequential sends, refuses what it does not run, and its report pairs
the two splits prompt by prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from contextlib import contextmanager

import pytest
import torch

from splitinfer.bench import plaincloud, plainsplit
from splitinfer.cloud.server import ServerThread
from splitinfer.launch import free_port
from splitinfer.clients import open_client
from splitinfer.masks import BlockStructure
from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_cloud
from splitinfer.model.source import SourceModel
from splitinfer.wire.messages import Error, Hello, Limits, Step, Welcome, decode_server_message

from tiny import char_tokenizer, hf_greedy, min_margin, prepare_tiny, tiny_model

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71]


@contextmanager
def plain_server(shards):
    """The plain cloud half on a loopback port, in a thread: (URL, its PlainCloud)."""
    model, manifest = plaincloud.load_cloud_part(shards / "cloud")
    cloud = plaincloud.PlainCloud(model, manifest)
    port = free_port()
    server = plaincloud.serve(cloud, port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"ws://127.0.0.1:{port}", cloud
    finally:
        server.shutdown()
        thread.join(timeout=10)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_the_plain_split_decodes_what_transformers_greedy_decodes(tmp_path, family):
    model, shards = prepare_tiny(tmp_path, family, 2, 1)
    expected = hf_greedy(model, PROMPT, 16)
    assert min_margin(model, PROMPT, expected) > 1e-3  # not a near-tie: the comparison means something
    with plain_server(shards) as (url, cloud):
        client = plaincloud.PlainSplitClient(shards / "local", url, "float32")
        first = client.generate(PROMPT, 16, set())
        second = client.generate(PROMPT, 16, set())  # a fresh session and caches each time
    assert first["token_ids"] == expected == second["token_ids"]
    assert len(first["steps"]) == 15 and cloud.sessions == 2
    # transformers' own modules compute both halves: plain nn.Linear, sdpa, nothing from splitinfer
    for part in (client.head, client.tail, cloud.model):
        assert part.config._attn_implementation == "sdpa"
        assert not [m for m in part.modules() if type(m).__module__.startswith("splitinfer")]
        assert all(type(m) is torch.nn.Linear for m in part.modules() if isinstance(m, torch.nn.Linear))
    assert len(cloud.model.model.layers) == model.config.num_hidden_layers - 3


def test_it_stops_at_a_stop_token_as_splitinfer_does(tmp_path):
    model, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    expected = hf_greedy(model, PROMPT, 10)
    with plain_server(shards) as (url, _):
        got = plaincloud.PlainSplitClient(shards / "local", url, "float32").generate(PROMPT, 10, {expected[3]})
    assert got["token_ids"] == expected[: expected.index(expected[3]) + 1]


def test_the_same_messages_as_splitinfer_split_sequential(tmp_path):
    model, shards = prepare_tiny(tmp_path, "llama", 2, 1)
    with ServerThread(load_cloud(shards / "cloud")) as server, plain_server(shards) as (url, _):
        ours = open_client(shards / "local", server.url, allow_public_weights=True, checks=False)
        ours = ours.generate(PROMPT, max_new_tokens=12, stop_ids=set(), strategy="sequential")
        plain = plaincloud.PlainSplitClient(shards / "local", url, "float16").generate(PROMPT, 12, set())
    assert plain["token_ids"] == ours.token_ids  # float16 wire on both: a tiny peaked model keeps its tokens
    decode = [s for s in ours.steps if s["kind"] == "decode"]
    assert len(plain["steps"]) == len(decode) == 11
    assert [s["bytes_up"] for s in plain["steps"]] == [s["bytes_up"] for s in decode]
    # a result carries its server's timings as decimals, whose printed length varies by a few bytes
    assert all(abs(a["bytes_down"] - b["bytes_down"]) <= 16 for a, b in zip(plain["steps"], decode))


def test_the_plain_server_refuses_what_it_does_not_run(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    cloud = plaincloud.PlainCloud(*plaincloud.load_cloud_part(shards / "cloud"))
    d = cloud.model.config.hidden_size
    limits = Limits(hidden_size=d)

    def answer(message, session):
        reply, session = cloud.answer(message.encode(), session)
        return decode_server_message(reply, limits), session

    error, _ = answer(Step(0, (), (0,), BlockStructure.chain(), torch.zeros(1, d), "float32"), None)
    assert isinstance(error, Error) and "hello" in error.message
    error, _ = answer(Hello("another-shard", cloud.layers, "float32"), None)
    assert isinstance(error, Error) and "another shard" in error.message
    welcome, session = answer(Hello(cloud.manifest["cloud_fingerprint"], cloud.layers, "float32"), None)
    assert isinstance(welcome, Welcome) and session is not None
    tree = Step(0, (), (0, 1), BlockStructure.tree([-1, 0]), torch.zeros(2, d), "float32")
    error, _ = answer(tree, session)
    assert isinstance(error, Error) and "chains only" in error.message
    error, _ = answer(Step(0, (), (3,), BlockStructure.chain(), torch.zeros(1, d), "float32"), session)
    assert isinstance(error, Error) and "positions must continue" in error.message
    result, _ = answer(Step(0, (), (0, 1), BlockStructure.chain(), torch.zeros(2, d), "float32"), session)
    assert result.hidden.shape == (2, d) and result.committed == 0
    # keeping one row of the two drops the other from the cache
    result, _ = answer(Step(1, (0,), (1,), BlockStructure.chain(), torch.zeros(1, d), "float32"), session)
    assert result.committed == 1 and session.cache.get_seq_length() == 2


def _run(impl: str, rep: int, prompt: str, rate: float, tokens: list[int]) -> dict:
    steps = [{"kind": "decode", "round_trip_ms": 90.0, "cloud_compute_ms": 40.0, "local_ms": 10.0,
              "serialize_ms": 0.5, "bytes_up": 1300, "bytes_down": 1250}] * (len(tokens) - 1)
    stats = {"tokens_per_s": rate, "decode_s": (len(tokens) - 1) / rate, "prefill_messages": 1}
    return plainsplit.record(impl, 80.0, rep, {"id": prompt, "category": "c"}, tokens, stats, steps)


def test_the_summary_pairs_the_splits_prompt_by_prompt():
    runs = [_run("splitinfer", 0, "a", 8.0, [1, 2, 3]), _run("transformers", 0, "a", 10.0, [1, 2, 3]),
            _run("transformers", 0, "b", 5.0, [4, 5]), _run("splitinfer", 0, "b", 6.0, [4, 6])]
    references = [{"prompt_id": "a", "token_ids": [1, 2, 3]}, {"prompt_id": "b", "token_ids": [4, 5]}]
    ours, plain = plainsplit.summarize(runs, references, [80.0])
    assert (ours["impl"], plain["impl"]) == plainsplit.IMPLS
    assert ours["x_transformers_paired"] == 1.0  # the median of 0.8 and 1.2
    assert ours["identical_to_plain_split"] == 1 and ours["identical_to_greedy"] == 1
    assert plain["identical_to_greedy"] == 2 and "x_transformers_paired" not in plain
    assert plain["tokens_per_s"] == round(3 / (2 / 10 + 1 / 5), 3)  # whole set: tokens over decode time
    assert ours["round_trips"] == 2 + 3 and ours["bytes_per_step"] == 2550
    text = plainsplit.markdown({"command": "c", "setup": "s", "summary": [ours, plain]})
    assert "| 80.0 | splitinfer | " in text and "| 1/2 |" in text


@pytest.mark.slow
def test_the_command_runs_both_splits_behind_emulators(tmp_path):
    model = tiny_model("llama")
    shards = tmp_path / "shards"
    prepare(SourceModel("tiny-llama", model.config, model, char_tokenizer()), shards, 2, 1, "float32")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "splitinfer", "bench", "plain-split", "--shards", str(shards), "--out",
                    str(tmp_path / "out"), "--rtt-ms", "0,10", "--max-new-tokens", "6", "--per-category", "1",
                    "--wire-dtype", "float32"], check=True, env=env, timeout=600)
    report = json.loads((tmp_path / "out" / "plainsplit.json").read_text())
    prompts = len(report["prompts"])
    assert len(report["runs"]) == 2 * 2 * prompts
    for row in report["summary"]:
        assert row["generations"] == prompts and row["identical_to_greedy"] == prompts
        assert row["tokens_per_s"] > 0
    assert {r["rtt_ms"] for r in report["summary"]} == {0.0, 10.0}
    assert "plain-split" in report["command"] and (tmp_path / "out" / "plainsplit.md").exists()
