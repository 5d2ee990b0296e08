"""The chain of jobs one Celery task runs after its own (sdfarm.worker.chain), with injected
probes, and the message parsing it relies on (sdfarm.store.transport.parse)."""

from __future__ import annotations

import base64
import json

import pytest

from sdfarm.store.transport import DISPATCH_MARK, JOB_MARK, TASK_NAME, parse, render
from sdfarm.worker.chain import Chain, chaining


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def queue_of(*jobs: tuple[str, str]):
    waiting = list(jobs)
    return lambda: waiting.pop(0) if waiting else None


def test_the_chain_takes_jobs_until_the_queue_is_empty() -> None:
    chain = Chain(queue_of(("a", "d1"), ("b", "d2")), stopping=lambda: False)
    assert [chain.next(), chain.next(), chain.next()] == [("a", "d1"), ("b", "d2"), None]
    assert chain.taken == 2


def test_the_chain_ends_at_its_job_count_and_its_time() -> None:
    jobs = [(f"j{i}", "d") for i in range(10)]
    by_count = Chain(queue_of(*jobs), stopping=lambda: False, max_jobs=3)
    assert [by_count.next() for _ in range(4)] == [*jobs[:3], None]
    clock = Clock()
    by_time = Chain(queue_of(*jobs), stopping=lambda: False, clock=clock, max_s=5.0)
    assert by_time.next() == jobs[0]
    clock.t += 5.0
    assert by_time.next() is None


def test_a_stopping_worker_takes_no_further_job() -> None:
    stop = {"now": False}
    chain = Chain(queue_of(("a", "d"), ("b", "d")), stopping=lambda: stop["now"])
    assert chain.next() == ("a", "d")
    stop["now"] = True
    assert chain.next() is None


def test_a_redis_error_ends_the_chain_and_celery_takes_over() -> None:
    def broken() -> tuple[str, str] | None:
        raise ConnectionError("redis restarting")

    assert Chain(broken, stopping=lambda: False).next() is None


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False), ("no", False)]
)
def test_sdfarm_chain_turns_it_off(value: str | None, on: bool) -> None:
    assert chaining({} if value is None else {"SDFARM_CHAIN": value}) is on


def template() -> dict:
    body = [[JOB_MARK, DISPATCH_MARK], {}, {"callbacks": None}]
    return {
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"task": TASK_NAME, "id": "t", "lang": "py"},
        "properties": {
            "correlation_id": "t",
            "body_encoding": "base64",
            "delivery_info": {"exchange": "", "routing_key": "q"},
            "delivery_tag": "x",
        },
    }


def test_a_rendered_message_parses_back_to_its_job() -> None:
    raw = render(template(), "job-1", "disp-1", "sdfarm.h.CPU")
    assert parse(raw) == ("job-1", "disp-1")
    assert parse(raw.encode()) == ("job-1", "disp-1")


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["headers"].update(task="other.task"),
        lambda d: d.update(body=base64.b64encode(b"[[1], {}]").decode()),
        lambda d: d["properties"].update(body_encoding="utf-8"),
        lambda d: d.update({"content-type": "application/x-python-serialize"}),
        lambda d: d.pop("body"),
    ],
)
def test_anything_else_is_not_taken_for_a_job(change) -> None:
    doc = json.loads(render(template(), "job-1", "disp-1", "q"))
    change(doc)
    assert parse(json.dumps(doc)) is None
    assert parse("not json") is None
