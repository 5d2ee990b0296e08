"""`GET /metrics` of the gateway: the farm-wide series and the gateway's own, in
prometheus_client's exposition.

Who exports what (docs/architecture.md, "Metrics"): the farm-wide series (jobs counted by
model and device, the job histograms, queue depth, devices known and alive) come from the
gateway, the one process a farm's users already reach over HTTP. The scheduler exports its
own loop (`sdfarm.scheduler.metrics`), each worker its own device's figures and engines
(`sdfarm.worker.metrics`), so no series is exported by two kinds of process; several gateway
replicas export the same farm-wide values, told apart by Prometheus's `instance` label (the
dashboard takes `max` over them).

A scrape reads a bounded number of keys: the two metrics hashes (`sdfarm.store.metrics`,
counters kept as things happen), the pending lists' lengths and the snapshot of devices and
what runs on them: O(models x devices + running jobs), never O(jobs Redis holds).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import redis
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sdfarm.client.farm import Farm
from sdfarm.store.metrics import HISTOGRAMS, JOB_KINDS, FarmMetrics, read_farm_metrics

JOB_HELP = {
    "submitted": "Jobs queued (submit), by model.",
    "done": "Jobs that ended done, by model and the device that ran them.",
    "failed": "Jobs that ended failed (worker, refusal at placement, deadline, poison), by model "
    "and device ('' when never placed).",
    "cancelled": "Jobs that ended cancelled, by model and device ('' when cancelled queued).",
    "requeued": "Runs lost with their worker and put back in the queue, by model and device.",
}

REDIS_UP_HELP = "1 when the gateway read the farm's Redis for this scrape, else 0."

SECONDS_HELP = {name: f"Seconds {doc}." for name, doc in HISTOGRAMS.items()}


def job_families(m: FarmMetrics) -> Iterator[Metric]:
    """`sdfarm_jobs_{kind}_total` counters and `sdfarm_job_{name}_seconds` histograms."""
    for kind in JOB_KINDS:
        labels = ["model"] if kind == "submitted" else ["model", "device"]
        fam = CounterMetricFamily(f"sdfarm_jobs_{kind}", JOB_HELP[kind], labels=labels)
        for (k, model, device), n in sorted(m.jobs.items()):
            if k == kind:
                fam.add_metric([model] if kind == "submitted" else [model, device], n)
        yield fam
    for name in HISTOGRAMS:
        hist = HistogramMetricFamily(
            f"sdfarm_job_{name}_seconds", SECONDS_HELP[name], labels=["model", "device"]
        )
        for (n, model, device), h in sorted(m.seconds.items()):
            if n == name:
                hist.add_metric([model, device], h.buckets, h.total)
        yield hist


class FarmCollector(Collector):
    """The farm-wide series, read from Redis on each scrape (bounded, see the module)."""

    def __init__(self, farm: Farm) -> None:
        self.farm = farm

    def collect(self) -> Iterator[Metric]:
        store = self.farm.store
        try:  # everything read before anything is yielded: a scrape is all or nothing
            counted = read_farm_metrics(store.r)
            queues = store.queues()
            snap = store.snapshot()
        except redis.RedisError:
            # Redis away: the gateway's own series still answer, and say so.
            yield GaugeMetricFamily("sdfarm_redis_up", REDIS_UP_HELP, value=0)
            return
        yield GaugeMetricFamily("sdfarm_redis_up", REDIS_UP_HELP, value=1)
        yield from job_families(counted)
        depth = GaugeMetricFamily(
            "sdfarm_queue_depth", "Jobs waiting for placement, by priority.", labels=["priority"]
        )
        for p, n in queues["queues"].items():
            depth.add_metric([str(p)], n)
        yield depth
        yield GaugeMetricFamily(
            "sdfarm_queue_pending",
            "Jobs waiting for placement (the queue limit counts these).",
            value=queues["pending"],
        )
        yield GaugeMetricFamily(
            "sdfarm_devices", "Devices known to the farm.", value=len(snap.known)
        )
        yield GaugeMetricFamily(
            "sdfarm_devices_alive", "Devices with a live heartbeat.", value=len(snap.heartbeats)
        )
        yield GaugeMetricFamily(
            "sdfarm_jobs_running",
            "Jobs placed on a device or running there.",
            value=sum(len(r) for r in snap.running.values()),
        )


class HttpMetrics:
    """The gateway's own requests: a pure ASGI middleware (server-sent event streams pass
    through untouched) counting responses by route template, method and status, and timing
    them to the end of the body."""

    def __init__(self, app: Any, registry: CollectorRegistry) -> None:
        self.app = app
        self.requests = Counter(
            "sdfarm_gateway_requests",
            "HTTP requests the gateway answered, by route template, method and status.",
            ["route", "method", "status"],
            registry=registry,
        )
        self.seconds = Histogram(
            "sdfarm_gateway_request_seconds",
            "Seconds from a request to the end of its response, by route template.",
            ["route", "method"],
            registry=registry,
        )

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = ["500"]

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = str(message["status"])
            await send(message)

        t = time.perf_counter()
        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope.get("method", "")
            self.requests.labels(route, method, status[0]).inc()
            self.seconds.labels(route, method).observe(time.perf_counter() - t)


def gateway_registry(farm: Farm) -> CollectorRegistry:
    """A registry per app (tests run several apps in one process): the farm's series, this
    process's (`process_*`, `python_info`); HttpMetrics adds the requests."""
    registry = CollectorRegistry()
    registry.register(FarmCollector(farm))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
