"""The scheduler with real parts: a redis-server, `python -m sdfarm.scheduler.service`
processes and real workers (`python -m sdfarm.worker.main`) running the runtime on the tiny
model at 64x64, 1 step. Each test starts its own processes; the hosts are names given to
CPU workers on this machine, which is all placement looks at."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sdfarm.client.farm import Farm, FarmBusyError, Job, JobFailed
from sdfarm.store import JobSpec, Store

F16, Q8 = "tiny-f16", "tiny-q8_0"
SMALL = {"width": 64, "height": 64, "steps": 1}
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def farm_models(tmp_path_factory: pytest.TempPathFactory, tiny_models: list[Path]) -> Path:
    """Both tiny models plus `huge`: the tiny f16 model with its diffusion file grown (sparse,
    no disk used) to 200 GiB, so its estimate exceeds every machine that runs the tests."""
    root = tmp_path_factory.mktemp("farm-models")
    for model in tiny_models:
        shutil.copytree(model, root / model.name)
    huge = root / "huge"
    shutil.copytree(tiny_models[0], huge)
    os.truncate(huge / "dit.safetensors", 200 * 1024**3)
    return root


class Cluster:
    """Scheduler and worker subprocesses, each in its own session so a kill takes the Celery
    pool child with its parent; everything is stopped at teardown."""

    def __init__(self, url: str, models: Path, logs: Path) -> None:
        self.url = url
        self.models = models
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: set[str] = set()  # killed on purpose: their exit is no failure
        self.store = Store.connect(url)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.logs / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                start_new_session=True,
            )

    def scheduler(self, name: str = "sched", *extra: str) -> None:
        self._spawn(name, ["-m", "sdfarm.scheduler.service", "--redis", self.url, *extra])

    def worker(self, host: str, *extra: str, hooks: bool = False) -> None:
        args = ["-m", "sdfarm.worker.main", "--device", "CPU", "--redis", self.url]
        args += ["--models", str(self.models), "--host", host, "--threads", "1", *extra]
        self._spawn(host, args, {"SDFARM_TEST_HOOKS": "1"} if hooks else None)

    def heartbeat(self, host: str) -> dict[str, Any] | None:
        return self.store.heartbeat(f"{host}/CPU")

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            for name, proc in self.procs.items():
                if proc.poll() is not None and name not in self.stopped:
                    raise AssertionError(f"{name} exited ({proc.returncode}):\n{self.log(name)}")
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}\n{self.log(n)}" for n in self.procs)
                raise AssertionError(f"timed out waiting for {what}\n{logs}")
            time.sleep(0.05)

    def ready(self, *hosts: str) -> None:
        self.wait_for(f"heartbeats of {hosts}", lambda: all(self.heartbeat(h) for h in hosts))
        self.wait_for("a leader", self.store.lease_holder)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        self.stopped.add(name)
        proc = self.procs[name]
        os.killpg(proc.pid, sig)
        return proc.wait(30)

    def result(self, job: Job, timeout: float = TIMEOUT) -> Any:
        """job.result, with the farm's state and every log in the failure when it times out."""
        try:
            return job.result(timeout)
        except TimeoutError:
            lines = [f"job {job.id} timed out: {job.record()}", f"events: {job.events()}"]
            reading = self.store.snapshot()
            for key in sorted(reading.known):
                hb = reading.heartbeats.get(key) or {}
                running = reading.running.get(key)
                lines.append(f"{key}: {hb.get('incarnation')} {hb.get('state')} {running}")
            lines += [f"--- {n}\n{self.log(n)}" for n in self.procs]
            raise AssertionError("\n".join(lines)) from None

    def log(self, name: str) -> str:
        try:
            return (self.logs / f"{name}.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.store.close()


@pytest.fixture
def cluster(redis_url: str, farm_models: Path, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(redis_url, farm_models, tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def farm(redis_url: str) -> Iterator[Farm]:
    with Farm(redis_url, submitter="tests") as f:
        yield f


def ran_on(job: Job) -> str:
    return job.result(TIMEOUT).metadata["host"]


def loads(jobs: list[Job]) -> Counter[tuple[str, str]]:
    """(host, model) -> loads those jobs caused (a `loading` event means the job loaded)."""
    out: Counter[tuple[str, str]] = Counter()
    for job in jobs:
        for e in job.events():
            if e["event"] == "loading":
                out[(ran_on(job), e["model"])] += 1
    return out


def hook_job(farm: Farm, hook: str, model: str = F16, **kw: Any) -> Job:
    """A job carrying a test hook (honoured only by workers with SDFARM_TEST_HOOKS)."""
    params = {"prompt": f"hook {hook}", "negative_prompt": "", "seed": 1, **SMALL}
    spec = JobSpec(model=model, params=params, submitter="tests", test_hook=hook, **kw)
    return farm.submit_spec(spec)


def test_jobs_go_where_their_model_is_loaded(cluster: Cluster, farm: Farm) -> None:
    # Both "hosts" share this machine's MemAvailable; a limit gives each its own memory, so
    # an engine held on one leaves it less free than the other, as on two real hosts.
    cluster.worker("hosta", "--memory-limit", "4GiB")
    cluster.worker("hostb", "--memory-limit", "4GiB")
    cluster.scheduler()
    cluster.ready("hosta", "hostb")

    first = farm.submit(F16, "a lighthouse", **SMALL)
    f16_host = ran_on(first)
    second = farm.submit(Q8, "a lighthouse", **SMALL)
    q8_host = ran_on(second)
    assert q8_host != f16_host  # the emptier device takes the new model: no eviction
    # One at a time, each job goes to the worker that holds its model: no new load.
    singles = []
    for i in range(3):
        for model, host in ((F16, f16_host), (Q8, q8_host)):
            job = farm.submit(model, f"single {i}", **SMALL)
            assert ran_on(job) == host
            singles.append(job)
    assert loads(singles) == Counter()
    # A mixed batch may spread over both workers, but no worker loads a model twice.
    batch = [farm.submit((F16, Q8)[i % 2], f"batch {i}", **SMALL) for i in range(12)]
    assert all(job.result(TIMEOUT).png.startswith(b"\x89PNG") for job in batch)
    counted = loads([first, second, *batch])
    assert counted[(f16_host, F16)] == 1 and counted[(q8_host, Q8)] == 1
    assert set(counted.values()) == {1}, counted


def test_memory_limit_and_a_model_nothing_can_fit(cluster: Cluster, farm: Farm) -> None:
    cluster.worker("roomy", "--memory-limit", "4GiB")
    cluster.worker("tiny", "--memory-limit", "64MiB")
    cluster.scheduler()
    cluster.ready("roomy", "tiny")

    jobs = [farm.submit(F16, f"p{i}", **SMALL) for i in range(6)]
    assert {ran_on(j) for j in jobs} == {"roomy"}
    assert cluster.heartbeat("tiny")["loaded"] == []

    started = time.monotonic()
    job = farm.submit("huge", "too big", **SMALL)
    with pytest.raises(JobFailed) as info:
        job.result(10)
    assert time.monotonic() - started < 5  # at once, not after a timeout
    err = info.value
    assert "huge needs an estimated" in err.error
    assert "roomy/CPU" in err.error and "tiny/CPU" in err.error
    assert err.estimate and err.estimate > 200 * 1024**3
    assert {f["device"] for f in err.figures} == {"roomy/CPU", "tiny/CPU"}
    assert {f["capacity"] for f in err.figures} == {4 * 1024**3, 64 * 1024**2}


def test_interactive_jobs_overtake_a_batch_and_submitters_share(
    cluster: Cluster, farm: Farm
) -> None:
    cluster.worker("solo")
    cluster.scheduler()
    cluster.ready("solo")

    batch = [farm.submit(F16, f"batch {i}", priority=9, **SMALL) for i in range(8)]
    cluster.wait_for("the batch to start", lambda: batch[0].state() in ("running", "done"))
    urgent = [farm.submit(F16, f"now {i}", priority=0, **SMALL) for i in range(2)]
    ended = {}
    for job in batch + urgent:
        job.result(TIMEOUT)
        ended[job.id] = float(job.record()["ended"])
    # At most the backlog (2 jobs) was already on the device when they arrived.
    assert max(ended[j.id] for j in urgent) < min(ended[j.id] for j in batch[3:])

    # Fair share at one priority: bob's single job does not wait for alice's whole batch.
    alice = [farm.submit(F16, f"alice {i}", submitter="alice", **SMALL) for i in range(6)]
    cluster.wait_for("alice's batch to start", lambda: alice[0].state() in ("running", "done"))
    bob = farm.submit(F16, "bob", submitter="bob", **SMALL)
    bob.result(TIMEOUT)
    assert all(not j.done() for j in alice[3:])
    for job in alice:
        job.result(TIMEOUT)


def test_queue_limit_says_busy(cluster: Cluster, farm: Farm, redis_url: str) -> None:
    cluster.scheduler("sched", "--queue-limit", "3")
    cluster.wait_for("the config", lambda: cluster.store.queues()["config"].get("queue_limit"))
    jobs = [farm.submit(F16, f"p{i}", **SMALL) for i in range(3)]  # no workers: they wait
    with pytest.raises(FarmBusyError) as info:
        farm.submit(F16, "one too many", **SMALL)
    assert (info.value.depth, info.value.limit) == (3, 3)
    assert "busy" in str(info.value)
    assert jobs[0].cancel() and jobs[0].state() == "cancelled"
    farm.submit(F16, "room again", **SMALL)


def test_standby_takes_over_when_the_leader_dies(cluster: Cluster, farm: Farm) -> None:
    cluster.worker("solo")
    cluster.scheduler("s1")
    cluster.ready("solo")
    cluster.scheduler("s2")
    leader = cluster.store.lease_holder()
    first = "s1" if f":{cluster.procs['s1'].pid}:" in leader else "s2"
    second = "s2" if first == "s1" else "s1"

    jobs = [farm.submit(F16, f"p{i}", **SMALL) for i in range(8)]
    cluster.wait_for("a first result", lambda: jobs[0].state() == "done")
    cluster.kill(first)  # SIGKILL: no release, the standby waits out the lease
    for job in jobs:
        assert cluster.result(job).png
    new = cluster.store.lease_holder()
    assert f":{cluster.procs[second].pid}:" in new
    more = farm.submit(F16, "after failover", **SMALL)
    assert more.result(TIMEOUT).png
    # A clean stop releases the lease at once.
    assert cluster.kill(second, signal.SIGTERM) == 0
    assert cluster.store.lease_holder() is None


def test_jobs_of_a_killed_worker_finish_once_elsewhere(cluster: Cluster, farm: Farm) -> None:
    cluster.worker("victim", hooks=True)
    cluster.worker("survivor", hooks=True)
    cluster.scheduler()
    cluster.ready("victim", "survivor")

    jobs = [hook_job(farm, "sleep:0.5") for _ in range(10)]

    def victim_running() -> bool:
        return any(
            j.record().get("device") == "victim/CPU" and j.state() == "running" for j in jobs
        )

    cluster.wait_for("a job running on the victim", victim_running)
    cluster.kill("victim")
    for job in jobs:
        assert cluster.result(job).metadata["job"] == job.id
    for job in jobs:
        kinds = Counter(e["event"] for e in job.events())
        assert kinds["done"] == 1 and kinds["failed"] == 0
    retried = [j for j in jobs if any(e["event"] == "retried" for e in j.events())]
    assert retried, "the victim's jobs should have been re-placed"
    assert all(ran_on(j) == "survivor" for j in retried)


def test_a_job_that_kills_two_workers_is_poison(cluster: Cluster, farm: Farm) -> None:
    cluster.worker("w1", hooks=True)
    cluster.worker("w2", hooks=True)
    cluster.scheduler()
    cluster.ready("w1", "w2")

    poison = hook_job(farm, "abort")
    others = [farm.submit(F16, f"p{i}", **SMALL) for i in range(6)]
    with pytest.raises(JobFailed) as info:
        cluster.result(poison)
    assert "killed its worker twice" in info.value.error
    assert "log records" in info.value.error
    assert poison.record()["attempts"] == "2"
    for job in others:
        assert cluster.result(job).png


def test_leader_lease_and_fence(redis_url: str) -> None:
    from sdfarm.scheduler.dispatch import Dispatcher, NotLeader
    from sdfarm.scheduler.leader import LeaderLock

    store = Store.connect(redis_url)
    a, b = LeaderLock(store, "a", ttl_ms=300), LeaderLock(store, "b", ttl_ms=300)
    assert a.acquire() and a.fresh and a.held
    assert not b.acquire() and not b.held
    assert a.acquire() and not a.fresh  # still ours: a renewal, not a new term
    time.sleep(0.35)  # a stalls past its lease
    assert not a.held and not a.renew_if_due()
    assert b.acquire() and b.fresh
    assert not a.acquire()
    # A stale leader's writes are fenced off even if it has not noticed yet.
    job = Farm(redis_url).submit(F16, "fenced", **SMALL)
    stale = Dispatcher(store, "a", lambda *args: None)
    with pytest.raises(NotLeader):
        stale._lost(
            job.id, {"state": "queued", "dispatch": "", "priority": "5"}, "h/CPU", "x", False
        )
    assert job.state() == "queued"
    assert b.release() and store.lease_holder() is None
    assert not a.release()
