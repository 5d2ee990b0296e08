"""Per-caller rate limits that every gateway replica shares: the counts live in the farm's Redis,
kept by the `limits` package (its sliding-window counters, its Lua), under the key prefix the
store owns (`sdfarm.store.keys.RATE_PREFIX`), so two gateways in front of one farm enforce one
limit. The windows are timed by Redis (key TTLs), not by the replicas' clocks.

The policy (`windows`): `per_minute` requests in any minute, and at most `burst` of them
(default 10 seconds' worth) in any 10 seconds. The burst window is asked first: a request it
refuses is not counted in the minute, so a caller that keeps knocking while refused does not
push its minute further away.

Memory is bounded whatever callers send: each (caller, window) is two counters, each set to
expire two windows after it was made (a key that comes once leaves nothing behind).

When the counts cannot be reached (Redis away), a request is let through and a warning
logged: the request then meets the same Redis and answers 503 itself (refusing it here would
only change which error the caller sees, and the status page reports a Redis that is away).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref

from limits import RateLimitItem, RateLimitItemPerSecond
from limits.aio.storage import MemoryStorage, RedisStorage, Storage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from sdfarm.store import keys
from sdfarm.store.connect import async_pool, is_sentinel

log = logging.getLogger(__name__)

NAMESPACE = "gateway"
BURST_WINDOW_S = 10
MINUTE_S = 60
MEMORY = "memory://"
"""The storage that keeps the counts in this process only (tests, a single gateway)."""
REDIS_OPTIONS = {"socket_connect_timeout": 2.0, "socket_timeout": 2.0}
MAX_CONNECTIONS = 64
POOL_WAIT_S = 2.0


def windows(per_minute: float, burst: float | None = None) -> tuple[RateLimitItem, ...]:
    """The limits of a rate of `per_minute` requests a minute with bursts of `burst` (default
    10 s' worth, at least 1): (the burst window, the minute window). A rate below one a minute
    is one request per 60/per_minute seconds."""
    if per_minute <= 0:
        raise ValueError("per_minute must be positive")
    if burst is not None and burst < 1:
        raise ValueError("burst must be at least 1")
    burst_n = max(1, math.floor(burst if burst is not None else per_minute / 6))
    if per_minute >= 1:
        minute = RateLimitItemPerSecond(math.floor(per_minute), MINUTE_S, namespace=NAMESPACE)
    else:
        minute = RateLimitItemPerSecond(1, math.ceil(MINUTE_S / per_minute), namespace=NAMESPACE)
    return (RateLimitItemPerSecond(burst_n, BURST_WINDOW_S, namespace=NAMESPACE), minute)


class RateLimiter:
    """`take(key)`: 0 when the request may go, else the seconds until it may (Retry-After).
    `uri`: the farm's Redis URL (shared counts), or MEMORY (this process's event loop only)."""

    def __init__(
        self,
        per_minute: float,
        uri: str,
        *,
        burst: float | None = None,
        key_prefix: str = keys.RATE_PREFIX,
    ) -> None:
        self.per_minute = per_minute
        self.items = windows(per_minute, burst)
        self.uri = uri
        self.key_prefix = key_prefix
        self._limiters: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, SlidingWindowCounterRateLimiter
        ] = weakref.WeakKeyDictionary()
        self._warned = 0.0

    def _limiter(self) -> SlidingWindowCounterRateLimiter:
        """The strategy over this loop's storage: a redis.asyncio pool belongs to the loop that
        opened it (a server has one loop; a test client may start several)."""
        loop = asyncio.get_running_loop()
        got = self._limiters.get(loop)
        if got is None:
            got = self._limiters[loop] = SlidingWindowCounterRateLimiter(self._storage())
        return got

    def _storage(self) -> Storage:
        if self.uri == MEMORY:
            return MemoryStorage()
        pool = async_pool(self.uri, MAX_CONNECTIONS, POOL_WAIT_S, **REDIS_OPTIONS)
        return RedisStorage(
            "redis://" if is_sentinel(self.uri) else self.uri,  # the pool says where
            implementation="redispy",
            key_prefix=self.key_prefix,
            connection_pool=pool,
        )

    async def take(self, key: str) -> float:
        limiter = self._limiter()
        try:
            for item in self.items:
                if not await limiter.hit(item, key):
                    stats = await limiter.get_window_stats(item, key)
                    return max(0.001, stats.reset_time - time.time())
        except Exception as exc:  # noqa: BLE001 - the counts are away: let the request go
            self._warn(exc)
        return 0.0

    def _warn(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._warned > 60:  # once a minute at most, not once a request
            self._warned = now
            log.warning("rate limit counts unavailable, requests pass unlimited: %s", exc)

    async def close(self) -> None:
        """Close the running loop's connections (the others went with their loops)."""
        limiter = self._limiters.pop(asyncio.get_running_loop(), None)
        storage = getattr(limiter, "storage", None)
        client = getattr(getattr(storage, "bridge", None), "storage", None)
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()
                await client.connection_pool.disconnect()

    def __repr__(self) -> str:
        return f"RateLimiter({self.per_minute:g}/min, {self.uri.split('@')[-1]!r})"
