"""Session-affine routing over several server replicas (rendezvous hashing).

A session's KV cache lives on one replica, so every step of a session must reach the replica that opened
it. `replica_for(key, replicas)` picks a replica from a stable key (an organisation, a user, a
conversation id) by highest random weight: each (key, replica) pair gets a hash score and the highest
wins. Every router that knows the same replica list picks the same replica with no shared state, and
removing a replica moves only the keys it held; the client of a moved key loses its session and
re-prefills on the new replica (the recovery path in local/session.py), with unchanged output.

A load balancer in front of the replicas can do the same with any consistent-hash policy on a header
(e.g. nginx `hash $http_x_session_key consistent`); this module is the reference and what tests use.
It knows nothing about sockets or sessions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def _score(key: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{replica}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def replica_for(key: str, replicas: Sequence[str]) -> str:
    """The replica (URL or name) that serves `key`; the same for every caller with the same list."""
    if not replicas:
        raise ValueError("no replicas to route to; give at least one server URL.")
    return max(replicas, key=lambda replica: (_score(key, replica), replica))
