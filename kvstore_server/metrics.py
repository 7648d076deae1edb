"""Prometheus metrics: the registry, RPC latency and outcomes, served over HTTP.

Metrics live in a registry of our own (no global state), served on
127.0.0.1:`--metrics-port`. What the store and each tier report they register in it
themselves (Store.register_metrics, Tier.register_metrics: store/metrics.py,
tier_metrics.py, disk/stats.py, far/metrics.py), as collectors read only when Prometheus
scrapes, so the request path pays nothing for them; this module knows no tier.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from .rpc_tally import RpcTally
from .tier_metrics import gauge

__all__ = ["Metrics"]


class _Gauge:
    """One unlabelled gauge, read from `value()` when scraped."""

    def __init__(self, name: str, doc: str, value: Callable[[], float]) -> None:
        self._name, self._doc, self._value = name, doc, value

    def collect(self):
        yield gauge(self._name, self._doc, None, self._value())


class Metrics:
    """The server's registry: per-RPC latency and outcome, and what others register."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # kvstore_rpc_duration_seconds and kvstore_rpc_total, counted per thread without
        # a lock and summed at scrape (rpc_tally.py says why).
        self._rpcs = RpcTally()
        self.registry.register(self._rpcs)
        self._server: Any = None        # the HTTP server, once serve() started it
        # One call's latency and outcome: the tally's own method, with no call between
        # (every fast-path call observes one).
        self.observe: Callable[[str, float, grpc.StatusCode], None] = self._rpcs.observe

    def refused(self, method: str, code: grpc.StatusCode) -> None:
        """A call refused before any handler ran (auth): counted, with no latency."""
        self._rpcs.refused(method, code)

    def gauge(self, name: str, doc: str, value: Callable[[], float]) -> None:
        """An unlabelled gauge read from value() when scraped."""
        self.registry.register(_Gauge(name, doc, value))

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Serve /metrics over HTTP (a daemon thread)."""
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
