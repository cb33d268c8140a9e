"""Constants and helpers shared by the security tests (fixtures live in conftest.py)."""

from __future__ import annotations

from splitinfer.decoding.loop import decode
from splitinfer.decoding.strategies import Sequential
from splitinfer.local.auth import ClientAuth
from splitinfer.local.middle import RemoteMiddle
from splitinfer.local.session import ClientConfig, SplitSession

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71]
N_TOKENS = 20
F32 = ClientConfig(wire_dtype="float32", prefill_chunk=8, retry_backoff_s=0.05, retry_backoff_max_s=0.5)
TOKEN_A = "tok-A-0123456789abcdefghij"
TOKEN_B = "tok-B-0123456789abcdefghij"


def remote(local, url, auth=None, **kw) -> RemoteMiddle:
    split = local.manifest["split"]
    return RemoteMiddle(
        url, local.fingerprint, tuple(split["cloud_layers"]), local.config.hidden_size, "float32",
        auth=auth or ClientAuth(), **kw,
    )


def decode_with_hook(local, middle, hook=lambda i, s: None, n=N_TOKENS, config=F32):
    """Sequential greedy decoding of PROMPT with `hook(i, session)` after the i-th token; returns (tokens, session)."""
    session = SplitSession(local, middle, config)
    tokens: list[int] = []

    def emit(token, _logprob):
        tokens.append(token)
        hook(len(tokens), session)

    try:
        decode(session, PROMPT, session.prefill(PROMPT), n, set(), emit, Sequential())
    finally:
        session.close()
    return tokens, session
