"""`retry_transient`: transient Redis errors are waited out with backoff, for a budget; other
errors go straight up. A fake clock and sleep make it exact."""

from __future__ import annotations

import pytest
import redis

from sdfarm.store.retry import retry_transient


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


def flaky(failures: list[Exception], value: str = "ok"):
    def call() -> str:
        if failures:
            raise failures.pop(0)
        return value

    return call


def test_transient_errors_are_retried_with_doubling_delays() -> None:
    clock = Clock()
    errors = [redis.ConnectionError("down"), redis.TimeoutError("slow"),
              redis.BusyLoadingError("loading")]  # fmt: skip
    got = retry_transient(flaky(errors), sleep=clock.sleep, clock=clock.now)
    assert got == "ok" and clock.sleeps == [0.05, 0.1, 0.2]


def test_the_last_error_goes_up_when_the_budget_is_spent() -> None:
    clock = Clock()
    errors = [redis.ConnectionError(f"down {i}") for i in range(100)]
    with pytest.raises(redis.ConnectionError, match="down"):
        retry_transient(flaky(errors), budget_s=5.0, sleep=clock.sleep, clock=clock.now)
    assert sum(clock.sleeps) == pytest.approx(5.0) and max(clock.sleeps) <= 2.0


def test_a_refused_write_is_not_retried() -> None:
    clock = Clock()
    errors: list[Exception] = [redis.ResponseError("OOM command not allowed")]
    with pytest.raises(redis.ResponseError):
        retry_transient(flaky(errors), sleep=clock.sleep, clock=clock.now)
    assert clock.sleeps == []
