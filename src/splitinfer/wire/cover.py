"""Cover exchanges: probes shaped like padded decode steps, so a reply's number of steps does not show (T6).

With steps and prompts padded (padding.py), what a network observer with TLS intact still reads is how many
decode exchanges a reply took, and that count follows how predictable the text was: code and copies take
few, prose many. A client that pads replies to a multiple of S exchanges (`ClientConfig.pad_steps`) sends
the missing ones as probes: no session, no compute on the server, the request exactly the size of a padded
step and the reply exactly the size of a padded result, the reply held as long as a pass takes. Inside
TLS a probe and a step of one size are the same bytes to the observer. Sans-I/O: this module only shapes
the message.
"""

from __future__ import annotations

from .messages import MAX_HOLD_MS, Probe, ProbeReply


def cover_probe(seq: int, request_bytes: int, reply_bytes: int, hold_ms: float) -> Probe:
    """A probe whose encoded frame is `request_bytes` long and whose reply's is `reply_bytes`, held
    `hold_ms` (rounded, clipped to the protocol's bound). ValueError when either size is too small to hold
    a probe's header (a padded step is thousands of bytes, so this means the sizes were not a step's)."""
    hold = min(max(round(hold_ms), 0), MAX_HOLD_MS)
    ask = reply_bytes  # the body asked for; its digits change the request's header, so settle both
    for _ in range(4):
        body = request_bytes - len(Probe(seq, ask, b"", hold).encode())
        settled = reply_bytes - len(ProbeReply(seq, max(body, 0)).encode())
        if settled == ask:
            break
        ask = settled
    if body < 0 or ask < 0:
        raise ValueError(f"a {request_bytes}-byte request with a {reply_bytes}-byte reply cannot be a probe.")
    probe = Probe(seq, ask, bytes(body), hold)
    assert len(probe.encode()) == request_bytes and len(expected_reply(probe)) == reply_bytes
    return probe


def expected_reply(probe: Probe) -> bytes:
    """The reply a server sends to `probe` (its size is what the observer sees)."""
    return ProbeReply(probe.seq, len(probe.payload), bytes(probe.reply_bytes)).encode()

