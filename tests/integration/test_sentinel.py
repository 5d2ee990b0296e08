"""A farm on Redis Sentinel survives its master's death: a real master, replica and two
sentinels (tests/helpers/sentinel.py), a real local farm (scheduler + CPU worker, tiny model)
pointed at the `redis+sentinel://` URL, a batch in flight, the master killed with SIGKILL. The
sentinels promote the replica; every job must still finish, each exactly once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sdfarm.client.farm import Farm
from sdfarm.localfarm.redis_server import RedisServerError, find_binary
from sdfarm.store import keys

from helpers.sentinel import SentinelGroup

F16 = "tiny-f16"
SMALL = {"width": 64, "height": 64, "steps": 1}
JOBS = 12


LONG_MS = int((keys.HEARTBEAT_TTL + 2 * keys.HEARTBEAT_INTERVAL) * 1000)
"""A down-after longer than the heartbeat TTL: the failover outlasts every heartbeat."""


@pytest.fixture
def group(request: pytest.FixtureRequest, tmp_path: Path):
    try:
        find_binary()
    except RedisServerError as exc:  # the one place a sentinel cannot exist
        pytest.skip(f"no redis-server binary (it runs the sentinels too): {exc}")
    g = SentinelGroup.start(tmp_path, down_after_ms=getattr(request, "param", 1000))
    try:
        yield g
    finally:
        g.stop()


@pytest.mark.parametrize(
    "group", [1000, LONG_MS], ids=["short", "longer-than-heartbeat-ttl"], indirect=True
)
def test_jobs_in_flight_finish_once_across_a_failover(group: SentinelGroup, models_dir) -> None:
    from sdfarm.localfarm.farm import LocalFarm

    old_master = group.master.port
    local = LocalFarm(
        [models_dir],
        devices=["CPU"],
        redis_url=group.url,
        threads=1,
        host="sentinelhost",
        announce=False,
        worker_args=["--memory-limit", "4GiB"],
        env={**os.environ},
    )
    with local, Farm(group.url, submitter="sentinel-test", retry_s=60) as farm:
        jobs = [farm.submit(F16, f"failover {i}", seed=i, **SMALL) for i in range(JOBS)]
        jobs[1].result(60)  # the batch is running: kill the master under it
        in_flight = [job for job in jobs if job.state() != "done"]
        assert len(in_flight) >= JOBS // 2, "the batch ended before the failover"
        group.master.proc.kill()
        group.master.proc.wait()
        killed_at = time.monotonic()
        group.wait(lambda: group.master_port() == group.replica.port, "the promotion", 60)
        promoted_s = time.monotonic() - killed_at
        results = [job.result(90) for job in jobs]
        assert all(r.png.startswith(b"\x89PNG") for r in results)
        replaced = []
        for job in jobs:
            assert job.state() == "done"
            events = job.events()
            kinds = [e["event"] for e in events]
            # Re-placing a job that had not started is safe (its old message claims nothing)
            # and happens when the failover outlasts the worker's heartbeat TTL; running it
            # twice is what must not happen.
            assert kinds.count("running") == 1, (job.id, kinds)
            assert kinds.count("done") == 1 and kinds[-1] == "done", (job.id, kinds)
            retried = [e for e in events if e["event"] == "retried"]
            assert all(e.get("counted") is False for e in retried), retried
            assert kinds.count("placed") == 1 + len(retried), (job.id, kinds)
            replaced += [e.get("reason") for e in retried]
        info = farm.store.r.info("server")
        assert int(info["tcp_port"]) == group.replica.port != old_master
    print(f"{len(in_flight)} in flight; promoted in {promoted_s:.1f} s; re-placed: {replaced}")


def test_the_gateways_async_clients_follow_a_failover(group: SentinelGroup) -> None:
    """AsyncStore (reads and its pub/sub notices) and the shared rate limits on the sentinel
    URL: they work on the master, and again on the promoted replica after it is killed."""
    import asyncio

    from sdfarm.gateway.ratelimit import RateLimiter
    from sdfarm.store import JobSpec, Store
    from sdfarm.store.aio import AsyncStore

    spec = JobSpec(model="m", params={"prompt": "a cat", "width": 64, "height": 64})
    store = Store.connect(group.url)

    async def round_trip(aio: AsyncStore, limiter: RateLimiter, key: str) -> None:
        job_id = (await asyncio.to_thread(store.submit, spec, 1000))[0] or ""
        async with aio.listen(job_id) as notice:
            await asyncio.to_thread(store.cancel, job_id)  # appends and publishes an event
            assert await notice.wait(10)
        assert await limiter.take(key) == 0
        assert await limiter.take(key) > 0  # counted in Redis: the second is refused

    async def run() -> None:
        aio = AsyncStore.connect(group.url)
        limiter = RateLimiter(1, group.url, burst=1)
        try:
            assert await aio.ping()
            await round_trip(aio, limiter, "before")
            group.master.proc.kill()
            group.master.proc.wait()
            await asyncio.to_thread(
                group.wait, lambda: group.master_port() == group.replica.port, "promotion", 30
            )
            deadline = time.monotonic() + 30
            while True:  # the first calls after the kill may meet the dead connections
                try:
                    assert await aio.ping()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
            await round_trip(aio, limiter, "after")
            info = await aio.r.info("server")
            assert int(info["tcp_port"]) == group.replica.port
        finally:
            await limiter.close()
            await aio.close()

    try:
        asyncio.run(run())
    finally:
        store.close()
