"""Load: 40 concurrent sessions against one loopback server with tight session and KV budgets.

Every session must finish with exactly the output of its prompt run alone; the server must never hold
more sessions or KV rows than its budgets; clients over capacity get the retry-later error and finish
after retrying. `splitinfer bench load` runs a larger version on the shipped model.
"""

from __future__ import annotations

import torch

from splitinfer.bench.loadtest import run_load, solo_outputs
from splitinfer.cloud.server import ServerConfig, ServerThread
from splitinfer.cloud.sessions import SessionConfig
from splitinfer.model.shards import load_cloud, load_local

from security.sec_helpers import F32


def test_forty_sessions_within_budgets(tiny, settle):
    shards, _ = tiny
    local, cloud = load_local(shards / "local"), load_cloud(shards / "cloud")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (int(n),), generator=gen).tolist() for n in (5, 9, 13, 17)]
    expected = solo_outputs(local, cloud, prompts, 16, F32)
    # 32 sessions may be open, and their KV rows may not exceed 32 * 24 (a full session needs up to 34).
    sessions = SessionConfig(max_sessions=32, max_cached_tokens=32 * 24)
    with ServerThread(cloud, ServerConfig(port=0, sessions=sessions)) as server:
        report = run_load(local, server, prompts, expected, 40, 16, F32, max_wait_s=240)
        assert settle(lambda: len(server.server.table) == 0)  # every session was closed
    print(report)
    assert not report.other_errors, report.other_errors[:3]
    assert report.completed == report.exact == 40
    assert report.peak_open_sessions <= 32 and report.peak_cached_tokens <= 32 * 24
    assert report.peak_open_sessions >= 16  # the sessions really overlapped
    assert report.capacity_refusals >= 1  # 40 clients for 32 places: some were told to retry later
    assert report.ok
