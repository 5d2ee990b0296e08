"""The scheduler's own series, served by `sdfarm scheduler --metrics-port` (off by default).

A scheduler is one long-lived process, so its series live in an ordinary prometheus_client
registry: whether it holds the lease, how long its placement cycles take, and every event it
logs (placed, requeued, poisoned, refused, standby, ...). The farm-wide series (jobs by model
and device, their histograms, queue depth) are counted in Redis by the transitions themselves
and exported by the gateway (`sdfarm.gateway.metrics`), not here: a standby and a leader
would export them twice, and a failover would move them between instances.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

PORT_ENV = "SDFARM_SCHEDULER_METRICS_PORT"
DEFAULT_PORT = 9101
"""The port deploy/ gives the scheduler (`--metrics-port 9101`); the flag's default is off."""

CYCLE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""One placement cycle: about a millisecond on a quiet farm, more with thousands pending."""


class SchedulerMetrics:
    """The registry and the three series the service updates."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.leader = Gauge(
            "sdfarm_scheduler_leader",
            "1 while this scheduler holds the leader lease and dispatches, else 0.",
            registry=self.registry,
        )
        self.cycle = Histogram(
            "sdfarm_scheduler_cycle_seconds",
            "Seconds one placement cycle took (read the farm, recover, place).",
            buckets=CYCLE_BUCKETS,
            registry=self.registry,
        )
        self.events = Counter(
            "sdfarm_scheduler_events",
            "Events this scheduler logged, by kind (placed, requeued, poisoned, refused, ...).",
            ["event"],
            registry=self.registry,
        )
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """prometheus_client's HTTP server on a daemon thread; returns the server."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return server


def default_port() -> int:
    """$SDFARM_SCHEDULER_METRICS_PORT, else 0 (off)."""
    return int(os.environ.get(PORT_ENV) or 0)
