"""The gateway over a real redis-server with no worker (jobs stay queued): each token sees only
its own jobs (another's answer 404 on every route), operator tokens see all, the owner is the
token's fingerprint; an open gateway stays open; and the server-sent event streams are async:
hundreds of open streams hold no thread and leave /healthz fast."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from sdfarm.gateway import create_app
from sdfarm.gateway.auth import fingerprint
from sdfarm.store import Store

from helpers.gateway import served_gateway

A, B, OP = "token-a", "token-b", "operator-token"
JOB = {"model": "tiny", "prompt": "a private prompt", "width": 64, "height": 64}
LOCAL = "http://localhost"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def gw(redis_url: str) -> Iterator[TestClient]:
    app = create_app(redis_url, tokens=[A, B], operator_tokens=[OP])
    try:
        with TestClient(app, base_url=LOCAL) as c:
            yield c
    finally:
        app.state.farm.close()


def _events(c: TestClient, job_id: str, token: str) -> list[str]:
    kinds = []
    with c.stream("GET", f"/v1/jobs/{job_id}/events", headers=bearer(token)) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("event: "):
                kinds.append(line[len("event: ") :])
    return kinds


def test_a_token_sees_only_its_own_jobs(gw: TestClient, redis_url: str) -> None:
    job_id = gw.post("/v1/jobs", json=JOB, headers=bearer(A)).json()["id"]
    store = Store.connect(redis_url)
    try:
        owner = store.record(job_id)["owner"]
    finally:
        store.close()
    assert owner == fingerprint(A) and A not in owner

    unknown = "0" * 32
    for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/events",
                 f"/v1/jobs/{job_id}/image.png?i=0"):  # fmt: skip
        other = gw.get(path, headers=bearer(B))
        none = gw.get(path.replace(job_id, unknown), headers=bearer(B))
        assert other.status_code == none.status_code == 404, path
        assert other.json()["error"]["code"] == none.json()["error"]["code"] == "job_not_found"
        assert "private" not in other.text
    assert gw.delete(f"/v1/jobs/{job_id}", headers=bearer(B)).status_code == 404
    assert gw.get(f"/v1/jobs/{job_id}", headers=bearer(A)).json()["state"] == "queued"

    doc = gw.get(f"/v1/jobs/{job_id}", headers=bearer(OP)).json()
    assert doc["params"]["prompt"] == "a private prompt"  # the operator sees every job
    assert gw.get(f"/v1/jobs/{job_id}", headers=bearer(A)).status_code == 200
    assert gw.get(f"/v1/jobs/{job_id}/image.png", headers=bearer(A)).status_code == 409
    cancelled = gw.delete(f"/v1/jobs/{job_id}", headers=bearer(A)).json()
    assert cancelled == {"id": job_id, "cancelled": True, "deleted": False, "state": "cancelled"}
    assert _events(gw, job_id, A) == ["queued", "cancelled"]
    assert _events(gw, job_id, OP) == ["queued", "cancelled"]


def test_status_needs_a_token_and_shows_only_the_callers_jobs(gw: TestClient) -> None:
    gw.post("/v1/jobs", json=JOB, headers=bearer(A))
    assert gw.get("/v1/status").status_code == 401
    assert gw.get("/").status_code == 401
    for token in (A, B, OP):
        doc = gw.get("/v1/status", headers=bearer(token)).json()
        assert doc["pending"] == 1 and doc["queues"]["5"] == 1  # the queues stay visible


def test_an_open_gateway_stays_open(redis_url: str) -> None:
    app = create_app(redis_url)
    try:
        with TestClient(app, base_url=LOCAL, client=("127.0.0.1", 5)) as c:
            job_id = c.post("/v1/jobs", json=JOB).json()["id"]
            assert c.get(f"/v1/jobs/{job_id}").json()["params"]["prompt"] == JOB["prompt"]
            assert c.get("/").status_code == 200 and c.get("/v1/status").status_code == 200
            assert c.delete(f"/v1/jobs/{job_id}").json()["cancelled"] is True
            assert _events(c, job_id, "") == ["queued", "cancelled"]
    finally:
        app.state.farm.close()


STREAMS = 200


def test_open_event_streams_hold_no_thread_and_leave_healthz_fast(redis_url: str) -> None:
    """Every stream on a queued job stays open; meanwhile /healthz answers fast and the
    process has no more threads than before (a stream per thread stalled /healthz for 12-30 s
    at about 40 streams)."""
    with served_gateway(redis_url, [A], 60.0, rate_per_minute=1e6) as url:
        with httpx.Client(base_url=url, headers=bearer(A)) as c:
            ids = [c.post("/v1/jobs", json=JOB).json()["id"] for _ in range(20)]
        threads_before = threading.active_count()
        latencies, threads_during = asyncio.run(_hold_streams(url, ids))
    p99 = statistics.quantiles(latencies, n=100)[98]
    assert threads_during <= threads_before + 5, (threads_before, threads_during)
    assert p99 < 0.5, f"/healthz p99 {p99 * 1000:.0f} ms with {STREAMS} open streams"


async def _hold_streams(url: str, ids: list[str]) -> tuple[list[float], int]:
    limits = httpx.Limits(max_connections=STREAMS + 10, max_keepalive_connections=STREAMS + 10)
    opened: list[Any] = []
    async with (
        httpx.AsyncClient(base_url=url, headers=bearer(A), limits=limits, timeout=30) as streams,
        httpx.AsyncClient(base_url=url) as probe,
    ):

        async def hold(k: int, ready: asyncio.Event) -> None:
            async with streams.stream("GET", f"/v1/jobs/{ids[k % len(ids)]}/events") as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("event: queued"):
                        opened.append(k)
                        if len(opened) == STREAMS:
                            ready.set()
                        await asyncio.sleep(3600)  # hold it open

        ready = asyncio.Event()
        tasks = [asyncio.create_task(hold(k, ready)) for k in range(STREAMS)]
        await asyncio.wait_for(ready.wait(), 120)
        threads = threading.active_count()
        latencies = []
        for _ in range(100):
            t = time.perf_counter()
            r = await probe.get("/healthz")
            latencies.append(time.perf_counter() - t)
            assert r.json() == {"ok": True}
            await asyncio.sleep(0.01)
        threads = max(threads, threading.active_count())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return latencies, threads
