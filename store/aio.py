"""`AsyncStore`: the reads an asyncio server makes of the farm's Redis, on `redis.asyncio`.

The gateway's event loop holds many long-lived readers at once (a server-sent event stream per
watched job, health checks): each awaits its reply instead of holding a thread. Only reads live
here, every key named by `keys.py` and every value decoded by `records.py`, as in `Store`; the
transitions (and their scripts) stay with `Store`.

One `AsyncStore` belongs to one event loop (redis.asyncio connections are bound to the loop that
opened them). Its connections come from a bounded pool: a burst of readers waits for a free
connection instead of opening one each. Watchers wait without holding one: `listen(job_id)`
(sdfarm.store.notices) wakes them through a single pub/sub connection shared by all of them,
and each wake-up is one short read (`watch`, then `ended` once the job is final).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from sdfarm.store import keys
from sdfarm.store.connect import async_pool
from sdfarm.store.keys import LEADER_KEY
from sdfarm.store.notices import Notice, Notices
from sdfarm.store.records import JobResult, decode, loads

MAX_CONNECTIONS = 64
"""Connections one AsyncStore opens at most; more concurrent reads wait for one."""
POOL_WAIT_S = 10.0
"""How long a read waits for a free connection before it fails (redis ConnectionError)."""
WAIT_SLICE_S = 30.0
"""Longest a watcher waits for a notice before it reads the job again anyway: the bound on a
notice lost to a dropped pub/sub connection (at-most-once delivery; the connection's loss
itself wakes everyone at once)."""
SLICE_JITTER = 0.5
"""Each slice is WAIT_SLICE_S times a random factor in [1 - SLICE_JITTER, 1]: 500 requests
that came in together must not all read Redis in the same instant a slice later (measured:
that burst put a 0.4 s stall on the event loop, /healthz p99 70 ms)."""


def wait_slice() -> float:
    """One watcher's next slice (WAIT_SLICE_S, jittered)."""
    return WAIT_SLICE_S * random.uniform(1 - SLICE_JITTER, 1)


class AsyncStore:
    """Async reads of the farm's Redis (a redis.asyncio client with decode_responses off)."""

    def __init__(self, client: Any) -> None:
        self.r = client
        self._notices: Notices | None = None

    @property
    def notices(self) -> Notices:
        """The shared pub/sub connection, opened on the first `listen`."""
        if self._notices is None:
            self._notices = Notices(self.r)
        return self._notices

    @contextlib.asynccontextmanager
    async def listen(self, job_id: str) -> AsyncIterator[Notice]:
        """A Notice woken by each event of the job appended after this returns (the caller
        reads the job's state after entering, so nothing in between is missed)."""
        async with self.notices.listen(job_id) as notice:
            yield notice

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        max_connections: int = MAX_CONNECTIONS,
        pool_wait_s: float = POOL_WAIT_S,
        **options: Any,
    ) -> AsyncStore:
        pool = async_pool(url, max_connections, pool_wait_s, **options)
        return cls(aioredis.Redis(connection_pool=pool))

    async def close(self) -> None:
        if self._notices is not None:
            await self._notices.close()
        await self.r.aclose()
        await self.r.connection_pool.disconnect()

    async def ping(self) -> bool:
        return bool(await self.r.ping())

    async def state(self, job_id: str) -> str:
        """queued, placed, running, done, failed or cancelled; "" for no such job."""
        return decode(await self.r.hget(keys.job_key(job_id), "state"))

    async def access(self, job_id: str) -> tuple[str, str]:
        """(state, owner) of a job in one round trip: ("", "") for no such job."""
        state, owner = await self.r.hmget(keys.job_key(job_id), ["state", "owner"])
        return decode(state), decode(owner)

    async def newest_event(self, job_id: str) -> bytes | None:
        """The job's newest event as stored, None when it has no events list: one cheap
        command a watcher compares with the last event it has, to know whether to read the
        list."""
        return await self.r.lindex(keys.events_key(job_id), -1)

    async def raw_events(self, job_id: str) -> list[bytes]:
        """The job's events as stored (JSON), oldest first (at most EVENTS_CAP)."""
        return list(await self.r.lrange(keys.events_key(job_id), 0, -1))

    async def watch(self, job_id: str) -> tuple[str, float | None, float | None, float]:
        """(state, placed, deadline seconds, the Redis clock now) in one round trip, as
        `Store.watch`: what a waiter needs to know whether the job is past its deadline."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(keys.job_key(job_id), ["state", "placed", "deadline"])
        pipe.time()
        (state, placed, deadline), (sec, usec) = await pipe.execute()
        return decode(state), float_or_none(placed), float_or_none(deadline), sec + usec / 1e6

    async def ended(self, job_id: str) -> JobResult:
        """The record and the result of a job, read together (one round trip)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.job_key(job_id))
        pipe.hgetall(keys.result_key(job_id))
        raw_record, raw_result = await pipe.execute()
        return JobResult.parse(raw_record, raw_result)

    async def events(self, job_id: str) -> list[dict[str, Any]]:
        raw = await self.raw_events(job_id)
        return [e for e in (loads(x, None) for x in raw) if isinstance(e, dict)]

    async def lease_holder(self) -> str | None:
        value = await self.r.get(LEADER_KEY)
        return decode(value) if value is not None else None

    async def memory(self) -> dict[str, Any]:
        """INFO memory, for `sdfarm.store.store.refusing_writes_reason`."""
        return dict(await self.r.info("memory"))


def float_or_none(value: bytes | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None
