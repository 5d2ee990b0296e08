"""A worker's own series, served by the worker's main process (`sdfarm worker --metrics-port`,
off by default).

The jobs run in a Celery pool process that is replaced after a cancel or a crash, so nothing
about jobs is counted in a process's memory: the transitions count them in Redis
(`sdfarm.store.metrics`) and the gateway exports those farm-wide. What this process exports is
its own device, exactly one exporter per device: the figures, the engines held and the
state, read on each scrape from the heartbeat the pool process writes (one GET), the pool
process's resident memory, and `process_*` of the main process itself. The HTTP server is a
daemon thread of the main process started before Celery forks the pool: the pool process
inherits the listening socket but never serves it (it has no such thread); an orphaned pool
process ends within a heartbeat (sdfarm.worker.heartbeat), releasing the port.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import psutil
from prometheus_client import (
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sdfarm.store import Store

PORT_ENV = "SDFARM_WORKER_METRICS_PORT"
DEFAULT_PORT = 9102
"""The port deploy/ gives a host's first worker (the next device's worker 9103, ...)."""

FIGURES = {
    "capacity": "What this worker's engines may hold together (the figure, capped by "
    "--memory-limit).",
    "compute_figure": "Capacity minus the estimates of the loaded engines.",
    "slow_figure": "A GPU: its remaining figure plus MemAvailable; the CPU: compute_figure.",
    "mem_available": "The host's MemAvailable at the last heartbeat.",
}
STATES = ("idle", "loading", "busy")


def device_families(device: str, hb: dict[str, Any] | None) -> Iterator[Metric]:
    """The series of one device from its heartbeat (None: no live heartbeat). Pure."""
    labels = ["device"]
    up = GaugeMetricFamily(
        "sdfarm_device_up",
        "1 while this device's heartbeat is live (the scheduler places jobs on it).",
        labels=labels,
    )
    up.add_metric([device], 1 if hb else 0)
    yield up
    if not hb:
        return
    for name, doc in FIGURES.items():
        fam = GaugeMetricFamily(f"sdfarm_device_{name}_bytes", doc, labels=labels)
        fam.add_metric([device], float(hb.get(name) or 0))
        yield fam
    state = GaugeMetricFamily(
        "sdfarm_device_state", "1 for the state the device is in.", labels=["device", "state"]
    )
    for s in STATES:
        state.add_metric([device, s], 1 if hb.get("state") == s else 0)
    yield state
    queue = GaugeMetricFamily(
        "sdfarm_device_queue_messages", "Messages waiting in its Celery queue.", labels=labels
    )
    queue.add_metric([device], float(hb.get("queue") or 0))
    yield queue
    loaded = GaugeMetricFamily(
        "sdfarm_model_loaded_bytes",
        "The estimates of the engines the device holds loaded, by model (with --engines N "
        "a model may be loaded in several slots: their sum).",
        labels=["device", "model"],
    )
    by_model: dict[str, float] = {}
    for engine in hb.get("loaded") or []:
        name = str(engine.get("name", ""))
        by_model[name] = by_model.get(name, 0.0) + float(engine.get("estimate") or 0)
    for name, held in by_model.items():
        loaded.add_metric([device, name], held)
    yield loaded
    models = GaugeMetricFamily(
        "sdfarm_device_models", "Models the device can load (its catalog).", labels=labels
    )
    models.add_metric([device], len(hb.get("models") or {}))
    yield models


class DeviceCollector(Collector):
    """This worker's device, read from Redis on each scrape (its heartbeat: one GET)."""

    def __init__(self, redis_url: str, device_key: str) -> None:
        self.url = redis_url
        self.device_key = device_key
        self._store: Store | None = None
        self._lock = threading.Lock()

    def store(self) -> Store:
        with self._lock:
            if self._store is None:
                self._store = Store.connect(self.url, socket_timeout=5, socket_connect_timeout=5)
            return self._store

    def collect(self) -> Iterator[Metric]:
        hb = self.store().heartbeat(self.device_key)
        yield from device_families(self.device_key, hb)
        rss = pool_resident(hb)
        if rss is not None:
            fam = GaugeMetricFamily(
                "sdfarm_worker_pool_resident_bytes",
                "Resident memory of the pool process that runs the jobs (engines included).",
                labels=["device"],
            )
            fam.add_metric([self.device_key], rss)
            yield fam


def pool_resident(hb: dict[str, Any] | None) -> float | None:
    """The resident bytes of the heartbeat's pool process when it is a child of this one."""
    pid = (hb or {}).get("pid")
    if not isinstance(pid, int):
        return None
    try:
        proc = psutil.Process(pid)
        if proc.ppid() != os.getpid():
            return None
        return float(proc.memory_info().rss)
    except psutil.Error:
        return None


def serve(redis_url: str, device_key: str, port: int, addr: str = "0.0.0.0") -> Any:
    """Start /metrics for this worker (main process); returns the server."""
    registry = CollectorRegistry()
    registry.register(DeviceCollector(redis_url, device_key))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return server


def default_port() -> int:
    """$SDFARM_WORKER_METRICS_PORT, else 0 (off)."""
    return int(os.environ.get(PORT_ENV) or 0)
