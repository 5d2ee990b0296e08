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


def test_idle_buckets_are_forgotten():
    """A bucket idle until full is the same as none: it is dropped, so keys that come once
    (rotating addresses) leave nothing behind."""
    clock = Clock()
    rl = RateLimiter(per_minute=60, burst=2, clock=clock)  # full again 2 s after its last use
    for k in range(1000):
        rl.take(f"addr:{k}")
    assert len(rl) == 1000
    clock.t += 2.0
    rl.take("other")
    assert len(rl) == 1


def test_memory_is_capped_and_the_least_recently_used_key_gives_way():
    clock = Clock()
    rl = RateLimiter(per_minute=6, burst=1, clock=clock, max_keys=100)
    assert rl.take("busy") == 0.0
    for k in range(10_000):
        rl.take(f"addr:{k}")
        if k % 50 == 0:
            assert rl.take("busy") > 0  # still limited: touched often, never evicted
    assert len(rl) == 100


def test_an_idle_forgotten_bucket_gives_no_more_than_a_full_one():
    clock = Clock()
    rl = RateLimiter(per_minute=60, burst=3, clock=clock)
    assert [rl.take("a") for _ in range(4)][-1] > 0
    clock.t += 10
    rl.take("b")  # evicts "a", which is full by now
    assert [rl.take("a") == 0.0 for _ in range(4)] == [True, True, True, False]


def test_max_keys_must_be_positive():
    with pytest.raises(ValueError):
        RateLimiter(per_minute=60, max_keys=0)
