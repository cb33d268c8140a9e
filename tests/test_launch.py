"""launch.py's ports and child start-up: a port for a child is one no outgoing connection can take first, and a
child that exits before it listens says why in the error."""

from __future__ import annotations

import socket

import pytest

from splitinfer.errors import ConfigError
from splitinfer.launch import _ephemeral_range, cloud_server, free_port


def test_free_ports_lie_below_the_ephemeral_range_bind_and_never_repeat():
    low, high = _ephemeral_range()
    assert low < high
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports)  # bind(0) and outgoing connections only take low..high
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free to bind a moment later


def test_a_server_that_exits_before_listening_says_why(tmp_path):
    with pytest.raises(ConfigError) as info:
        with cloud_server(tmp_path / "no-such-shard", ready_timeout_s=60):
            pass
    message = str(info.value)
    assert "exited with code 2 before listening" in message
    assert "splitinfer: error:" in message and "no-such-shard" in message  # the child's own error, passed on
