"""The worker against a real redis-server, real worker processes and the real runtime running
the tiny model, without any scheduler: each test submits a job and places it through the store
(playing the leader), sends the Celery task to the device's queue, and reads what the worker
wrote.

Two workers per module: `plain` (test hooks off, as in production) and `hooked`
(SDFARM_TEST_HOOKS=1, for the tests that end the worker's process on purpose).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sdfarm.native.devices import Device, HostFigures
from sdfarm.native.png import read_params
from sdfarm.store import JobSpec, Store, keys, transport
from sdfarm.store.records import new_dispatch_id
from sdfarm.worker import hooks

SMALL = {"prompt": "a red cat", "width": 64, "height": 64, "steps": 1, "seed": 7}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Worker:
    """One `python -m sdfarm.worker.main` process on the CPU under a unique host name."""

    def __init__(self, url: str, models: Path, log: Path, env: dict[str, str]) -> None:
        self.host = f"wt-{uuid.uuid4().hex[:8]}"
        self.key = keys.device_key(self.host, "CPU")
        self.store = Store.connect(url)
        self.log = log
        cmd = [
            sys.executable, "-m", "sdfarm.worker.main", "--device", "cpu", "--redis", url,
            "--models", str(models), "--host", self.host, "--threads", "1", "--json",
        ]  # fmt: skip
        self._err = log.open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self._err, env={**os.environ, **env}
        )
        self.started = json.loads(self.proc.stdout.readline() or b"{}")  # type: ignore[union-attr]
        self.heartbeat()  # wait for the pool process

    def heartbeat(self, timeout: float = 30.0, until: Callable[[dict], bool] | None = None) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            doc = self.store.heartbeat(self.key)
            if doc is not None and (until is None or until(doc)):
                return doc
            assert self.proc.poll() is None, f"worker exited: {self.log.read_text()[-3000:]}"
            time.sleep(0.1)
        raise AssertionError(f"no matching heartbeat within {timeout} s: {self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()


class Farm:
    """Just enough of a scheduler and a client to drive one worker, through the store."""

    TOKEN = "test-worker-leader"

    def __init__(self, url: str) -> None:
        from sdfarm.worker.app import make_app

        # redis-py 8 reads with a 5 s socket timeout by default: a wait needs longer.
        self.store = Store.connect(url, socket_timeout=120)
        self.app = make_app(url)

    def place(
        self,
        worker: Worker,
        params: dict[str, Any] | None = None,
        model: str = "tiny-f16",
        *,
        log_level: str = "info",
        test_hook: str | None = None,
        send: bool = True,
        send_dispatch: str | None = None,
        before_send: Callable[[str], None] | None = None,
    ) -> str:
        """Submit a job and place it on `worker` as the scheduler would, then send its task
        (the placement's own message goes to a list nobody reads, so a test can act between
        the placement and the message)."""
        spec = JobSpec(
            model=model, params=dict(params or SMALL), log_level=log_level, test_hook=test_hook
        )
        job_id, _, _ = self.store.submit(spec, 10_000)
        assert job_id is not None
        if not self.store.take_lease(self.TOKEN, 3_600_000):
            assert self.store.renew_lease(self.TOKEN, 3_600_000)
        dispatch = new_dispatch_id()
        held = (transport.queue_name("held/none"), "{}")
        rc = self.store.place(self.TOKEN, job_id, 5, worker.key, dispatch, 0, "test", (), held)
        assert rc == 1
        if before_send:
            before_send(job_id)
        if send:
            transport.send(self.app, job_id, send_dispatch or dispatch, worker.key)
        return job_id

    def wait(self, job_id: str, timeout: float = 30.0) -> str:
        assert self.store.wait(job_id, timeout), f"job {job_id} did not end: {self.job(job_id)}"
        return self.store.state(job_id)

    def job(self, job_id: str) -> dict[str, str]:
        return self.store.record(job_id)

    def result(self, job_id: str) -> Any:
        return self.store.ended(job_id)

    def events(self, job_id: str) -> list[str]:
        return [e["event"] for e in self.store.events(job_id)]

    def running(self, device_key: str) -> dict[str, str]:
        return self.store.snapshot().running.get(device_key, {})

    def wait_state(self, job_id: str, state: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.job(job_id).get("state") != state:
            assert time.monotonic() < deadline, f"job {job_id} never {state}: {self.job(job_id)}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def farm(redis_server: Any) -> Farm:
    """The module's farm on the session's redis-server, emptied first: a module before this
    one may have left a leader lease (tests/integration/test_store.py holds one for 60 s)."""
    f = Farm(redis_server.url)
    f.store.r.flushall()
    return f


def _worker(
    redis_server: Any, models_dir: Path, tmp: Path, env: dict[str, str]
) -> Iterator[Worker]:
    clean = {k: v for k, v in env.items()}
    w = Worker(redis_server.url, models_dir, tmp / "worker.log", clean)
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def plain(
    redis_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    os.environ.pop(hooks.TEST_HOOKS_ENV, None)
    yield from _worker(redis_server, models_dir, tmp_path_factory.mktemp("plain"), {})


@pytest.fixture(scope="module")
def hooked(
    redis_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    env = {hooks.TEST_HOOKS_ENV: "1"}
    yield from _worker(redis_server, models_dir, tmp_path_factory.mktemp("hooked"), env)


# -- the plain worker -------------------------------------------------------------------------


def test_job_result_holds_png_metadata_records_and_heartbeat(farm: Farm, plain: Worker) -> None:
    job_id = farm.place(plain)
    assert farm.wait(job_id) == "done"
    job = farm.job(job_id)
    assert job["state"] == "done" and job["error"] == ""
    assert float(job["ended"]) >= float(job["started"]) >= float(job["created"])
    assert json.loads(job["records"]), "load records stored before generating"
    assert job_id not in farm.running(plain.key)
    assert farm.store.recent(1) == [job_id]  # the status page's thumbnails

    res = farm.result(job_id)
    assert len(res.pngs) == 1 and res.pngs[0].startswith(PNG_MAGIC)
    chunk = read_params(res.pngs[0])
    assert chunk["prompt"] == "a red cat" and chunk["seed"] == 7 and chunk["model"] == "tiny-f16"
    meta = res.meta
    assert meta["job"] == job_id and meta["model"] == "tiny-f16"
    assert meta["host"] == plain.host and meta["device"] == "CPU"
    assert meta["fit_plan"]["device"] == "CPU" and meta["warnings"] == []
    timings = meta["timings"]
    for name in ("queued_s", "load_s", "generate_s", "encode_s"):
        assert timings[name] >= 0, name
    assert timings["load_s"] > 0
    records = res.records
    assert records and all(r["message"].startswith("stable_diffusion: ") for r in records)
    assert any("generate_image" in r["message"] for r in records)

    events = farm.events(job_id)
    assert events[:5] == ["queued", "placed", "running", "loading", "loaded"]
    assert "step" in events and events[-1] == "done"
    progress = farm.store.progress(job_id)
    assert progress["step"] == progress["steps"] == 1

    hb = plain.heartbeat(until=lambda d: any(m["name"] == "tiny-f16" for m in d["loaded"]))
    assert hb["key"] == plain.key and hb["type"] == "cpu" and hb["backend"] == "CPU"
    assert set(hb["models"]) == {"tiny-f16", "tiny-q8_0"}
    assert hb["models"]["tiny-f16"]["native_size"] == [256, 256]
    assert hb["models"]["tiny-f16"]["decode_per_pixel"] == 0  # a CPU worker: no im2col term
    assert hb["compute_figure"] <= hb["capacity"] and hb["queue"] == 0
    assert hb["version"]["sd"].startswith("master-596")
    assert plain.key in farm.store.snapshot().known
    # The runtime lives only in the pool process, never in the parent that forks it.
    assert "libstable-diffusion" not in Path(f"/proc/{plain.proc.pid}/maps").read_text()
    assert "libstable-diffusion" in Path(f"/proc/{hb['pid']}/maps").read_text()


def test_second_job_for_the_same_model_does_not_load_again(farm: Farm, plain: Worker) -> None:
    first = farm.place(plain)
    farm.wait(first)
    second = farm.place(plain, {**SMALL, "seed": 8}, log_level="none")
    assert farm.wait(second) == "done"
    assert "loading" not in farm.events(second)
    meta = farm.result(second).meta
    assert meta["timings"]["load_s"] == 0 and meta["seed"] == 8
    assert farm.result(second).records == []  # log_level none


def test_stale_dispatch_is_dropped(farm: Farm, plain: Worker) -> None:
    stale = farm.place(plain, send_dispatch="not-the-current-dispatch")
    after = farm.place(plain)  # the queue is FIFO with one process: stale ran first
    assert farm.wait(after) == "done"
    job = farm.job(stale)
    assert job["state"] == "placed" and "started" not in job and "incarnation" not in job
    assert farm.events(stale) == ["queued", "placed"]  # never claimed
    assert set(farm.store.ttls(stale)) == {keys.job_key(stale), keys.events_key(stale)}


def test_invalid_param_fails_the_job_and_the_worker_serves_the_next(
    farm: Farm, plain: Worker
) -> None:
    before = plain.heartbeat()["incarnation"]
    bad = farm.place(plain, {**SMALL, "width": 0})  # written past the client's validation
    assert farm.wait(bad) == "failed"
    job = farm.job(bad)
    assert "width" in job["error"] and "64..4096" in job["error"]
    assert "failed" in farm.events(bad)
    assert farm.result(bad).meta["error"] == job["error"]
    good = farm.place(plain)
    assert farm.wait(good) == "done"
    assert plain.heartbeat()["incarnation"] == before  # the same process went on


def test_unknown_or_escaping_model_names_fail_clearly(farm: Farm, plain: Worker) -> None:
    unknown = farm.place(plain, model="no-such-model")
    escaping = farm.place(plain, model="../tiny-f16")
    assert farm.wait(unknown) == "failed" and farm.wait(escaping) == "failed"
    assert "unknown model 'no-such-model'" in farm.job(unknown)["error"]
    assert "invalid model name" in farm.job(escaping)["error"]


def test_a_size_too_large_for_the_host_fails_with_estimate_and_figures(
    farm: Farm, plain: Worker
) -> None:
    # Untiled: decoded in tiles, 4096x4096 would fit this host's MemAvailable.
    job_id = farm.place(plain, {**SMALL, "width": 4096, "height": 4096, "vae_tiling": "off"})
    assert farm.wait(job_id) == "failed"
    job = farm.job(job_id)
    assert "4096x4096 needs an estimated" in job["error"]
    figures = json.loads(job["figures"])
    assert figures[0]["device"] == plain.key and "MemAvailable" in figures[0]["figures"]
    assert int(job["estimate"]) > 40 << 30
    loaded = {m["name"]: m for m in plain.heartbeat()["loaded"]}
    assert loaded["tiny-f16"]["estimate"] < 1 << 30  # a refused size leaves no trace


def test_cancel_of_a_job_queued_on_the_device(farm: Farm, plain: Worker) -> None:
    before = plain.heartbeat()["incarnation"]

    def cancel(job_id: str) -> None:
        assert farm.store.cancel(job_id) == 2  # placed: a request for its worker

    job_id = farm.place(plain, before_send=cancel)
    assert farm.wait(job_id) == "cancelled"
    assert farm.job(job_id)["state"] == "cancelled"
    assert farm.result(job_id).meta == {} and farm.result(job_id).pngs == []
    assert job_id not in farm.running(plain.key)
    assert plain.heartbeat()["incarnation"] == before  # not running: no process was ended


def test_test_hooks_are_inert_without_the_environment(farm: Farm, plain: Worker) -> None:
    spec = {"model": "m", "params": {"prompt": "x"}, "test_hook": "abort"}
    assert hooks.test_hook(spec, environ={}) is None
    assert hooks.test_hook(spec, environ={"SDFARM_TEST_HOOKS": "0"}) is None
    assert hooks.test_hook(spec, environ={"SDFARM_TEST_HOOKS": "1"}) == "abort"
    before = plain.heartbeat()["incarnation"]
    job_id = farm.place(plain, test_hook="abort")
    assert farm.wait(job_id) == "done"
    assert plain.heartbeat()["incarnation"] == before


# -- the hooked worker: processes that end on purpose --------------------------------------


def test_cancel_while_running_ends_the_process_and_the_next_job_runs(
    farm: Farm, hooked: Worker
) -> None:
    first = farm.place(hooked)
    assert farm.wait(first) == "done"  # something finished before the cancel: kept
    before = hooked.heartbeat()["incarnation"]
    job_id = farm.place(hooked, test_hook="sleep:60")
    farm.wait_state(job_id, "running")
    t = time.monotonic()
    assert farm.store.cancel(job_id) == 2
    assert farm.wait(job_id, timeout=10) == "cancelled"
    assert time.monotonic() - t < 5
    assert len(farm.result(first).pngs) == 1
    hb = hooked.heartbeat(until=lambda d: d["incarnation"] != before)
    assert hb["loaded"] == []  # a fresh process: the engine goes with the old one
    nxt = farm.place(hooked)
    assert farm.wait(nxt) == "done"
    assert "loading" in farm.events(nxt)


def test_abort_leaves_the_job_running_for_the_scheduler_to_recover(
    farm: Farm, hooked: Worker
) -> None:
    before = hooked.heartbeat()["incarnation"]
    job_id = farm.place(hooked, test_hook="abort")
    hb = hooked.heartbeat(until=lambda d: d["incarnation"] != before)
    job = farm.job(job_id)
    assert job["state"] == "running" and job["incarnation"] == before != hb["incarnation"]
    assert keys.done_key(job_id) not in farm.store.ttls(job_id)
    nxt = farm.place(hooked)
    assert farm.wait(nxt) == "done"


# -- chained jobs (sdfarm.worker.chain) ----------------------------------------------------------


def test_jobs_queued_together_run_back_to_back_without_celery(farm: Farm, plain: Worker) -> None:
    """After a job the slot takes the device's next message itself: every job runs, in
    order, and the ones after the first say they were chained."""
    jobs = [farm.place(plain, {**SMALL, "seed": 20 + i}, log_level="none") for i in range(4)]
    assert [farm.wait(j) for j in jobs] == ["done"] * 4
    metas = [farm.result(j).meta for j in jobs]
    chained = [bool(m.get("chained")) for m in metas]
    assert sum(chained) >= 2, chained
    # taken and prepared during the native call before it (sdfarm.worker.chain's lookahead)
    assert any(m.get("ahead") for m in metas), metas
    assert not metas[0].get("ahead")
    started = [float(farm.job(j)["started"]) for j in jobs]
    assert started == sorted(started)
    assert farm.store.queue_length(plain.key) == 0


def test_a_stopping_worker_finishes_its_job_and_chains_no_other(
    farm: Farm, redis_server: Any, models_dir: Path, tmp_path: Path
) -> None:
    env = {hooks.TEST_HOOKS_ENV: "1"}
    worker = Worker(redis_server.url, models_dir, tmp_path / "worker.log", env)
    try:
        # the lookahead takes the next message, then SIGTERM: the worker gives it back
        first = farm.place(worker, test_hook="ahead-sleep:2")
        rest = [farm.place(worker, {**SMALL, "seed": 30 + i}) for i in range(2)]
        farm.wait_state(first, "running")
        deadline = time.monotonic() + 20
        while farm.store.queue_length(worker.key) != 1:  # the lookahead took the next one
            assert time.monotonic() < deadline, "the next message was not taken ahead"
            time.sleep(0.02)
        worker.proc.send_signal(signal.SIGTERM)
        assert farm.wait(first, timeout=30) == "done"
        assert worker.proc.wait(30) == 0
        assert [farm.job(j)["state"] for j in rest] == ["placed", "placed"]
        assert farm.store.queue_length(worker.key) == 2  # their messages wait for a worker
    finally:
        worker.stop()


def test_a_job_taken_ahead_by_a_process_that_dies_runs_on_its_successor(
    farm: Farm, hooked: Worker
) -> None:
    """The lookahead took the next job's message from the queue while the current job ran,
    and the process died: the next process of the slot puts that message back first, so the
    job runs there (no scheduler here would re-place it)."""
    before = hooked.heartbeat()["incarnation"]
    warm = farm.place(hooked)  # the engine loaded: the next job is prepared ahead
    assert farm.wait(warm) == "done"
    dying = farm.place(hooked, test_hook="abort-running", send=False)
    nxt = farm.place(hooked, {**SMALL, "seed": 41}, send=False)
    # Both messages at once: Celery delivers the first and leaves the second in the queue
    # (one slot, prefetch 1, acks late), where the dying job's lookahead takes it.
    for job in (dying, nxt):
        transport.send(farm.app, job, farm.job(job)["dispatch"], hooked.key)
    hooked.heartbeat(until=lambda d: d["incarnation"] != before, timeout=60)
    assert farm.wait(nxt, timeout=60) == "done"
    assert farm.job(dying)["state"] == "running"  # left for the scheduler, as any abort
    assert farm.store.queue_length(hooked.key) == 0
    # the next job had been claimed ahead, and never began: placed again, not charged
    assert "job unclaimed" in hooked.log.read_text()
    assert farm.job(nxt).get("attempts", "0") == "0"


def test_a_cancel_of_the_job_claimed_ahead_ends_it_and_the_process_lives_on(
    farm: Farm, hooked: Worker
) -> None:
    """The next job was claimed ahead during the one before; a cancel of it, seen by the
    cancel watch before it begins, ends it without a native call: no process is lost for a
    job that had not started."""
    warm = farm.place(hooked)
    assert farm.wait(warm) == "done"
    before = hooked.heartbeat()["incarnation"]
    first = farm.place(hooked, test_hook="ahead-sleep:1.5", send=False)
    nxt = farm.place(hooked, {**SMALL, "seed": 51}, send=False)
    for job in (first, nxt):
        transport.send(farm.app, job, farm.job(job)["dispatch"], hooked.key)
    deadline = time.monotonic() + 20
    while not farm.job(nxt).get("ahead"):
        assert time.monotonic() < deadline, "the next job was not claimed ahead"
        time.sleep(0.02)
    assert farm.store.cancel(nxt) == 2
    assert farm.wait(first) == "done"
    assert farm.wait(nxt) == "cancelled"
    assert hooked.heartbeat()["incarnation"] == before  # the same process
    after = farm.place(hooked, {**SMALL, "seed": 52})
    assert farm.wait(after) == "done"
    assert hooked.heartbeat()["incarnation"] == before


def test_a_job_claimed_ahead_that_aborts_its_process_is_charged_with_the_abort(
    farm: Farm, hooked: Worker
) -> None:
    """The lookahead claimed the next job during the one before; that job's run began and
    killed the process before its start reached Redis. Its start mark (sdfarm.worker.
    startmark) tells the next process, which charges it: the scheduler counts its loss as a
    run (a poison job cannot loop for ever as a job that never began)."""
    before = hooked.heartbeat()["incarnation"]
    warm = farm.place(hooked)
    assert farm.wait(warm) == "done"
    first = farm.place(hooked, test_hook="ahead-sleep:0.5", send=False)
    killer = farm.place(hooked, test_hook="abort-at-start", send=False)
    for job in (first, killer):
        transport.send(farm.app, job, farm.job(job)["dispatch"], hooked.key)
    hooked.heartbeat(until=lambda d: d["incarnation"] != before, timeout=60)
    assert farm.wait(first, timeout=60) == "done"
    deadline = time.monotonic() + 30
    while "job charged" not in hooked.log.read_text():
        assert time.monotonic() < deadline, hooked.log.read_text()[-3000:]
        time.sleep(0.05)
    job = farm.job(killer)
    assert job["state"] == "running" and job["incarnation"] == before
    assert "ahead" not in job and job["started"]  # a run that began: its loss counts
    assert farm.store.queue_length(hooked.key) == 0  # its message is spent, not put back


# -- the uploader's cap, against the real Redis --------------------------------------------


def test_a_result_above_the_cap_fails_with_a_clear_error(farm: Farm) -> None:
    from PIL import Image

    from sdfarm.worker.results import Finished, Uploader

    key = "cap-host/CPU"
    worker = type("W", (), {"key": key})()
    job_id = farm.place(worker, send=False)
    dispatch = farm.job(job_id)["dispatch"]
    assert farm.store.claim(job_id, dispatch, "incarnation", "cap-worker") is not None
    up = Uploader(farm.store, key, max_result_bytes=100)
    image = Image.new("RGB", (64, 64), (200, 10, 10))
    assert up.write(Finished(job_id, dispatch, "done", meta={"prompt": "x"}, images=[image]))
    job = farm.job(job_id)
    assert job["state"] == "failed" and "result too large" in job["error"]
    assert farm.result(job_id).pngs == []
    # and a job that is no longer ours (it ended) is left alone
    assert not up.write(Finished(job_id, dispatch, "done", images=[image]))
    assert farm.job(job_id)["state"] == "failed"


def test_device_figures_for_cpu_and_gpu() -> None:
    from sdfarm.worker.heartbeat import cache_limits, device_figures

    gib = 1 << 30
    gpu = Device(1, "Vulkan1", "GPU", "gpu", 20 * gib, 24 * gib)
    cpu = Device(0, "CPU", "CPU", "cpu", 64 * gib, 64 * gib)
    figs = HostFigures((cpu, gpu), 30 * gib)
    cfg = hooks.WorkerConfig("redis://x", "h", gpu, "Vulkan1", [], figs)
    assert device_figures(cfg, 30 * gib, 4 * gib) == {
        "capacity": 20 * gib,
        "compute_figure": 16 * gib,
        "slow_figure": 46 * gib,
    }
    assert cache_limits(cfg) == (20 * gib, 50 * gib)
    cfg.memory_limit = 8 * gib
    assert device_figures(cfg, 30 * gib, 4 * gib)["slow_figure"] == 4 * gib
    assert cache_limits(cfg) == (8 * gib, None)
    cfg_cpu = hooks.WorkerConfig("redis://x", "h", cpu, "CPU", [], figs)
    assert device_figures(cfg_cpu, 30 * gib, 2 * gib) == {
        "capacity": 32 * gib,
        "compute_figure": 30 * gib,
        "slow_figure": 30 * gib,
    }


def test_device_pinning_and_sizes() -> None:
    from sdfarm.worker.main import parse_size, pin_environment

    assert parse_size("8GiB") == 8 << 30 and parse_size("512 MiB") == 512 << 20
    assert parse_size("1.5G") == 3 << 29 and parse_size("1000") == 1000
    cpu = Device(0, "CPU", "CPU", "cpu", 1, 1)
    vk = Device(1, "Vulkan1", "GPU", "gpu", 1, 2)
    cuda = Device(2, "CUDA1", "GPU", "gpu", 1, 2)
    figs = HostFigures((cpu, vk), 1)
    env: dict[str, str] = {}
    assert pin_environment(vk, figs, env) == "Vulkan1" and env == {"SD_VK_DEVICE": "1"}
    env = {}
    assert pin_environment(cpu, figs, env) == "CPU" and env == {"GGML_VK_VISIBLE_DEVICES": ""}
    env = {"CUDA_VISIBLE_DEVICES": "4,6"}
    assert pin_environment(cuda, HostFigures((cpu, cuda), 1), env) == "CUDA0"
    assert env == {"CUDA_VISIBLE_DEVICES": "6"}
