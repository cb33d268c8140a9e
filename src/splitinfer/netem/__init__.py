"""User-space WAN emulation (delay, jitter, bandwidth) as a TCP proxy; see :mod:`splitinfer.netem.proxy`."""

from splitinfer.netem.proxy import ProxyThread, WanConfig, WanProxy, run_wan, start_proxy_thread

__all__ = ["ProxyThread", "WanConfig", "WanProxy", "run_wan", "start_proxy_thread"]
