"""Metrics on a real local farm (redis-server, scheduler, one CPU worker with the tiny model,
the gateway in a thread): a batch of tiny jobs, one that fails and one cancelled while it
runs; then every process's `/metrics`, parsed by prometheus_client's own parser, shows the
counters by model and device and the histograms moved by exactly the jobs that ran."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sdfarm.client.farm import Farm
from sdfarm.localfarm.farm import LocalFarm
from sdfarm.store import JobSpec, keys

from helpers.gateway import served_gateway

MODEL = "tiny-q8_0"
HOST = "metricshost"
DEVICE = f"{HOST}/CPU"
TOKEN = "metrics-token"
BATCH = 4
SMALL = {"prompt": "a kite", "width": 64, "height": 64, "steps": 1}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def local_farm(models_dir: Path) -> Iterator[LocalFarm]:
    base = free_run(2)  # the scheduler's, then the worker's
    farm = LocalFarm(
        [models_dir],
        devices=["CPU"],
        threads=1,
        host=HOST,
        announce=False,
        worker_args=["--memory-limit", "4GiB"],
        env={**os.environ, "SDFARM_TEST_HOOKS": "1"},
        metrics_port=base,
    )
    with farm:
        yield farm


@pytest.fixture(scope="module")
def gateway(local_farm: LocalFarm) -> Iterator[str]:
    with served_gateway(local_farm.url, [TOKEN], 60.0) as url:
        yield url


def free_run(n: int) -> int:
    """The first of `n` consecutive free loopback ports."""
    for _ in range(50):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            try:
                for k in range(1, n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", base + k))
            except OSError:
                continue
            return base
    raise AssertionError(f"no {n} consecutive free ports")


EXPORTED: set[str] = set()
"""Every name the scrapes of this module saw: families, with every suffix a sample may have."""
DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana-dashboard.json"


def scrape(url: str, token: str | None = None) -> Samples:
    """Every sample of a /metrics page, parsed by prometheus_client's parser."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    resp = httpx.get(url, headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    out: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        EXPORTED.update(family.name + sfx for sfx in ("", "_total", "_bucket", "_count", "_sum"))
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def test_counters_and_histograms_move_by_the_jobs_that_ran(
    local_farm: LocalFarm, gateway: str
) -> None:
    ports = local_farm.metrics_ports()
    farm_url = f"{gateway}/metrics"
    before = scrape(farm_url, TOKEN)
    for name in ("sdfarm_job_queue_wait_seconds", "sdfarm_job_end_to_end_seconds"):
        assert f"{name}_count" not in names(before)  # no job yet: no series

    client = Farm(local_farm.url)
    try:
        jobs = [client.submit(MODEL, f"kite {i}", width=64, height=64, steps=1)
                for i in range(BATCH)]  # fmt: skip
        for job in jobs:
            assert job.wait(120) == "done"
        # The worker exports what its heartbeat says, which lags a load by up to an interval.
        worker_url = f"http://127.0.0.1:{ports['worker:CPU']}/metrics"
        worker = scrape(worker_url)
        settle = time.monotonic() + 3 * keys.HEARTBEAT_INTERVAL
        while not value(worker, "sdfarm_model_loaded_bytes", device=DEVICE, model=MODEL):
            assert time.monotonic() < settle, "no heartbeat listed the loaded engine"
            time.sleep(0.2)
            worker = scrape(worker_url)
        # A width the runtime cannot take: the worker refuses it before any native call.
        bad = client.submit_spec(JobSpec(model=MODEL, params={**SMALL, "width": 7}))
        assert bad.wait(60) == "failed"
        slow = client.submit_spec(JobSpec(model=MODEL, params=SMALL, test_hook="sleep:60"))
        deadline = time.monotonic() + 60
        while slow.state() != "running":
            assert time.monotonic() < deadline, slow.state()
            time.sleep(0.05)
        assert slow.cancel()
        assert slow.wait(60) == "cancelled"
    finally:
        client.close()

    after = scrape(farm_url, TOKEN)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    ran = BATCH + 2
    assert moved("sdfarm_jobs_submitted_total", model=MODEL) == ran
    assert moved("sdfarm_jobs_done_total", model=MODEL, device=DEVICE) == BATCH
    assert moved("sdfarm_jobs_failed_total", model=MODEL, device=DEVICE) == 1
    assert moved("sdfarm_jobs_cancelled_total", model=MODEL, device=DEVICE) == 1
    assert moved("sdfarm_jobs_requeued_total", model=MODEL, device=DEVICE) == 0
    on = {"model": MODEL, "device": DEVICE}
    assert moved("sdfarm_job_queue_wait_seconds_count", **on) == ran  # one claim each
    assert moved("sdfarm_job_end_to_end_seconds_count", **on) == ran  # every end
    assert moved("sdfarm_job_generate_seconds_count", **on) == BATCH  # only those that ran
    assert moved("sdfarm_job_load_seconds_count", **on) >= 1  # the first job loaded the model
    for hist in ("queue_wait", "load", "generate", "end_to_end"):
        name = f"sdfarm_job_{hist}_seconds"
        buckets = sorted(
            (float(dict(labels)["le"]), v)
            for (n, labels), v in after.items()
            if n == f"{name}_bucket" and dict(labels)["device"] == DEVICE
        )
        assert buckets[-1] == (float("inf"), value(after, f"{name}_count", **on)), hist
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:], strict=False)), hist
        assert value(after, f"{name}_sum", **on) > 0, hist
    # The farm's gauges, and the gateway's own requests.
    assert value(after, "sdfarm_devices_alive") == 1
    assert value(after, "sdfarm_jobs_running") == 0
    assert {f"{p}" for p in range(10)} <= {
        dict(labels)["priority"] for n, labels in after if n == "sdfarm_queue_depth"
    }
    assert value(after, "sdfarm_gateway_requests_total", route="/metrics", method="GET",
                 status="200") >= 1  # fmt: skip

    # The worker: its device, the engine it held after the batch, its pool process.
    assert value(worker, "sdfarm_device_up", device=DEVICE) == 1
    assert value(worker, "sdfarm_device_capacity_bytes", device=DEVICE) > 0
    assert value(worker, "sdfarm_model_loaded_bytes", device=DEVICE, model=MODEL) > 0
    assert value(worker, "sdfarm_worker_pool_resident_bytes", device=DEVICE) > 0
    assert "process_resident_memory_bytes" in names(worker)
    assert not any(n.startswith("sdfarm_jobs_") for n in names(worker))  # the gateway's

    # The scheduler: leader, its cycles, what it placed.
    sched = scrape(f"http://127.0.0.1:{ports['scheduler']}/metrics")
    assert value(sched, "sdfarm_scheduler_leader") == 1
    assert value(sched, "sdfarm_scheduler_cycle_seconds_count") > 0
    assert value(sched, "sdfarm_scheduler_events_total", event="placed") >= ran
    assert not any(n.startswith("sdfarm_jobs_") for n in names(sched))


def test_the_dashboard_charts_only_series_the_farm_exports(
    local_farm: LocalFarm, gateway: str
) -> None:
    """Every sdfarm_ name in deploy/grafana-dashboard.json is exported by some process."""
    scrape(f"{gateway}/metrics", TOKEN)
    for port in local_farm.metrics_ports().values():
        scrape(f"http://127.0.0.1:{port}/metrics")
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
             for t in p.get("targets", [])]  # fmt: skip
    used = {n for e in exprs for n in re.findall(r"\bsdfarm_[a-z0-9_]+", e)}
    assert len(used) > 20 and EXPORTED, (used, EXPORTED)
    assert used <= EXPORTED, sorted(used - EXPORTED)
