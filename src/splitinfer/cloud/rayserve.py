"""`serve --ray`: the cloud half as a Ray Serve deployment, one whole CloudServer in every replica.

Each replica holds what a plain `serve` holds (the shard's layers, the session table, the scheduler, the
budgets, tokens and TLS) and speaks the same wire protocol on its own WebSocket port, in its own process:
hidden states go from the client straight to the replica that computes on them and never cross actors.
Ray Serve runs the replicas: it places them on the cluster's nodes, restarts one that dies, checks its
health, and scales their number by the policy below.

Routing is the client's (local/failover.py): a client is given every replica's URL and picks a session's
replica by rendezvous hashing on the session key, so a resume reaches the replica that holds the session,
and when that replica dies the session moves to the next one in its order and is re-prefilled there.
Serve's own HTTP proxy is not used (it is not started): it would carry every step's bytes through a
proxy actor, one more hop on the latency path, and its consistent-hash router on a session header is
experimental (`ray.serve.experimental`) at Ray 2.60.

Replicas added by autoscaling are published to clients: every replica reports its URL to one named
actor (`ReplicaDirectory`) when it starts and at every health check Serve runs on it, and answers
GET /replicas on its own port with the URLs reported within the last few health-check periods (a
killed replica drops out, a restarted one comes back). Clients re-read that listing when a session
starts (at most every 30 s) and whenever a session's replica fails (local/failover.py).

Ports: a replica takes the first free port from `base_port` on, so the replicas of one node listen on
base_port, base_port+1, ..., and a restarted replica takes the port its predecessor freed; the list of
URLs that clients are given stays valid across restarts. This module imports ray only inside functions
(ray is the optional `[ray]` extra); it knows nothing about clients.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from .server import ServerConfig, ServerThread

log = logging.getLogger("splitinfer.cloud")

APP_NAME = "splitinfer"
DEPLOYMENT_NAME = "CloudReplica"
DIRECTORY_NAME = "splitinfer-replicas"
NAMESPACE = "splitinfer"
HEALTH_CHECK_PERIOD_S = 5.0


class ReplicaDirectory:
    """The URLs of the replicas that are up, by heartbeat (a Ray actor body; see `deploy`)."""

    def __init__(self, ttl_s: float = 3 * HEALTH_CHECK_PERIOD_S, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.clock = clock  # seconds, monotonic; tests pass a fake one
        self._seen: dict[str, float] = {}  # url -> last report (clock seconds)

    def report(self, url: str) -> list[str]:
        """Record that `url` is up; returns every URL reported within the TTL."""
        self._seen[url] = self.clock()
        return self.urls()

    def urls(self) -> list[str]:
        horizon = self.clock() - self.ttl_s
        self._seen = {url: t for url, t in self._seen.items() if t >= horizon}
        return sorted(self._seen)


@dataclass(frozen=True)
class RayConfig:
    replicas: int = 2  # replicas to start with (and to keep, unless max_replicas is above it)
    max_replicas: int | None = None  # above `replicas`: autoscale between the two by the KV policy below
    address: str | None = None  # an existing Ray cluster (ray://... or auto); None starts a local one
    cpus_per_replica: float = 1.0  # Ray resources each replica reserves
    gpus_per_replica: float = 0.0
    port_span: int = 64  # ports tried from the base port on, for the replicas of one node
    kv_target: float = 0.7  # autoscaling keeps reserved KV bytes near this share of the replicas' budgets

    def __post_init__(self):
        if self.replicas < 1 or (self.max_replicas is not None and self.max_replicas < self.replicas):
            raise ValueError("replicas must be at least 1, and max replicas at least replicas.")
        if not 0 < self.kv_target <= 1:
            raise ValueError("the KV target must lie in (0, 1].")


class CloudReplica:
    """The body of one Serve replica: loads the shard and runs a CloudServer on a port of its own."""

    # The replica's server; None until one binds a port, so `__del__` of a replica whose __init__ failed has
    # nothing to close.
    _thread: ServerThread | None = None

    def __init__(self, shard: str, config: ServerConfig, device: str = "cpu", dtype: str | None = None,
                 threads: int | None = None, port_span: int = RayConfig.port_span, graphs: str = "auto"):
        import torch

        from ..model.shards import load_cloud
        from ..model.graphs import use_graphs

        if threads:
            torch.set_num_threads(threads)
        half = load_cloud(shard, device=device, dtype=dtype)
        use_graphs(half.stack, graphs)  # serve --graphs: CUDA graphs where the replica holds a CUDA device
        for port in range(config.port, config.port + port_span):
            try:
                self._thread = ServerThread(half, _with_port(config, port))
                break
            except OSError:  # taken by another replica of this node (or another program): the next one
                continue
        if self._thread is None:
            raise RuntimeError(f"no free port in {config.port}..{config.port + port_span - 1} for this replica.")
        self._refusals_seen = 0
        self._url = self.endpoint()
        self._peers = [self._url]
        self._report()
        self._thread.server.replicas = lambda: list(self._peers)

    def endpoint(self, wait_s: float = 0.0) -> str:
        """This replica's WebSocket URL, as clients reach it (the node's address when bound to all)."""
        time.sleep(wait_s)  # lets a caller spread concurrent calls over the replicas
        config = self._thread.server.config
        host = config.host
        if host in ("0.0.0.0", "::", ""):
            import ray

            host = ray.util.get_node_ip_address()
        return f"{config.scheme}://{host}:{self._thread.server.port}"

    def stats(self) -> dict:
        return {**self._thread.server.table.stats(), **self._thread.server.scheduler.stats()}

    def check_health(self) -> None:
        """Serve's health check: a replica whose server thread died is restarted. A live one reports itself
        to the directory and takes the deployment's current URLs for GET /replicas."""
        if not self._thread._thread.is_alive():
            raise RuntimeError("the replica's WebSocket server is not running.")
        self._report()

    def _report(self) -> None:
        import ray

        try:
            directory = ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
            self._peers = ray.get(directory.report.remote(self._url), timeout=HEALTH_CHECK_PERIOD_S)
        except (ValueError, ray.exceptions.RayError) as exc:  # no directory (yet), or it is busy: keep the list
            log.info("replica directory unavailable (%s); GET /replicas keeps its last list", exc)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The custom metrics `kv_autoscaling_policy` reads (Serve collects them from every replica)."""
        stats = self._thread.server.table.stats()
        refusals = stats["refusals"] - self._refusals_seen
        self._refusals_seen = stats["refusals"]
        budget = stats["kv_budget_bytes"] or stats["kv_budget_tokens"] * stats["kv_bytes_per_token"]
        return {"kv_reserved_share": stats["kv_reserved_bytes"] / budget, "refusals": float(refusals)}

    def __del__(self):
        if self._thread is not None:
            self._thread.close()


def _with_port(config: ServerConfig, port: int) -> ServerConfig:
    from dataclasses import replace

    return replace(config, port=port)


def desired_replicas(shares: list[float], refusals: float, current: int, target: float) -> int:
    """Replicas for the KV load: enough that the reserved KV share per replica is near `target`, one more
    when any replica refused a request for lack of room since the last look. Pure, for the policy below."""
    wanted = math.ceil(sum(shares) / target) if shares else current
    if refusals > 0:
        wanted = max(wanted, current + 1)
    return max(1, wanted)


def kv_autoscaling_policy(ctx) -> tuple[int, dict]:
    """Serve's custom autoscaling policy (`AutoscalingPolicy(policy_function=...)`): reads the replicas'
    `record_autoscaling_stats` (KV bytes reserved against the budget, capacity refusals)."""
    metrics = ctx.aggregated_metrics or {}
    shares = list(metrics.get("kv_reserved_share", {}).values())
    refusals = sum(metrics.get("refusals", {}).values())
    wanted = desired_replicas(shares, refusals, ctx.current_num_replicas, RayConfig.kv_target)
    bounded = min(max(wanted, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
    return bounded, ctx.policy_state


def deploy(shard: str, server: ServerConfig, ray_config: RayConfig = RayConfig(), device: str = "cpu",
           dtype: str | None = None, threads: int | None = None, timeout_s: float = 300.0,
           graphs: str = "auto") -> list[str]:
    """Start (or join) Ray, run the replicas, and return their WebSocket URLs once all of them serve."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=ray_config.address, include_dashboard=False, logging_level=logging.WARNING)
    serve.start(http_options={"location": "NoServer"})  # clients reach each replica's own port
    # Detached: a named actor whose creating handle is dropped would be collected; `shutdown` ends it.
    ray.remote(ReplicaDirectory).options(name=DIRECTORY_NAME, namespace=NAMESPACE, get_if_exists=True,
                                         lifetime="detached", num_cpus=0).remote()
    options: dict = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {"num_cpus": ray_config.cpus_per_replica, "num_gpus": ray_config.gpus_per_replica},
        "max_ongoing_requests": 64,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
    }
    if ray_config.max_replicas is not None and ray_config.max_replicas > ray_config.replicas:
        from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=ray_config.replicas, max_replicas=ray_config.max_replicas,
            policy=AutoscalingPolicy(policy_function=kv_autoscaling_policy),
        )
    else:
        options["num_replicas"] = ray_config.replicas
    app = serve.deployment(**options)(CloudReplica).bind(shard, server, device, dtype, threads, ray_config.port_span,
                                                                graphs)
    handle = serve.run(app, name=APP_NAME, route_prefix=None)
    return replica_urls(handle, ray_config.replicas, timeout_s)


def replica_urls(handle, replicas: int, timeout_s: float) -> list[str]:
    """Every replica's URL: Serve routes each call to some replica, so ask concurrently until all answered."""
    found: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(found) < replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(found)} of {replicas} replicas answered within {timeout_s:g} s.")
        calls = [handle.endpoint.remote(0.2) for _ in range(4 * replicas)]
        found.update(call.result() for call in calls)
    return sorted(found)


def replica_actors() -> list:
    """Handles of the running replicas' actors (to kill one in a test, or inspect it)."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == "serve" and DEPLOYMENT_NAME in a["name"] and "REPLICA" in a["name"]]
    return [ray.get_actor(name, namespace="serve") for name in names]


def shutdown() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    try:
        ray.kill(ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE))
    except ValueError:  # not started, or already gone
        pass
    ray.shutdown()
