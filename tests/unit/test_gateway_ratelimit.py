"""The gateway's per-token rate limit (pure, injected clock)."""

from __future__ import annotations

import pytest

from sdfarm.gateway.ratelimit import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_burst_passes_then_the_next_request_waits_for_a_token():
    clock = Clock()
    rl = RateLimiter(per_minute=60, burst=3, clock=clock)
    assert [rl.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rl.take("a") == pytest.approx(1.0)
    clock.t += 1.0
    assert rl.take("a") == 0.0


def test_keys_are_limited_separately():
    clock = Clock()
    rl = RateLimiter(per_minute=6, burst=1, clock=clock)
    assert rl.take("token:a") == 0.0
    assert rl.take("token:a") == pytest.approx(10.0)
    assert rl.take("token:b") == 0.0


def test_idle_time_refills_only_up_to_the_burst():
    clock = Clock()
    rl = RateLimiter(per_minute=600, clock=clock)  # burst: 10 s worth = 100
    clock.t += 3600
    assert sum(rl.take("a") == 0.0 for _ in range(150)) == 100


def test_rate_must_be_positive():
    with pytest.raises(ValueError):
        RateLimiter(per_minute=0)
