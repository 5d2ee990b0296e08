"""Per-caller rate limits: a token bucket per key (an authenticated token's fingerprint, else
the client's address). Pure logic with an injected clock, so it is tested exactly.

Memory is bounded whatever callers send: a bucket left alone until it has refilled to the
full burst is the same as no bucket, so it is dropped (the idle ones are dropped oldest first,
as each request passes); and at most `max_keys` buckets are kept, the least recently used
giving way to a new key beyond that.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

MAX_KEYS = 10_000
"""Buckets kept at most (a few hundred bytes each)."""


class RateLimiter:
    """`per_minute` requests a minute per key on average, bursts of up to `burst`
    (default: 10 seconds' worth, at least 1). `take(key)` returns 0 when the request may go,
    else the seconds until it may (the Retry-After). At most `max_keys` keys are tracked."""

    def __init__(
        self,
        per_minute: float,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = MAX_KEYS,
    ) -> None:
        if per_minute <= 0:
            raise ValueError("per_minute must be positive")
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self.rate = per_minute / 60.0
        self.burst = max(1.0, burst if burst is not None else per_minute / 6.0)
        self.max_keys = max_keys
        self.refill_s = self.burst / self.rate
        """Seconds after which an untouched bucket is full again, i.e. forgettable."""
        self._clock = clock
        # key -> (tokens, last touched), least recently touched first
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._buckets)

    def take(self, key: str) -> float:
        now = self._clock()
        with self._lock:
            self._evict_idle(now)
            got = self._buckets.pop(key, None)
            tokens, last = got if got is not None else (self.burst, now)
            tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
            wait = 0.0
            if tokens >= 1.0:
                tokens -= 1.0
            else:
                wait = (1.0 - tokens) / self.rate
            self._buckets[key] = (tokens, now)  # now the most recently used
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return wait

    def _evict_idle(self, now: float) -> None:
        """Drop the buckets, oldest first, that have been idle long enough to be full."""
        while self._buckets:
            _, (_, last) = next(iter(self._buckets.items()))
            if now - last < self.refill_s:
                return
            self._buckets.popitem(last=False)
