"""The Probe message (path measurement for `splitinfer probe`): golden bytes, validation, and a real server.

The server answers a probe without a session or any compute, bounded by its message limit, behind the
same handshake (bearer token) as everything else.
"""

from __future__ import annotations

import struct

import pytest

from splitinfer.cloud.security import TokenSet
from splitinfer.cloud.server import ServerConfig, ServerThread
from splitinfer.cloud.sessions import SessionConfig
from splitinfer.errors import AuthError, MessageTooLarge, ProtocolError
from splitinfer.local.auth import ClientAuth
from splitinfer.local.middle import RemoteMiddle
from splitinfer.model.shards import load_cloud
from splitinfer.wire.frame import encode_frame
from splitinfer.wire.messages import (
    MAX_PROBE_BYTES,
    Limits,
    Probe,
    ProbeReply,
    decode_client_message,
    decode_server_message,
)

from tiny import prepare_tiny

LIMITS = Limits(hidden_size=2)

# Probe header: 40 bytes = 0x28, then the payload as the body.
PROBE = Probe(seq=2, reply_bytes=5, payload=b"ab")
PROBE_BYTES = b'\x00\x00\x00\x28{"type":"probe","seq":2,"reply_bytes":5}ab'

# ProbeReply header: 43 bytes = 0x2b, then reply_bytes zero bytes.
REPLY = ProbeReply(seq=2, received=2, payload=b"\x00" * 5)
REPLY_BYTES = b'\x00\x00\x00\x2b{"type":"probe_reply","seq":2,"received":2}\x00\x00\x00\x00\x00'


@pytest.mark.parametrize("message, expected", [(PROBE, PROBE_BYTES), (REPLY, REPLY_BYTES)], ids=["probe", "reply"])
def test_encode_matches_golden_bytes(message, expected):
    assert message.encode() == expected
    (length,) = struct.unpack(">I", expected[:4])
    assert expected[4 + length :] == message.payload


def test_golden_bytes_decode():
    assert decode_client_message(PROBE_BYTES, LIMITS) == PROBE
    assert decode_server_message(REPLY_BYTES, LIMITS) == REPLY


def test_empty_probe_round_trips():
    probe = Probe(seq=0, reply_bytes=0)
    assert decode_client_message(probe.encode(), LIMITS) == probe


@pytest.mark.parametrize(
    "header, match",
    [
        ({"type": "probe", "seq": 1, "reply_bytes": -1}, "reply_bytes"),
        ({"type": "probe", "seq": 1, "reply_bytes": MAX_PROBE_BYTES + 1}, "reply_bytes"),
        ({"type": "probe", "seq": 1, "reply_bytes": 1.5}, "reply_bytes"),
        ({"type": "probe", "seq": 1}, "reply_bytes"),
        ({"type": "probe", "seq": "1", "reply_bytes": 0}, "seq"),
    ],
)
def test_bad_probe_fields_are_refused(header, match):
    with pytest.raises(ProtocolError, match=match):
        decode_client_message(encode_frame(header, b"x"), LIMITS)


def test_bad_reply_fields_are_refused():
    with pytest.raises(ProtocolError, match="received"):
        decode_server_message(encode_frame({"type": "probe_reply", "seq": 0, "received": -3}), LIMITS)


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    _, shards = prepare_tiny(tmp_path_factory.mktemp("probe"), "llama", 1, 1)
    return load_cloud(shards / "cloud")


def _middle(url: str, auth: ClientAuth = ClientAuth()) -> RemoteMiddle:
    # A probe needs no shard: the fingerprint and layers are never sent.
    return RemoteMiddle(url, "-", (0, 0), hidden_size=1, auth=auth)


def test_server_answers_probes_without_a_session(cloud):
    limit = 1 << 20
    with ServerThread(cloud, ServerConfig(port=0, sessions=SessionConfig(max_message_bytes=limit))) as server:
        middle = _middle(server.url)
        for up, down in [(0, 0), (1200, 1200), (300_000, 10), (10, 300_000)]:
            assert middle.probe(up, down) > 0
        assert middle.welcome is None and len(server.server.table) == 0
        for too_many in (limit, MAX_PROBE_BYTES):  # refused before the server allocates the reply
            with pytest.raises(MessageTooLarge, match="ask for fewer reply bytes"):
                middle.probe(10, too_many)
        assert middle.probe(10, 10) > 0  # the connection survives a refused probe
        middle.close(end_session=False)


def test_probe_goes_through_the_same_authentication(cloud):
    config = ServerConfig(port=0, tokens=TokenSet.from_tokens(["probe-token-0123456789abcdef"]))
    with ServerThread(cloud, config) as server:
        with pytest.raises(AuthError):
            _middle(server.url).probe(10, 10)
        middle = _middle(server.url, ClientAuth(token="probe-token-0123456789abcdef"))
        assert middle.probe(10, 10) > 0
        middle.close(end_session=False)
