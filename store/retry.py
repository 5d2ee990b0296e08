"""Riding out a Redis that is briefly away: a restart, a failover, a dropped connection, a
server still loading its data. Every caller that must not lose work (the worker's uploader,
the client's submit and wait) retries these with backoff; other errors (a refused write, a
script error) are not transient and go straight up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis

T = TypeVar("T")

TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
"""Errors that go away when Redis comes back (BusyLoadingError: it is reading its AOF)."""
BUDGET_S = 30.0
"""How long a caller waits for Redis to come back before the error goes up."""


def retry_transient(
    fn: Callable[[], T],
    budget_s: float = BUDGET_S,
    first_delay: float = 0.05,
    max_delay: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`fn()`, called again after each transient error with a doubling delay, for at most
    `budget_s` seconds; then the last error is raised."""
    deadline = clock() + budget_s
    delay = first_delay
    while True:
        try:
            return fn()
        except TRANSIENT:
            left = deadline - clock()
            if left <= 0:
                raise
            sleep(min(delay, left))
            delay = min(max_delay, delay * 2)


async def aretry_transient(
    fn: Callable[[], Awaitable[T]],
    budget_s: float = BUDGET_S,
    first_delay: float = 0.05,
    max_delay: float = 2.0,
) -> T:
    """`await fn()`, as `retry_transient` does for a blocking call: the event loop's waiters
    ride out a Redis that is briefly away without holding a thread while they back off."""
    deadline = time.monotonic() + budget_s
    delay = first_delay
    while True:
        try:
            return await fn()
        except TRANSIENT:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            await asyncio.sleep(min(delay, left))
            delay = min(max_delay, delay * 2)
