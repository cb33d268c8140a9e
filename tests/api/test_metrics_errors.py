"""The cloud side's Prometheus endpoint, and the one-line errors for the common start-up mistakes."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitinfer.cli import main
from splitinfer.cloud.server import ServerThread
from splitinfer.errors import ModelError, ShardMismatch, TransportError
from splitinfer.launch import free_port
from splitinfer.local.client import SplitClient
from splitinfer.local.session import ClientConfig
from splitinfer.metrics import CloudMetrics, serve_metrics
from splitinfer.model.shards import load_cloud
from splitinfer.preflight import check_local_memory, check_reachable

from tiny import prepare_tiny

F32 = ClientConfig(wire_dtype="float32", retry_backoff_s=0.05)


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        families = text_string_to_metric_families(resp.read().decode())
    return {s.name + "".join(f"|{v}" for v in s.labels.values()): s.value for f in families for s in f.samples}


def test_cloud_metrics_count_what_the_client_sent(chat_shards, tmp_path, settle):
    with ServerThread(load_cloud(chat_shards / "cloud")) as thread:
        thread.server.metrics = CloudMetrics(thread.server.table)
        port = free_port()
        http = serve_metrics(thread.server.metrics, "127.0.0.1", port)
        try:
            client = SplitClient.connect(chat_shards / "local", thread.url, F32, allow_public_weights=True)
            conversation = client.conversation()
            turn = conversation.send(client.local.tokenizer("hello there")["input_ids"], 20)
            held = scrape(port)
            conversation.close()
            gen = client.generate("abc", max_new_tokens=12, chat=False)
            _, other = prepare_tiny(tmp_path, "llama", 2, 2, seed=5)
            with pytest.raises(ShardMismatch):
                SplitClient.connect(other / "local", thread.url, F32, allow_public_weights=True).generate([1, 2, 3], max_new_tokens=2)
            assert settle(lambda: scrape(port)["splitinfer_active_sessions"] == 0)
            after = scrape(port)
        finally:
            http.shutdown()
    assert held["splitinfer_active_sessions"] == 1
    assert held["splitinfer_kv_cache_tokens"] >= turn.prompt_tokens and held["splitinfer_kv_cache_bytes"] > 0
    records = turn.stats["steps"] + turn.stats["prefill_messages"] + gen.stats["steps"] + gen.stats["prefill_messages"]
    assert after["splitinfer_steps_total|step"] == records
    assert after["splitinfer_fixed_overhead_seconds_count"] == records
    assert after["splitinfer_bytes_total|in"] == turn.stats["bytes_up"] + gen.stats["bytes_up"]
    assert after["splitinfer_bytes_total|out"] == turn.stats["bytes_down"] + gen.stats["bytes_down"]
    assert after["splitinfer_errors_total|shard_mismatch"] == 1
    assert after["splitinfer_active_sessions"] == 0 and after["splitinfer_kv_cache_tokens"] == 0
    assert after["splitinfer_kv_evictions_total"] == thread.server.table.stats()["evictions"]


def test_preflight_checks_say_what_to_do(chat_shards):
    with pytest.raises(TransportError, match="cannot connect to the cloud server .* start `splitinfer serve`"):
        check_reachable(f"ws://127.0.0.1:{free_port()}")
    with pytest.raises(ModelError, match="needs about .* GiB of memory but only .* available"):
        check_local_memory(chat_shards / "local", available=1024)
    check_local_memory(chat_shards / "local", available=1 << 40)


@pytest.fixture
def listener_url():
    """A URL with a listener (so the reachability check passes) that is not a splitinfer server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"ws://127.0.0.1:{sock.getsockname()[1]}"


def test_cli_start_up_mistakes_are_one_line(chat_shards, tmp_path, capsys, listener_url):
    dead = f"ws://127.0.0.1:{free_port()}"
    assert main(["chat", "--shard", str(chat_shards / "local"), "--server", dead]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot connect to the cloud server" in err
    assert main(["generate", "--shard", str(chat_shards / "local"), "--server", dead, "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot connect to the cloud server" in err
    assert main(["generate", "--shard", str(tmp_path / "missing"), "--server", listener_url, "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    _, other = prepare_tiny(tmp_path, "llama", 2, 2, seed=5)
    with ServerThread(load_cloud(other / "cloud")) as thread:
        argv = ["api", "--shard", str(chat_shards / "local"), "--server", thread.url, "--port", "0"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "refusing to connect" in err and "--allow-public-weights" in err
        assert main([*argv, "--allow-public-weights"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("warning: the local layers are the stock public weights")
    assert err[1].startswith("splitinfer: error:") and "prepared together" in err[1]
