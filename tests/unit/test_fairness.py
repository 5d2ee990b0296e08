"""Dispatch order scenarios: priorities, fair share between submitters, FIFO, queue limit."""

from __future__ import annotations

import pickle

import pytest

from sdfarm.scheduler.fairness import (
    FarmBusyError,
    Pending,
    check_queue_limit,
    next_job,
    order,
)


def p(job_id: str, priority: int, submitter: str, at: float, seq: int | None = None) -> Pending:
    return Pending(job_id, priority, submitter, at, int(at) if seq is None else seq)


def batch(submitter: str, n: int, *, priority: int = 9, start: float = 0.0) -> list[Pending]:
    return [p(f"{submitter}{i}", priority, submitter, start + i) for i in range(n)]


# (pending, running_by_submitter, expected dispatch order of job ids)
ORDERS = [
    pytest.param([], {}, [], id="empty"),
    pytest.param(
        [p("batch", 9, "a", 1), p("interactive", 0, "a", 2)],
        {},
        ["interactive", "batch"],
        id="lower-priority-number-first-even-if-newer",
    ),
    pytest.param(
        [p("p5", 5, "a", 1), p("p9", 9, "b", 0), p("p0", 0, "c", 2)],
        {},
        ["p0", "p5", "p9"],
        id="priority-ordering-across-submitters",
    ),
    pytest.param(
        [*batch("a", 5), p("b0", 9, "b", 100)],
        {},
        ["a0", "b0", "a1", "a2", "a3", "a4"],
        id="big-batch-from-a-does-not-starve-b",
    ),
    pytest.param(
        [*batch("a", 3), p("b0", 9, "b", 100)],
        {"a": 2},
        ["b0", "a0", "a1", "a2"],
        id="submitter-with-fewer-running-goes-first",
    ),
    pytest.param(
        [*batch("a", 3), *batch("b", 3, start=0.5)],
        {},
        ["a0", "b0", "a1", "b1", "a2", "b2"],
        id="equal-share-ties-go-to-oldest-job",
    ),
    pytest.param(
        [p("a2", 5, "a", 30), p("a0", 5, "a", 10), p("a1", 5, "a", 20)],
        {},
        ["a0", "a1", "a2"],
        id="fifo-within-a-submitter",
    ),
    pytest.param(
        [p("second", 5, "a", 1.0, seq=8), p("first", 5, "a", 1.0, seq=7)],
        {},
        ["first", "second"],
        id="same-clock-tick-seq-decides",
    ),
    pytest.param(
        [p("a-p5", 5, "a", 0), p("b-p5", 5, "b", 1), p("a-p0", 0, "a", 2)],
        {},
        ["a-p0", "b-p5", "a-p5"],
        id="dispatched-interactive-job-uses-up-share-at-lower-priority",
    ),
    pytest.param(
        [p("a0", 5, "a", 0), p("b0", 5, "b", 1), p("c0", 5, "c", 2)],
        {"a": 1, "b": 1},
        ["c0", "a0", "b0"],
        id="unknown-submitter-counts-zero-running",
    ),
]


@pytest.mark.parametrize(("pending", "running", "expected"), ORDERS)
def test_order(pending: list[Pending], running: dict[str, int], expected: list[str]) -> None:
    assert [j.job_id for j in order(pending, running)] == expected


@pytest.mark.parametrize(("pending", "running", "expected"), ORDERS)
def test_next_job_is_head_of_order(
    pending: list[Pending], running: dict[str, int], expected: list[str]
) -> None:
    chosen = next_job(pending, running)
    if not expected:
        assert chosen is None
    else:
        assert chosen is not None
        assert chosen.job_id == expected[0]


def test_order_does_not_mutate_running_counts() -> None:
    running = {"a": 1}
    order(batch("a", 3), running)
    assert running == {"a": 1}


def test_order_keeps_every_job_once() -> None:
    pending = [*batch("a", 50), *batch("b", 7, priority=0), *batch("c", 20, priority=5)]
    result = order(pending, {"b": 3})
    assert sorted(j.job_id for j in result) == sorted(j.job_id for j in pending)


@pytest.mark.parametrize("priority", [-1, 10])
def test_priority_outside_range_rejected(priority: int) -> None:
    with pytest.raises(ValueError, match="priority"):
        Pending("j", priority, "a", 0.0, 0)


QUEUE_LIMITS = [
    pytest.param(1000, 1000, "farm busy: 1000 jobs queued (limit 1000); retry later", id="at"),
    pytest.param(1200, 1000, "farm busy: 1200 jobs queued (limit 1000); retry later", id="over"),
    pytest.param(1, 1, "farm busy: 1 job queued (limit 1); retry later", id="singular"),
    pytest.param(999, 1000, None, id="below"),
    pytest.param(0, 1, None, id="empty"),
]


@pytest.mark.parametrize(("depth", "limit", "message"), QUEUE_LIMITS)
def test_queue_limit(depth: int, limit: int, message: str | None) -> None:
    if message is None:
        check_queue_limit(depth, limit)
        return
    with pytest.raises(FarmBusyError) as info:
        check_queue_limit(depth, limit)
    assert str(info.value) == message
    assert (info.value.depth, info.value.limit) == (depth, limit)


def test_queue_limit_below_one_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="queue limit"):
        check_queue_limit(0, 0)


def test_farm_busy_error_survives_pickling() -> None:
    error = pickle.loads(pickle.dumps(FarmBusyError(1000, 1000)))
    assert str(error) == "farm busy: 1000 jobs queued (limit 1000); retry later"
