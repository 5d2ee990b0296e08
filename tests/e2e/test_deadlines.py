"""Nothing hangs: a job past its deadline fails and its worker stops it; a job whose task
message never reached its worker is placed again; when Redis is full (it refuses every write)
a waiting client gives up at the deadline saying so, a batch ends, and once Redis takes writes
again the job ends and the farm goes on. A real local farm (redis-server,
scheduler, a CPU worker with test hooks on) and the tiny model."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sdfarm.client.batch import BatchStopped, run_batch
from sdfarm.client.batch_input import BatchItem
from sdfarm.client.farm import Farm, JobFailed
from sdfarm.store import JobSpec, Store, transport

pytestmark = pytest.mark.e2e

MODEL = "tiny-f16"
SMALL = {"width": 64, "height": 64, "steps": 1}
GRACE = 3.0


@pytest.fixture(scope="module")
def local(models_dir: Path) -> Iterator[Any]:
    from sdfarm.localfarm.farm import LocalFarm

    farm = LocalFarm(
        [models_dir],
        devices=["CPU"],
        threads=1,
        host="deadlinehost",
        announce=False,
        env={**os.environ, "SDFARM_TEST_HOOKS": "1"},
    )
    with farm:
        yield farm


@pytest.fixture
def farm(local: Any) -> Iterator[Farm]:
    with Farm(local.url, submitter="deadline-tests", deadline_grace_s=GRACE) as f:
        f.submit(MODEL, "warm", **SMALL).result(60)
        yield f


def hooked(farm: Farm, hook: str, deadline_s: float = 3600.0) -> Any:
    spec = JobSpec(model=MODEL, params={"prompt": hook, **SMALL}, test_hook=hook,
                   deadline_s=deadline_s)  # fmt: skip
    return farm.submit_spec(spec)


def wait_state(job: Any, state: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while job.state() != state:
        assert time.monotonic() < deadline, f"never {state}: {job.record()}"
        time.sleep(0.05)


def test_a_job_past_its_deadline_fails_and_its_worker_stops_it(farm: Farm) -> None:
    before = farm.status()["devices"][0]["incarnation"]
    job = hooked(farm, "sleep:60", deadline_s=2)
    t = time.monotonic()
    with pytest.raises(JobFailed) as info:
        job.result(30)
    assert time.monotonic() - t < 10
    assert info.value.error.startswith("deadline: the job was placed on deadlinehost/CPU")
    assert "deadline of 2 s" in info.value.error
    assert "deadline" in [e.get("reason") for e in job.events()]
    # The worker stopped the generation (a new process) and the farm goes on.
    deadline = time.monotonic() + 20
    while farm.status()["devices"][0].get("incarnation") in (before, None):
        assert time.monotonic() < deadline, "the overdue job's worker went on generating"
        time.sleep(0.1)
    assert farm.submit(MODEL, "after the deadline", **SMALL).result(60).png


def test_a_job_whose_message_was_lost_is_placed_again(farm: Farm, local: Any) -> None:
    busy = hooked(farm, "sleep:4")
    wait_state(busy, "running")
    lost = farm.submit(MODEL, "its message goes missing", **SMALL)
    wait_state(lost, "placed")
    key = farm.status()["devices"][0]["key"]
    store = Store.connect(local.url)
    try:
        store.r.delete(*transport.queue_lists(key))  # what a flushed queue or a refused claim does
    finally:
        store.close()
    assert busy.result(30).png
    assert lost.result(60).png
    retried = [e for e in lost.events() if e["event"] == "retried"]
    assert [e["reason"] for e in retried] == ["its task message never reached the worker"]
    assert not retried[0]["counted"]  # not the job's fault: no attempt counted


def test_a_full_redis_ends_the_wait_and_the_batch_then_the_farm_recovers(
    farm: Farm, local: Any, tmp_path: Path
) -> None:
    admin = Store.connect(local.url)
    job = hooked(farm, "sleep:2", deadline_s=4)
    wait_state(job, "running")
    admin.r.config_set("maxmemory", 1)  # above it: Redis refuses every write
    try:
        t = time.monotonic()
        with pytest.raises(JobFailed) as info:
            job.result(60)
        waited = time.monotonic() - t
        assert "the farm's Redis is full" in info.value.error, info.value.error
        assert "past its deadline of 4 s" in info.value.error
        assert waited < 4 + GRACE + 5
        # A batch stops at once (a full Redis is no item's fault), saying why; a re-run resumes.
        items = [BatchItem(i, f"refused {i}", f"refused-{i}") for i in range(2)]
        with pytest.raises(BatchStopped, match="Redis is full") as stopped:
            run_batch(farm, items, tmp_path / "out", MODEL, common=SMALL, timeout=30)
        assert stopped.value.kind == "farm" and stopped.value.summary.failed == 0
    finally:
        admin.r.config_set("maxmemory", 0)
    # Redis takes writes again: the job ends (run again after its worker's Celery process,
    # which a refused acknowledgement kills, was restarted; or failed with the reason), and
    # the farm goes on.
    deadline = time.monotonic() + 60
    while job.state() not in ("done", "failed"):
        assert time.monotonic() < deadline, job.record()
        time.sleep(0.2)
    if job.state() == "failed":
        error = job.record()["error"]
        assert error.startswith(("the result could not be stored: Redis refused", "deadline:"))
    assert farm.submit(MODEL, "after the full Redis", **SMALL).result(60).png
    admin.close()


def test_a_frozen_worker_is_noticed_and_replaced(farm: Farm, local: Any) -> None:
    """SIGSTOP of the worker's Celery main process (it reads no more messages): its pool
    process stops heartbeating, so the device expires and no job waits on it; the supervisor
    kills the frozen worker and starts it again, and the farm goes on."""
    import signal

    main = local.procs["worker:CPU"]
    before = len(local.supervisor.restarts)
    os.kill(main.pid, signal.SIGSTOP)
    try:
        job = farm.submit(MODEL, "while frozen", **SMALL)
        assert job.result(60).png
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(main.pid, signal.SIGCONT)
    restarts = local.supervisor.restarts[before:]
    assert [(r.role, r.why.split(" for ")[0]) for r in restarts] == [("worker:CPU", "frozen")]
    assert restarts[0].recovery_s is not None
