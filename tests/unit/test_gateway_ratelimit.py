"""The gateway's rate limit: the policy's windows (pure), and the limiter over the `limits`
package's in-process storage (the same strategy the shared Redis storage runs:
tests/integration/test_gateway_shared_limits.py), and letting requests through when its
counts cannot be reached."""

from __future__ import annotations

import asyncio
import time

import pytest

from sdfarm.gateway.ratelimit import BURST_WINDOW_S, MEMORY, RateLimiter, windows


def takes(rl: RateLimiter, keys: list[str]) -> list[float]:
    async def run() -> list[float]:
        return [await rl.take(k) for k in keys]

    return asyncio.run(run())


def test_windows_are_a_burst_and_a_minute():
    burst, minute = windows(600)
    assert (burst.amount, burst.get_expiry()) == (100, BURST_WINDOW_S)  # 10 s' worth
    assert (minute.amount, minute.get_expiry()) == (600, 60)
    burst, minute = windows(6)
    assert burst.amount == 1 and minute.amount == 6  # at least one in a burst
    burst, _ = windows(60, burst=3)
    assert burst.amount == 3
    _, slow = windows(0.5)  # below one a minute: one per 120 s
    assert (slow.amount, slow.get_expiry()) == (1, 120)


def test_rate_and_burst_must_be_positive():
    with pytest.raises(ValueError):
        windows(0)
    with pytest.raises(ValueError):
        windows(60, burst=0.5)


def test_a_burst_passes_then_the_next_request_waits():
    rl = RateLimiter(60, MEMORY, burst=3)
    got = takes(rl, ["a"] * 4)
    assert got[:3] == [0.0, 0.0, 0.0]
    assert 0 < got[3] <= BURST_WINDOW_S  # Retry-After: within the burst window


def test_keys_are_limited_separately():
    rl = RateLimiter(6, MEMORY)  # a burst of 1
    a1, a2, b1 = takes(rl, ["token:a", "token:a", "token:b"])
    assert a1 == 0.0 and a2 > 0 and b1 == 0.0


def test_unreachable_counts_let_requests_through_quickly():
    rl = RateLimiter(6, "redis://127.0.0.1:1/0")  # nothing listens on port 1
    start = time.monotonic()
    assert takes(rl, ["a"] * 3) == [0.0, 0.0, 0.0]
    assert time.monotonic() - start < 5
