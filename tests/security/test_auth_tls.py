"""Transport security: bearer tokens checked before the upgrade, TLS and mutual TLS, session ownership,
and `serve` refusing an unauthenticated public address."""

from __future__ import annotations

import argparse

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from splitinfer.cli import main
from splitinfer.cloud.security import ANONYMOUS, TokenSet, load_server_tokens
from splitinfer.cloud.server import ServerConfig, ServerThread
from splitinfer.errors import AuthError, ConfigError, SplitInferError
from splitinfer.local.auth import ClientAuth, client_auth_from_args
from splitinfer.model.shards import load_cloud, load_local

from security.sec_helpers import TOKEN_A, TOKEN_B, decode_with_hook, remote


def test_token_set_accepts_each_configured_token_only():
    tokens = TokenSet.from_tokens([TOKEN_A, TOKEN_B])
    a, b = tokens.identify(f"Bearer {TOKEN_A}"), tokens.identify(f"Bearer {TOKEN_B}")
    assert a and b and a != b and TOKEN_A not in a
    for bad in (None, "", TOKEN_A, f"Bearer {TOKEN_A}x", f"Bearer {TOKEN_A[:-1]}", f"Basic {TOKEN_A}", "Bearer "):
        assert tokens.identify(bad) is None, bad
    assert TOKEN_A not in repr(tokens)
    assert TokenSet().identify(None) == ANONYMOUS  # no tokens configured: everyone is the same anonymous client
    with pytest.raises(ConfigError, match="token_urlsafe"):
        TokenSet.from_tokens(["short"])


def test_tokens_come_from_a_file_or_the_environment(token_file, monkeypatch):
    assert len(load_server_tokens(str(token_file)).digests) == 2
    monkeypatch.setenv("SPLITINFER_SERVER_TOKENS", f"{TOKEN_A},{TOKEN_B}")
    assert load_server_tokens(None).identify(f"Bearer {TOKEN_B}")
    monkeypatch.setenv("SPLITINFER_TOKEN", TOKEN_B)
    args = argparse.Namespace(token_file=None, ca_file=None, client_cert=None, client_key=None)  # add_client_auth_args
    auth = client_auth_from_args(args)
    assert auth.headers() == {"Authorization": f"Bearer {TOKEN_B}"} and TOKEN_B not in repr(auth)


def test_missing_or_wrong_token_gets_401_before_any_session(tiny, token_file):
    shards, expected = tiny
    local = load_local(shards / "local")
    config = ServerConfig(port=0, tokens=load_server_tokens(str(token_file)))
    with ServerThread(load_cloud(shards / "cloud"), config) as server:
        with pytest.raises(InvalidStatus) as info:
            connect(server.url, compression=None)
        assert info.value.response.status_code == 401
        for auth in (ClientAuth(), ClientAuth(token="not-the-token-0123456789")):
            with pytest.raises(AuthError, match="refused the token; check --token-file"):
                remote(local, server.url, auth).open()
        assert len(server.server.table) == 0
        tokens, _ = decode_with_hook(local, remote(local, server.url, ClientAuth(token=TOKEN_B)))
        assert tokens == expected


def test_a_session_id_is_useless_to_another_identity(tiny, token_file):
    shards, _ = tiny
    local = load_local(shards / "local")
    config = ServerConfig(port=0, tokens=load_server_tokens(str(token_file)))
    with ServerThread(load_cloud(shards / "cloud"), config) as server:
        alice = remote(local, server.url, ClientAuth(token=TOKEN_A))
        sid = alice.open().session_id
        mallory = remote(local, server.url, ClientAuth(token=TOKEN_B))
        stolen = mallory.open(resume_id=sid)
        # Treated exactly like an unknown id: a fresh, empty session of mallory's own.
        assert not stolen.resumed and stolen.session_id != sid and stolen.committed == 0
        mallory.close()
        alice.close(end_session=False)
        back = remote(local, server.url, ClientAuth(token=TOKEN_A)).open(resume_id=sid)
        assert back.resumed and back.session_id == sid
        with pytest.raises(SplitInferError):
            server.server.table.get(sid, owner="someone else")


def test_tls_with_a_private_ca_gives_the_same_output(tiny, pki, token_file):
    shards, expected = tiny
    local = load_local(shards / "local")
    config = ServerConfig(
        port=0, tokens=load_server_tokens(str(token_file)), tls_cert=pki.server_cert, tls_key=pki.server_key
    )
    with ServerThread(load_cloud(shards / "cloud"), config) as server:
        assert server.url.startswith("wss://")
        for untrusted in (ClientAuth(token=TOKEN_A), ClientAuth(token=TOKEN_A, ca_file=pki.other_ca)):
            with pytest.raises(AuthError, match="not trusted.*--ca-file"):
                remote(local, server.url, untrusted).open()
        with pytest.raises(SplitInferError):  # plain ws:// to a TLS port fails, it does not downgrade
            remote(local, server.url.replace("wss://", "ws://"), ClientAuth(token=TOKEN_A), open_timeout_s=3).open()
        tokens, _ = decode_with_hook(local, remote(local, server.url, ClientAuth(token=TOKEN_A, ca_file=pki.ca)))
    assert tokens == expected


def test_mutual_tls_requires_a_client_certificate(tiny, pki):
    shards, _ = tiny
    local = load_local(shards / "local")
    config = ServerConfig(port=0, tls_cert=pki.server_cert, tls_key=pki.server_key, client_ca=pki.ca)
    with ServerThread(load_cloud(shards / "cloud"), config) as server:
        for _ in range(5):  # TLS 1.3 reports the missing certificate at varying points; each must be ours
            with pytest.raises(SplitInferError):
                remote(local, server.url, ClientAuth(ca_file=pki.ca), open_timeout_s=3).open()
        auth = ClientAuth(ca_file=pki.ca, client_cert=pki.client_cert, client_key=pki.client_key)
        middle = remote(local, server.url, auth)
        assert middle.open().committed == 0
        middle.close()


@pytest.mark.parametrize(
    "extra, env, match",
    [
        (["--host", "0.0.0.0"], {}, "without authentication"),
        (["--host", "192.0.2.1"], {"SPLITINFER_SERVER_TOKENS": TOKEN_A}, "without TLS"),
        (["--host", "0.0.0.0", "--tls-cert", "c.pem"], {}, "together"),
    ],
)
def test_serve_refuses_an_exposed_address_and_says_why(extra, env, match, monkeypatch, capsys):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["serve", "--shard", "/nonexistent", *extra]) == 2
    assert match in capsys.readouterr().err
