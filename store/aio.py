"""`AsyncStore`: the reads an asyncio server makes of the farm's Redis, on `redis.asyncio`.

The gateway's event loop holds many long-lived readers at once (a server-sent event stream per
watched job, health checks): each awaits its reply instead of holding a thread. Only reads live
here, every key named by `keys.py` and every value decoded by `records.py`, as in `Store`; the
transitions (and their scripts) stay with `Store`.

One `AsyncStore` belongs to one event loop (redis.asyncio connections are bound to the loop that
opened them). Its connections come from a bounded pool: a burst of readers waits for a free
connection instead of opening one each.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from sdfarm.store import keys
from sdfarm.store.records import decode

MAX_CONNECTIONS = 64
"""Connections one AsyncStore opens at most; more concurrent reads wait for one."""
POOL_WAIT_S = 10.0
"""How long a read waits for a free connection before it fails (redis ConnectionError)."""


class AsyncStore:
    """Async reads of the farm's Redis (a redis.asyncio client with decode_responses off)."""

    def __init__(self, client: Any) -> None:
        self.r = client

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        max_connections: int = MAX_CONNECTIONS,
        pool_wait_s: float = POOL_WAIT_S,
        **options: Any,
    ) -> AsyncStore:
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_wait_s, **options
        )
        return cls(aioredis.Redis(connection_pool=pool))

    async def close(self) -> None:
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
