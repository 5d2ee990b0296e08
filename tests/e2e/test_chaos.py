"""Chaos: a 140-job batch on `sdfarm up` while the test kill -9s the worker's pool process,
its Celery main process, the leading scheduler and the redis-server, 12 times in all. Every
image arrives, each job ran to completion once, nothing failed; the time each part took to
come back is printed.

A job that kills two workers fails as poison by design, so the test never kills a worker (or
Redis) while it runs a job an earlier kill already cost a run: it stops the pool process,
reads the job records, and kills only if the running job was never re-placed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sdfarm.localfarm.state import read_state
from sdfarm.store import Store

pytestmark = pytest.mark.e2e

JOBS = 140
"""Enough to outlast the kills with room (the test fails if the batch ends first): on the 2-core
VM the twelfth kill came 44-47 s in, with 60-81 images written in six runs; the jobs after it
(4-5 a second there) only lengthened the test. It prints how many there were."""
KILLS = ("pool", "main", "scheduler", "redis") * 3
EVERY_S = 2.0
DEVICE = "chaoshost/CPU"


def sdfarm(*args: str, env: dict[str, str], **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sdfarm.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kw,
    )


class Chaos:
    def __init__(self, state_file: Path) -> None:
        self.state_file = state_file
        self.url = read_state(state_file).redis_url
        self.rows: list[dict[str, Any]] = []

    def pids(self) -> dict[str, int]:
        state = read_state(self.state_file)
        return {role: int(p[0]) for role, p in state.pids.items()} if state else {}

    def store(self) -> Store:
        return Store.connect(self.url, socket_timeout=2, socket_connect_timeout=2)

    def heartbeat(self) -> dict[str, Any] | None:
        try:
            store = self.store()
            try:
                return store.heartbeat(DEVICE)
            finally:
                store.close()
        except Exception:  # noqa: BLE001 - Redis may be down right now
            return None

    def leader_pid(self) -> int | None:
        try:
            store = self.store()
            try:
                holder = store.lease_holder()
            finally:
                store.close()
        except Exception:  # noqa: BLE001
            return None
        return int(holder.split(":")[1]) if holder else None

    def kill(self, target: str) -> None:
        t0 = time.monotonic()
        if target in ("pool", "main"):
            hb = self.wait_for(self.frozen_on_a_fresh_job, "the worker to run a fresh job", 60)
            pid = hb["pid"] if target == "pool" else self.pids()["worker:CPU"]
            before = hb["incarnation"]
            os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(hb["pid"], signal.SIGCONT)  # the pool, if it lives on, sees it alone
            killed = time.monotonic()

            def back() -> bool:
                now = self.heartbeat()
                return bool(now) and now["incarnation"] != before and now["pid"] != hb["pid"]
        elif target == "scheduler":
            pid = self.wait_for(lambda: self.leader_pid(), "a leader")
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()

            def back() -> bool:
                leader = self.leader_pid()
                return leader is not None and leader != pid
        else:
            self.wait_for(lambda: self.running_fresh() is not False, "no lost job running", 60)
            pid = self.pids()["redis"]
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()

            def back() -> bool:
                new = self.pids().get("redis")
                if new in (None, pid):
                    return False
                try:
                    store = self.store()
                    try:
                        return store.ping()
                    finally:
                        store.close()
                except Exception:  # noqa: BLE001
                    return False

        self.wait_for(back, f"{target} to come back", timeout=60)
        recovered = time.monotonic() - killed
        self.rows.append({"target": target, "pid": pid, "recovery_s": round(recovered, 2),
                          "waited_s": round(killed - t0, 2)})  # fmt: skip

    def running_fresh(self) -> bool | None:
        """Whether the job the worker runs now was never lost by a kill (None: it runs
        nothing); read from the job records, which, unlike a heartbeat, are never stale."""
        try:
            store = self.store()
            try:
                reading = store.snapshot()
                running = [
                    j
                    for j in reading.running.get(DEVICE, {})
                    if reading.jobs.get(j, {}).get("state") == "running"
                ]
                if not running:
                    return None
                return not any(e["event"] == "retried" for j in running for e in store.events(j))
            finally:
                store.close()
        except Exception:  # noqa: BLE001 - Redis may be down right now
            return None

    def frozen_on_a_fresh_job(self) -> dict[str, Any] | None:
        """The worker's pool process stopped (SIGSTOP) while it runs a job no kill has cost a
        run yet, and its heartbeat; None (the pool let go again) otherwise. Stopped, it cannot
        move on to the next job between this check and the kill that follows."""
        hb = self.heartbeat()
        if not hb:
            return None
        try:
            os.kill(hb["pid"], signal.SIGSTOP)
        except ProcessLookupError:
            return None
        if self.running_fresh():
            return hb
        os.kill(hb["pid"], signal.SIGCONT)
        time.sleep(0.05)
        return None

    @staticmethod
    def wait_for(check: Any, what: str, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)


def test_a_batch_survives_twelve_kills(models_dir: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SDFARM_REDIS_URL"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    up = sdfarm("up", "--models", str(models_dir), "--device", "CPU", "--host", "chaoshost",
                "--threads", "1", "--json", env=env)  # fmt: skip
    try:
        line = up.stdout.readline()  # type: ignore[union-attr]
        assert line, f"`sdfarm up` did not start: {up.stderr.read()}"  # type: ignore[union-attr]
        chaos = Chaos(Path(json.loads(line)["state_file"]))
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("".join(f"chaos prompt {i}\n" for i in range(JOBS)))
        out = tmp_path / "out"
        batch = sdfarm("batch", str(prompts), "--out", str(out), "--model", "tiny-q8_0",
                       "--width", "64", "--height", "64", "--steps", "2", "--quiet", "--json",
                       env=env)  # fmt: skip
        started = time.monotonic()
        for target in KILLS:
            time.sleep(EVERY_S)
            assert batch.poll() is None, "the batch ended before the kills did"
            chaos.kill(target)
        kills_s = time.monotonic() - started
        at_last_kill = len(list(out.glob("*.png")))  # the room JOBS leaves, printed below
        stdout, stderr = batch.communicate(timeout=600)
        summary = json.loads(stdout)
        pngs = sorted(out.glob("*.png"))
        jobs = [json.loads(p.with_suffix(".json").read_text())["job"] for p in pngs]
        store = chaos.store()
        try:
            finished = Counter(
                e["event"] for j in jobs for e in store.events(j) if e["event"] in ("done",
                                                                                   "failed")
            )  # fmt: skip
            retried = sum(1 for j in jobs for e in store.events(j) if e["event"] == "retried")
        finally:
            store.close()
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()

    print(f"\n{'kill':>4} {'target':<10} {'pid':>8} {'recovery s':>11}")
    for i, row in enumerate(chaos.rows, 1):
        print(f"{i:>4} {row['target']:<10} {row['pid']:>8} {row['recovery_s']:>11.2f}")
    print(f"{JOBS} images ({at_last_kill} when the kills ended, {kills_s:.0f} s in), "
          f"{len(set(jobs))} jobs, {retried} re-placed after a kill")  # fmt: skip
    assert len(chaos.rows) == len(KILLS) >= 10
    assert batch.returncode == 0, (summary.get("failures"), summary.get("error"), stderr[-3000:])
    assert (summary["done"], summary["failed"], summary["submitted"]) == (JOBS, 0, JOBS)
    assert len(pngs) == JOBS and len(set(jobs)) == JOBS  # one job per image, none twice
    assert finished == {"done": JOBS}  # each job ended once, done
