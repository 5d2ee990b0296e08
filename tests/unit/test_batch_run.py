"""`run_batch`'s control flow against a small fake farm (and a fake clock) passed in: a busy
farm is waited for, an item fails only for its own reason, a full disk or a farm that cannot
take jobs stops the batch cleanly, the options reach every job."""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from sdfarm.client.batch import BUSY_FIRST_S, BUSY_MAX_S, BatchStopped, run_batch
from sdfarm.client.batch_input import BatchItem, parse_items
from sdfarm.client.batch_output import write_file
from sdfarm.client.errors import (
    FarmBusyError,
    FarmError,
    FarmFullError,
    JobFailed,
    UnknownModelError,
)
from sdfarm.native.errors import InvalidParameterError

PNG = b"\x89PNG\r\n\x1a\n" + b"x" * 64


class Clock:
    """Fake monotonic time: `sleep` and the fake jobs' waits advance it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


@dataclass
class FakeResult:
    png: bytes
    metadata: dict[str, Any] = field(default_factory=dict)
    records: list[Any] = field(default_factory=list)


class FakeJob:
    def __init__(self, farm: FakeFarm, job_id: str, prompt: str, ends_at: float) -> None:
        self.farm = farm
        self.id = job_id
        self.prompt = prompt
        self.ends_at = ends_at
        self.cancelled = False
        self.gone = False  # the farm lost the record

    def _final(self) -> str:
        if self.gone:
            return ""
        if self.cancelled:
            return "cancelled"
        if self.farm.clock.now >= self.ends_at:
            return "failed" if self.prompt in self.farm.failing else "done"
        return "running"

    def state(self) -> str:
        self.farm.calls["state"] += 1
        if self.farm.state_errors:
            self.farm.state_errors -= 1
            raise redis.ConnectionError("Redis went away")
        return self._final()

    def wait(self, timeout: float | None = None) -> str:
        self.farm.calls["wait"] += 1
        if self.gone:
            raise FarmError(f"no job {self.id} (unknown, or expired)")
        state = self._final()
        if state != "running":
            return state
        assert timeout is not None and timeout > 0
        clock = self.farm.clock
        clock.now = min(self.ends_at, clock.now + timeout)
        state = self._final()
        if state == "running":
            raise TimeoutError(f"job {self.id} still running after {timeout} s")
        return state

    def result(self, timeout: float | None = None) -> FakeResult:
        state = self.wait(timeout)
        if state == "failed":
            raise JobFailed(self.id, "the engine said no")
        if state == "cancelled":
            raise AssertionError("a cancelled job is never collected here")
        return FakeResult(PNG + self.prompt.encode(), {"prompt": self.prompt, "job": self.id})

    def cancel(self) -> bool:
        self.farm.calls["cancel"] += 1
        if self.farm.cancel_errors:
            self.farm.cancel_errors -= 1
            raise redis.ConnectionError("Redis went away")
        ended = self._final() in ("done", "failed")
        self.cancelled = self.cancelled or not ended
        return not ended


class FakeFarm:
    """`submit(model, prompt, **fields)` like `Farm`'s: FarmBusyError for the first `busy`
    calls and whenever `limit` jobs are unfinished; each job takes `duration` fake seconds."""

    def __init__(
        self,
        clock: Clock,
        *,
        busy: int = 0,
        limit: int | None = None,
        duration: float = 1.0,
        failing: tuple[str, ...] = (),
        invalid: tuple[str, ...] = (),
        submit_error: BaseException | None = None,
    ) -> None:
        self.clock = clock
        self.busy = busy
        self.limit = limit
        self.duration = duration
        self.failing = failing
        self.invalid = invalid
        self.submit_error = submit_error
        self.state_errors = 0
        self.cancel_errors = 0
        self.jobs: list[FakeJob] = []
        self.submits: list[tuple[str, str, dict[str, Any]]] = []
        self.calls = {"state": 0, "wait": 0, "cancel": 0, "busy": 0}
        self.most_unfinished = 0

    def unfinished(self) -> int:
        return sum(1 for j in self.jobs if j._final() == "running")

    def submit(self, model: str, prompt: str, **fields: Any) -> FakeJob:
        self.submits.append((model, prompt, fields))
        if self.submit_error is not None:
            raise self.submit_error
        if model == "nope":
            raise UnknownModelError(model, ["tiny"])
        if prompt in self.invalid:
            raise InvalidParameterError("width", "must be a multiple of 8")
        if self.busy > 0 or (self.limit is not None and self.unfinished() >= self.limit):
            self.busy = max(0, self.busy - 1)
            self.calls["busy"] += 1
            raise FarmBusyError(self.unfinished(), self.limit or 0)
        job = FakeJob(self, f"job{len(self.jobs)}", prompt, self.clock.now + self.duration)
        self.jobs.append(job)
        self.most_unfinished = max(self.most_unfinished, self.unfinished())
        return job


def items(n: int) -> list[BatchItem]:
    return parse_items("".join(f"prompt {i}\n" for i in range(n)), "text")


def run(farm: FakeFarm, its: list[BatchItem], out: Path, **kwargs: Any):
    kwargs.setdefault("sleep", farm.clock.sleep)
    kwargs.setdefault("clock", farm.clock)
    return run_batch(farm, its, out, "tiny", **kwargs)


def tmp_files(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp"))


def test_a_busy_farm_is_waited_for_with_backoff_and_no_item_fails(tmp_path):
    clock = Clock()
    farm = FakeFarm(clock, busy=7)
    summary = run(farm, items(3), tmp_path / "out")
    assert (summary.done, summary.failed, summary.submitted) == (3, 0, 3), summary.failures
    assert summary.busy_waits == 7
    # Nothing of ours in flight: the batch sleeps 0.2 s doubling to 5 s, then asks again.
    assert clock.sleeps[:7] == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])
    assert BUSY_FIRST_S == 0.2 and BUSY_MAX_S == 5.0
    assert len(list((tmp_path / "out").glob("*.png"))) == 3


def test_a_queue_limit_below_the_window_collects_while_it_waits(tmp_path):
    clock = Clock()
    farm = FakeFarm(clock, limit=2, duration=1.0)
    summary = run(farm, items(12), tmp_path / "out", in_flight=8)
    assert (summary.done, summary.failed, summary.submitted) == (12, 0, 12), summary.failures
    assert summary.busy_waits > 0 and farm.most_unfinished <= 2
    # It waited on its own jobs (no bare sleeps while something was in flight) and did not
    # spin: a bounded number of looks at the farm per fake second.
    assert clock.sleeps == []
    assert farm.calls["state"] + farm.calls["wait"] + farm.calls["busy"] < 60 * max(clock.now, 1)
    assert clock.now < 12 * 1.0 / 2 + 12 * BUSY_MAX_S


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_in_flight_below_one_is_refused_before_anything(tmp_path, bad):
    farm = FakeFarm(Clock())
    with pytest.raises(ValueError, match="in_flight must be an integer of at least 1"):
        run(farm, items(2), tmp_path / "out", in_flight=bad)
    assert farm.submits == []


def test_in_flight_bounds_the_jobs_on_the_farm(tmp_path):
    farm = FakeFarm(Clock(), duration=2.0)
    summary = run(farm, items(9), tmp_path / "out", in_flight=3)
    assert summary.done == 9 and farm.most_unfinished <= 3


def test_every_option_reaches_every_job_and_a_batch_defaults_to_priority_9(tmp_path):
    farm = FakeFarm(Clock())
    run(farm, items(2), tmp_path / "a", common={"steps": 2})
    assert [f for _, _, f in farm.submits] == [{"steps": 2, "priority": 9}] * 2
    farm = FakeFarm(Clock())
    options = {"priority": 3, "submitter": "ann", "deadline_s": 60.0, "log_level": "info"}
    run(farm, items(2), tmp_path / "b", options=options)
    assert [f for _, _, f in farm.submits] == [options] * 2


@pytest.mark.parametrize(
    "options", [{"priority": 12}, {"deadline_s": 0.0}, {"colour": "red"}, {"steps": 2}]
)
def test_invalid_options_are_refused_before_any_job(tmp_path, options):
    farm = FakeFarm(Clock())
    with pytest.raises(InvalidParameterError):
        run(farm, items(2), tmp_path / "out", options=options)
    assert farm.submits == []


def test_an_item_fails_only_for_its_own_reason_with_the_error_text(tmp_path):
    farm = FakeFarm(Clock(), busy=2, invalid=("prompt 1",), failing=("prompt 2",))
    summary = run(farm, items(4), tmp_path / "out")
    assert summary.done == 2
    errors = {f["name"]: f["error"] for f in summary.failures}
    assert errors == {
        "00001-prompt-1": "InvalidParameterError: invalid width: must be a multiple of 8",
        "00002-prompt-2": "JobFailed: job job1 failed: the engine said no",
    }
    farm = FakeFarm(Clock())
    summary = run_batch(farm, items(2), tmp_path / "o2", "nope", sleep=farm.clock.sleep,
                        clock=farm.clock)  # fmt: skip
    assert summary.failed == 2 and "unknown model 'nope'" in summary.failures[0]["error"]


def test_transient_redis_errors_while_looking_at_jobs_are_ridden_out(tmp_path):
    farm = FakeFarm(Clock(), duration=1.0)
    farm.state_errors = 3  # job.state() raises ConnectionError three times, then answers
    summary = run(farm, items(3), tmp_path / "out")
    assert (summary.done, summary.failed) == (3, 0)
    assert farm.state_errors == 0


@pytest.mark.parametrize(
    "error",
    [FarmFullError("nothing can be queued: Redis is full"), redis.ResponseError("NOSCRIPT")],
)
def test_a_farm_that_cannot_take_jobs_stops_the_batch_instead_of_failing_items(tmp_path, error):
    farm = FakeFarm(Clock(), duration=5.0)
    out = tmp_path / "out"
    its = items(4)
    first = run(farm, its[:1], out)  # one image already there
    assert first.done == 1
    farm = FakeFarm(Clock(), submit_error=error)
    with pytest.raises(BatchStopped) as info:
        run(farm, its, out)
    stopped = info.value
    assert stopped.kind == "farm" and stopped.cause is error
    assert "the farm cannot take the batch" in str(stopped) and str(error) in str(stopped)
    assert stopped.summary.failed == 0 and stopped.summary.skipped == 1
    assert stopped.summary.remaining == 3 and stopped.summary.stopped
    assert len(farm.submits) == 1  # stopped at once, not once per item
    assert sorted(p.name for p in out.glob("*.png")) == ["00000-prompt-0.png"]


def test_a_full_disk_stops_the_batch_keeps_the_images_and_cancels_the_rest(tmp_path):
    out = tmp_path / "out"
    its = items(6)
    writes: list[str] = []

    def disk(path: Path, data: bytes) -> None:
        """The real write until the fifth file (the third item's PNG): half of it lands,
        then the disk is full."""
        writes.append(path.name)
        if len(writes) == 5:
            path.write_bytes(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write_file(path, data)

    farm = FakeFarm(Clock(), duration=1.0)
    with pytest.raises(BatchStopped) as info:
        run(farm, its, out, in_flight=4, write=disk)
    stopped = info.value
    assert stopped.kind == "output" and isinstance(stopped.cause, OSError)
    message = str(stopped)
    assert str(out) in message and "No space left on device" in message and "ENOSPC" in message
    assert "00002-prompt-2.png" in message
    assert tmp_files(out) == []  # no half file
    # The two images written stay, each with its sidecar; the third's sidecar went with it.
    assert sorted(p.name for p in out.iterdir()) == [
        "00000-prompt-0.json",
        "00000-prompt-0.png",
        "00001-prompt-1.json",
        "00001-prompt-1.png",
    ]
    assert (out / "00001-prompt-1.png").read_bytes() == PNG + b"prompt 1"
    assert json.loads((out / "00000-prompt-0.json").read_text())["job"] == "job0"
    assert stopped.summary.done == 2 and stopped.summary.failed == 0
    assert "No space left on device" in stopped.summary.stopped
    # It stopped at once: nothing submitted after the failure, what was in flight cancelled.
    # (job3 had ended uncollected; job4, queued after job0 was written, was still running.)
    assert len(farm.jobs) == 5 and farm.calls["cancel"] == 2
    assert [j.id for j in farm.jobs if j.cancelled] == ["job4"]

    # Space again: the re-run renders exactly what is missing, never a finished image.
    farm = FakeFarm(Clock())
    summary = run(farm, its, out)
    assert (summary.done, summary.skipped) == (4, 2)
    assert [p for _, p, _ in farm.submits] == [f"prompt {i}" for i in range(2, 6)]
    assert tmp_files(out) == []


def test_a_sidecar_that_cannot_be_written_also_stops_the_batch(tmp_path):
    out = tmp_path / "out"

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(BatchStopped, match="No space left on device"):
        run(FakeFarm(Clock()), items(2), out, write=full)
    assert list(out.iterdir()) == []


def test_a_job_the_farm_lost_is_submitted_again(tmp_path):
    clock = Clock()
    farm = FakeFarm(clock, duration=1.0)
    real_submit = farm.submit

    def submit(model: str, prompt: str, **fields: Any) -> FakeJob:
        job = real_submit(model, prompt, **fields)
        if len(farm.jobs) == 1:
            job.gone = True  # Redis restarted without the record
        return job

    farm.submit = submit  # type: ignore[method-assign]
    summary = run(farm, items(2), tmp_path / "out")
    assert (summary.done, summary.failed, summary.submitted) == (2, 0, 3)


def test_cancelling_on_a_stop_rides_out_a_transient_redis_error(tmp_path):
    farm = FakeFarm(Clock(), duration=10.0)
    farm.cancel_errors = 2

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(BatchStopped):
        run(farm, items(3), tmp_path / "out", in_flight=3, write=full)
    assert farm.cancel_errors == 0 and farm.calls["cancel"] == 4


def test_a_timeout_fails_the_item_and_cancels_its_job(tmp_path):
    farm = FakeFarm(Clock(), duration=1000.0)
    summary = run(farm, items(1), tmp_path / "out", timeout=5.0)
    assert summary.failed == 1 and "did not end within 5 s" in summary.failures[0]["error"]
    assert farm.jobs[0].cancelled
    assert farm.clock.now == pytest.approx(5.0)


def test_an_interrupt_cancels_what_is_in_flight(tmp_path):
    farm = FakeFarm(Clock(), duration=10.0)

    def interrupt(kind: str, item: BatchItem, n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(farm, items(5), tmp_path / "out", in_flight=3, on_progress=interrupt)
    assert len(farm.jobs) == 3 and farm.calls["cancel"] == 2  # the two not collected


# -- streamed input ------------------------------------------------------------------------------


def test_a_generator_is_read_one_item_ahead_of_the_window(tmp_path):
    clock = Clock()
    farm = FakeFarm(clock)
    drawn: list[int] = []

    def stream():
        for item in items(50):
            drawn.append(item.index)
            # never more than one item ahead (the written one, index 2, makes no job)
            assert len(drawn) <= len(farm.jobs) + (len(drawn) > 2) + 1
            yield item

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / f"{items(3)[2].name}.png").write_bytes(PNG)  # already written
    summary = run(farm, stream(), tmp_path / "out", in_flight=4)
    assert summary.total == 50 and summary.skipped == 1 and summary.done == 49
    assert farm.most_unfinished <= 4 and len(farm.jobs) == 49


def test_a_scanned_total_keeps_the_counts_whole_when_the_batch_stops(tmp_path):
    farm = FakeFarm(Clock(), submit_error=redis.ConnectionError("Redis went away"))
    with pytest.raises(BatchStopped) as info:
        run(farm, iter(items(10)), tmp_path / "out", total=10)
    assert info.value.summary.total == 10 and info.value.summary.remaining == 10
