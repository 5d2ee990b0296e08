"""Per-caller rate limits: a token bucket per bearer token (or per client address when the
gateway runs without tokens). Pure logic with an injected clock, so it is tested exactly."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class RateLimiter:
    """`per_minute` requests a minute per key on average, bursts of up to `burst`
    (default: 10 seconds' worth, at least 1). `take(key)` returns 0 when the request may go,
    else the seconds until it may (the Retry-After)."""

    def __init__(
        self,
        per_minute: float,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_minute <= 0:
            raise ValueError("per_minute must be positive")
        self.rate = per_minute / 60.0
        self.burst = max(1.0, burst if burst is not None else per_minute / 6.0)
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        now = self._clock()
        with self._lock:
            tokens, last = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate
