"""The chain of jobs one Celery task runs after its own (sdfarm.worker.chain), with injected
probes, and the message parsing it relies on (sdfarm.store.transport.parse)."""

from __future__ import annotations

import base64
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from sdfarm.store.transport import DISPATCH_MARK, JOB_MARK, TASK_NAME, parse, render
from sdfarm.worker.chain import Chain, chaining, looking_ahead


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def queue_of(*jobs: tuple[str, str]):
    waiting = list(jobs)
    return lambda: waiting.pop(0) if waiting else None


def taken(link):
    """The message of a link (what `Chain.next()` gives), or None."""
    return None if link is None else link[0]


def test_the_chain_takes_jobs_until_the_queue_is_empty() -> None:
    chain = Chain(queue_of(("a", "d1"), ("b", "d2")), stopping=lambda: False)
    assert [chain.next(), chain.next(), chain.next()] == [
        (("a", "d1"), None),
        (("b", "d2"), None),
        None,
    ]
    assert chain.taken == 2


def test_the_chain_ends_at_its_job_count_and_its_time() -> None:
    jobs = [(f"j{i}", "d") for i in range(10)]
    by_count = Chain(queue_of(*jobs), stopping=lambda: False, max_jobs=3)
    assert [taken(by_count.next()) for _ in range(4)] == [*jobs[:3], None]
    clock = Clock()
    by_time = Chain(queue_of(*jobs), stopping=lambda: False, clock=clock, max_s=5.0)
    assert taken(by_time.next()) == jobs[0]
    clock.t += 5.0
    assert by_time.next() is None


def test_a_stopping_worker_takes_no_further_job() -> None:
    stop = {"now": False}
    chain = Chain(queue_of(("a", "d"), ("b", "d")), stopping=lambda: stop["now"])
    assert taken(chain.next()) == ("a", "d")
    stop["now"] = True
    assert chain.next() is None


def test_a_redis_error_ends_the_chain_and_celery_takes_over() -> None:
    def broken() -> tuple[str, str] | None:
        raise ConnectionError("redis restarting")

    assert Chain(broken, stopping=lambda: False).next() is None


# -- lookahead: the next job taken and prepared during the current one's native call ---------


def now(fn):
    """A run_ahead that runs at once (the lookahead thread, without the thread)."""
    done: Future = Future()
    done.set_result(fn())
    return done


class Recorder:
    def __init__(self) -> None:
        self.prepared: list = []
        self.given_back: list = []
        self.discarded: list = []
        self.order: list[str] = []
        self.forgotten = 0

    def give_back(self, message) -> None:
        self.order.append("message back")
        self.given_back.append(message)

    def discard(self, ready) -> None:
        self.order.append("job placed again")
        self.discarded.append(ready)

    def prepare(self, message):
        self.prepared.append(message)
        return f"ready {message[0]}"

    def chain(self, *jobs, stop=lambda: False, **kw) -> Chain:
        return Chain(
            queue_of(*jobs),
            stopping=stop,
            prepare=self.prepare,
            push_back=self.give_back,
            discard=self.discard,
            run_ahead=now,
            forget=self.forget,
            **kw,
        )

    def forget(self) -> None:
        self.forgotten += 1


def test_ahead_takes_and_prepares_the_next_job_which_next_then_gives() -> None:
    rec = Recorder()
    chain = rec.chain(("a", "d1"), ("b", "d2"))
    chain.ahead()
    assert rec.prepared == [("a", "d1")]
    chain.ahead()  # one job ahead at most
    assert rec.prepared == [("a", "d1")]
    assert chain.next() == (("a", "d1"), "ready a")
    assert chain.next() == (("b", "d2"), None)  # not looked ahead: taken when asked
    assert chain.next() is None
    assert rec.forgotten == 1 and chain.taken == 2


def test_the_lookahead_keeps_looking_until_a_message_comes_or_the_job_ends() -> None:
    """The scheduler sends the next job some time into the current one: the lookahead
    thread looks again until then, and stops looking once the current job ends."""
    waiting: list = []
    rec = Recorder()
    pool = ThreadPoolExecutor(1)
    chain = Chain(
        lambda: waiting.pop(0) if waiting else None,
        stopping=lambda: False,
        prepare=rec.prepare,
        run_ahead=pool.submit,
    )
    chain.ahead()
    time.sleep(0.02)
    waiting.append(("late", "d"))  # sent during the native call, after the first look
    deadline = time.monotonic() + 2.0
    while not rec.prepared and time.monotonic() < deadline:
        time.sleep(0.005)
    assert rec.prepared == [("late", "d")]  # taken and prepared before the job ended
    assert chain.next() == (("late", "d"), "ready late")
    chain.ahead()  # nothing comes this time: next() ends the looking at once
    t0 = time.monotonic()
    assert chain.next() is None
    assert time.monotonic() - t0 < 0.5
    pool.shutdown()


def test_a_worker_that_began_to_stop_gives_the_job_taken_ahead_back() -> None:
    stop = {"now": False}
    rec = Recorder()
    chain = rec.chain(("a", "d1"), ("b", "d2"), stop=lambda: stop["now"])
    chain.ahead()
    stop["now"] = True  # SIGTERM during the native call
    assert chain.next() is None
    assert rec.given_back == [("a", "d1")] and rec.discarded == ["ready a"]
    # its job (claimed ahead) is placed again before its message is back for another taker
    assert rec.order == ["job placed again", "message back"]
    assert chain.taken == 0


def test_no_lookahead_past_the_chains_end_nor_without_prepare() -> None:
    rec = Recorder()
    chain = rec.chain(("a", "d"), ("b", "d"), max_jobs=1)
    assert taken(chain.next()) == ("a", "d")
    chain.ahead()
    assert rec.prepared == [] and chain.next() is None
    plain = Chain(queue_of(("a", "d")), stopping=lambda: False, run_ahead=now)
    plain.ahead()
    assert plain.taken == 0  # nothing was taken ahead


def test_a_failed_preparation_still_gives_the_job_to_run_unprepared() -> None:
    def broken(message):
        raise RuntimeError("bug")

    chain = Chain(queue_of(("a", "d")), stopping=lambda: False, prepare=broken, run_ahead=now)
    chain.ahead()
    assert chain.next() == (("a", "d"), None)


def test_a_chain_that_took_nothing_forgets_nothing() -> None:
    rec = Recorder()
    chain = rec.chain()
    assert chain.next() is None and rec.forgotten == 0


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False), ("no", False)]
)
def test_sdfarm_chain_and_lookahead_turn_them_off(value: str | None, on: bool) -> None:
    assert chaining({} if value is None else {"SDFARM_CHAIN": value}) is on
    assert looking_ahead({} if value is None else {"SDFARM_LOOKAHEAD": value}) is on


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
