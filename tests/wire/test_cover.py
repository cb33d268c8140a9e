"""Cover exchanges (wire/cover.py): a probe whose request and reply frames have exactly the sizes asked for,
and a server that holds its reply as asked and keeps the protocol's bound."""

from __future__ import annotations

import time

import pytest

from splitinfer.errors import ProtocolError
from splitinfer.wire.cover import cover_probe, expected_reply
from splitinfer.wire.messages import MAX_HOLD_MS, Limits, Probe, decode_client_message


@pytest.mark.parametrize("seq", [1, 9, 10, 99_999, 1 << 40])
@pytest.mark.parametrize("request_bytes,reply_bytes", [(200, 200), (1_000, 77_000), (84_224, 84_224), (99_999, 100_000)])
@pytest.mark.parametrize("hold_ms", [0, 0.4, 37.6, 9_999.9])
def test_a_cover_probe_has_exactly_the_sizes_asked_for(seq, request_bytes, reply_bytes, hold_ms):
    probe = cover_probe(seq, request_bytes, reply_bytes, hold_ms)
    assert len(probe.encode()) == request_bytes and len(expected_reply(probe)) == reply_bytes
    assert probe.hold_ms == min(round(hold_ms), MAX_HOLD_MS)
    assert decode_client_message(probe.encode(), Limits(hidden_size=8)) == probe


def test_sizes_too_small_for_a_probe_are_refused():
    with pytest.raises(ValueError, match="cannot be a probe"):
        cover_probe(1, 10, 10, 0)


def test_a_plain_probe_is_encoded_as_before_and_a_hold_beyond_the_bound_is_refused():
    assert b"hold_ms" not in Probe(1, 5, b"xy").encode()
    too_long = Probe(1, 5, b"", MAX_HOLD_MS + 1).encode()
    with pytest.raises(ProtocolError, match="hold_ms"):
        decode_client_message(too_long, Limits(hidden_size=8))


@pytest.mark.slow
@pytest.mark.timing  # the server's hold is a wall-clock delay: measuring it is the point
def test_the_server_holds_a_cover_reply_and_answers_it_with_the_sizes_asked(tmp_path):
    from splitinfer.cloud.server import ServerThread
    from splitinfer.local.middle import RemoteMiddle
    from splitinfer.model.shards import load_cloud

    from tiny import prepare_tiny

    _, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    cloud = load_cloud(shards / "cloud")
    with ServerThread(cloud) as server:
        middle = RemoteMiddle(server.url, cloud.fingerprint, (2, 4), 64)
        middle.tap = []
        for hold in (0, 150):
            t0 = time.perf_counter()
            middle.cover(5_000, 9_000, hold)
            assert (time.perf_counter() - t0) * 1e3 >= hold  # held at least as long as asked
        assert [n for _, _, n in middle.tap] == [5_000, 9_000, 5_000, 9_000]
        middle.close()
