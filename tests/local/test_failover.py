"""Clients that know several servers: rendezvous order, and a session that outlives its server."""

from __future__ import annotations

import argparse
import collections

import pytest

from splitinfer.cloud.server import ServerThread
from splitinfer.configfile import Repeated, apply_config
from splitinfer.errors import ConfigError, TransportError
from splitinfer.launch import free_port
from splitinfer.local.client import SplitClient
from splitinfer.local.failover import FailoverMiddle, rendezvous_order, server_list
from splitinfer.local.session import ClientConfig
from splitinfer.model.shards import load_cloud, load_local

from cloud.test_server import F32, PROMPT, run_with_hook
from tiny import hf_greedy, prepare_tiny

SERVERS = [f"ws://10.0.0.{i}:8765" for i in range(5)]


def test_rendezvous_order_is_a_stable_permutation():
    for key in ("a", "b", "conversation-17"):
        order = rendezvous_order(key, SERVERS)
        assert sorted(order) == sorted(SERVERS)
        assert order == rendezvous_order(key, list(reversed(SERVERS)))  # the listing order does not matter


def test_rendezvous_spreads_keys_and_removing_a_server_moves_only_its_keys():
    keys = [f"session-{i}" for i in range(2000)]
    first = {k: rendezvous_order(k, SERVERS)[0] for k in keys}
    counts = collections.Counter(first.values())
    assert len(counts) == len(SERVERS) and min(counts.values()) > 2000 / len(SERVERS) * 0.7
    gone = SERVERS[2]
    rest = [s for s in SERVERS if s != gone]
    for k in keys:
        after = rendezvous_order(k, rest)
        # A session's next server is the one after its first in its own order: failover and rehashing agree.
        assert after == [s for s in rendezvous_order(k, SERVERS) if s != gone]
        if first[k] != gone:
            assert after[0] == first[k]


def test_server_list_needs_one_url_and_drops_repeats():
    assert server_list("ws://a:1") == ["ws://a:1"]
    assert server_list(["ws://a:1", "ws://b:1", "ws://a:1"]) == ["ws://a:1", "ws://b:1"]
    with pytest.raises(ConfigError, match="--server"):
        server_list([])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, shards = prepare_tiny(tmp_path_factory.mktemp("failover"), "llama", 2, 2)
    return shards, hf_greedy(model, PROMPT, 20)


def test_stopping_the_server_mid_generation_moves_the_session_with_identical_output(tiny, settle):
    shards, expected = tiny
    local, cloud = load_local(shards / "local"), load_cloud(shards / "cloud")
    with ServerThread(cloud) as a, ServerThread(cloud) as b:
        servers = {a.url: a, b.url: b}
        client = SplitClient.connect(shards / "local", [a.url, b.url], F32, allow_public_weights=True)
        middle = client.make_middle()
        assert isinstance(middle, FailoverMiddle)
        first = middle.url
        stopped = []

        def stop(i, session):
            if i == 7:  # the session's own server goes away mid-generation
                assert len(servers[first].server.table) == 1
                servers[first].close()
                stopped.append(first)

        tokens, session = run_with_hook(local, middle, 20, stop)
        other = next(s for url, s in servers.items() if url != first)
        assert settle(lambda: len(other.server.table) == 0)  # the moved session was closed at the end
    assert tokens == expected
    assert stopped == [first] and middle.url != first and middle.failovers == 1
    assert sum(r.recoveries for r in session.records) == 1


def test_a_server_down_from_the_start_is_passed_over(tiny):
    shards, expected = tiny
    dead = f"ws://127.0.0.1:{free_port()}"
    with ServerThread(load_cloud(shards / "cloud")) as live:
        client = SplitClient.connect(shards / "local", [dead, live.url], F32, allow_public_weights=True)
        for _ in range(4):  # whichever server each session ranks first, it ends on the live one
            assert client.generate(PROMPT, max_new_tokens=20, stop_ids=set()).token_ids == expected


def test_every_server_gone_raises_after_the_retries(tiny):
    shards, _ = tiny
    urls = [f"ws://127.0.0.1:{free_port()}" for _ in range(2)]
    config = ClientConfig(wire_dtype="float32", max_retries=1, retry_backoff_s=0.01)
    client = SplitClient.connect(shards / "local", urls, config, allow_public_weights=True)
    with pytest.raises(TransportError, match="cannot connect"):
        client.generate(PROMPT, max_new_tokens=2, stop_ids=set())


def _parser():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    generate = sub.add_parser("generate")
    generate.add_argument("--server", action=Repeated)
    return parser


def test_server_repeats_on_the_command_line_and_lists_in_the_file(tmp_path):
    parser = _parser()
    assert parser.parse_args(["generate", "--server", "ws://a:1", "--server", "ws://b:1"]).server == ["ws://a:1", "ws://b:1"]
    config = tmp_path / "splitinfer.toml"
    config.write_text('[generate]\nserver = ["ws://a:1", "ws://b:1"]\n')
    argv = ["--config", str(config), "generate"]
    apply_config(parser, argv, environ={})
    assert parser.parse_args(["generate"]).server == ["ws://a:1", "ws://b:1"]
    # The command line replaces the file's list instead of extending it.
    assert parser.parse_args(["generate", "--server", "ws://c:1"]).server == ["ws://c:1"]
    parser = _parser()
    apply_config(parser, ["generate"], environ={"SPLITINFER_GENERATE_SERVER": "ws://d:1,ws://e:1"})
    assert parser.parse_args(["generate"]).server == ["ws://d:1", "ws://e:1"]
