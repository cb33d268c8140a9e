"""Clients that know several servers: rendezvous order, and a session that outlives its server."""

from __future__ import annotations

import argparse
import collections

import pytest

from splitinfer.cloud.security import TokenSet
from splitinfer.cloud.server import ServerConfig, ServerThread
from splitinfer.configfile import Repeated, apply_config
from splitinfer.errors import ConfigError, TransportError
from splitinfer.launch import free_port
from splitinfer.clients import open_client
from splitinfer.local.auth import ClientAuth
from splitinfer.local.failover import FailoverMiddle, ReplicaSet, fetch_replicas, rendezvous_order, server_list
from splitinfer.local.session import ClientConfig
from splitinfer.model.shards import load_cloud, load_local

from cloud.test_server import F32, PROMPT, remote, run_with_hook
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
        client = open_client(shards / "local", [a.url, b.url], F32, allow_public_weights=True, checks=False)
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
        client = open_client(shards / "local", [dead, live.url], F32, allow_public_weights=True, checks=False)
        for _ in range(4):  # whichever server each session ranks first, it ends on the live one
            assert client.generate(PROMPT, max_new_tokens=20, stop_ids=set()).token_ids == expected


def test_every_server_gone_raises_after_the_retries(tiny):
    shards, _ = tiny
    urls = [f"ws://127.0.0.1:{free_port()}" for _ in range(2)]
    config = ClientConfig(wire_dtype="float32", max_retries=1, retry_backoff_s=0.01)
    client = open_client(shards / "local", urls, config, allow_public_weights=True, checks=False)
    with pytest.raises(TransportError, match="cannot connect"):
        client.generate(PROMPT, max_new_tokens=2, stop_ids=set())


def test_replicas_listing_needs_the_token_and_is_checked(tiny):
    shards, _ = tiny
    token = "t" * 32
    config = ServerConfig(port=0, tokens=TokenSet.from_tokens([token]))
    with ServerThread(load_cloud(shards / "cloud"), config) as server:
        auth = ClientAuth(token=token)
        assert fetch_replicas(server.url, auth) is None  # a plain server lists no replicas (404)
        server.server.replicas = lambda: ["ws://10.0.0.1:8765", "ws://10.0.0.2:8765"]
        assert fetch_replicas(server.url, auth) == ["ws://10.0.0.1:8765", "ws://10.0.0.2:8765"]
        assert fetch_replicas(server.url, ClientAuth(token="u" * 32)) is None  # 401
        server.server.replicas = lambda: ["ws://10.0.0.1:8765", "http://elsewhere/"]
        assert fetch_replicas(server.url, auth) is None  # not a list of server URLs: ignored
    assert fetch_replicas(f"ws://127.0.0.1:{free_port()}") is None  # nobody listening


def _key(rank_given, rank_all, given, every):
    """A session key whose rendezvous order over `given` and over `every` satisfy the two predicates."""
    return next(k for k in (f"key-{i}" for i in range(10_000))
                if rank_given(rendezvous_order(k, given)) and rank_all(rendezvous_order(k, every)))


def test_an_autoscaled_replica_takes_new_sessions_and_failovers_while_sessions_stay_put(tiny, settle):
    shards, expected = tiny
    local, cloud = load_local(shards / "local"), load_cloud(shards / "cloud")
    with ServerThread(cloud) as a, ServerThread(cloud) as b, ServerThread(cloud) as c:
        live = [a.url, b.url]  # what the deployment's replicas list; c joins it later (autoscaling)
        for server in (a, b, c):
            server.server.replicas = lambda: list(live)
        now = [0.0]
        replicas = ReplicaSet([a.url, b.url], fetch=fetch_replicas, refresh_s=30, clock=lambda: now[0])
        given, every = [a.url, b.url], [a.url, b.url, c.url]
        # Starts on a; once c is listed, the key ranks c first, then a.
        stays = _key(lambda o: o[0] == a.url, lambda o: o[:2] == [c.url, a.url], given, every)
        # Starts on a; among all three it ranks a, c, b: when a goes, c (listed since) is its next server.
        moves = _key(lambda o: o[0] == a.url, lambda o: o == [a.url, c.url, b.url], given, every)
        make = lambda url: remote(local, url)  # noqa: E731
        existing = FailoverMiddle(replicas, make, key=stays)
        mover = FailoverMiddle(replicas, make, key=moves)
        assert existing.url == mover.url == a.url
        live.append(c.url)
        now[0] += 31  # the set is re-read when a session starts after refresh_s
        assert FailoverMiddle(replicas, make, key=stays).url == c.url  # a new session with that key: on c
        tokens, _ = run_with_hook(local, existing, 20, lambda i, s: None)
        assert tokens == expected and existing.url == a.url and existing.failovers == 0

        def stop(i, session):
            if i == 7:
                a.close()

        tokens, _ = run_with_hook(local, mover, 20, stop)
        assert tokens == expected and mover.url == c.url and mover.failovers == 1
        assert settle(lambda: len(c.server.table) == 0 and len(b.server.table) == 0)


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
