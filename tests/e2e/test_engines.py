"""Several engines on one device (`sdfarm worker --engines N`): a real local farm (redis-server,
the scheduler, one CPU worker with test hooks on) and the tiny model.

With two slots two jobs run at once (their claim-to-end windows overlap) and give the same
pixels as each other; with one they run one after the other. A job whose estimate does not
fit beside the running one's engine waits for it. Killing one slot's process costs only the
job it ran (re-placed once, then done); the other slot's job finishes untouched; a job that
kills two slots is failed as poison while the other slot's job finishes.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from sdfarm.client.farm import Farm, JobFailed
from sdfarm.store import JobSpec

pytestmark = pytest.mark.e2e

MODEL = "tiny-f16"
SMALL = {"width": 64, "height": 64, "steps": 1, "seed": 11}


@contextlib.contextmanager
def local_farm(models_dir: Path, host: str, *worker_args: str) -> Iterator[Any]:
    from sdfarm.localfarm.farm import LocalFarm

    farm = LocalFarm(
        [models_dir],
        devices=["CPU"],
        threads=1,
        host=host,
        announce=False,
        worker_args=list(worker_args),
        env={**os.environ, "SDFARM_TEST_HOOKS": "1"},
    )
    with farm:
        yield farm


def hooked(farm: Farm, hook: str, prompt: str = "a slow lighthouse") -> Any:
    spec = JobSpec(model=MODEL, params={"prompt": prompt, **SMALL}, test_hook=hook)
    return farm.submit_spec(spec)


def window(job: Any) -> tuple[float, float]:
    record = job.record()
    return float(record["started"]), float(record["ended"])


SERIAL = 0.5
"""The most two windows of one slot may overlap: a job's `ended` is written by the uploader
thread, beside the next job's claim."""


def overlap(a: Any, b: Any) -> float:
    (s1, e1), (s2, e2) = window(a), window(b)
    return min(e1, e2) - max(s1, s2)


def pixels(job: Any) -> bytes:
    image = Image.open(io.BytesIO(job.result(60).png))
    assert image.size == (64, 64)
    return image.convert("RGB").tobytes()


def wait_running(*jobs: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while any(j.state() != "running" for j in jobs):
        assert time.monotonic() < deadline, [j.record() for j in jobs]
        time.sleep(0.05)


@pytest.fixture(scope="module")
def two(models_dir: Path) -> Iterator[Any]:
    with local_farm(models_dir, "twoslots", "--engines", "2") as local:
        yield local


@pytest.fixture
def farm2(two: Any) -> Iterator[Farm]:
    with Farm(two.url, submitter="engines-tests") as f:
        yield f


def test_two_slots_run_two_jobs_at_once_with_the_same_pixels(farm2: Farm) -> None:
    a, b = hooked(farm2, "sleep:2"), hooked(farm2, "sleep:2")
    assert pixels(a) == pixels(b)
    assert overlap(a, b) > 1.0, (window(a), window(b))
    assert a.record()["worker"] != b.record()["worker"]  # two pool processes
    hb = farm2.status()["devices"][0]
    assert hb["slots"] == 2 and len(hb["incarnations"]) == 2
    # Each slot loaded its own engine; the heartbeat lists both against the one figure.
    assert [e["name"] for e in hb["loaded"]] == [MODEL, MODEL]
    assert sorted(e["slot"] for e in hb["loaded"]) == [0, 1]


def test_killing_one_slot_costs_only_its_job(farm2: Farm) -> None:
    a, b = hooked(farm2, "sleep:4", "slot a"), hooked(farm2, "sleep:4", "slot b")
    wait_running(a, b)
    before = farm2.status()["devices"][0]["incarnation"]
    victim = int(a.record()["worker"].rsplit(":", 1)[1])
    os.kill(victim, signal.SIGKILL)
    assert pixels(b) and pixels(a)
    ra, rb = a.record(), b.record()
    assert ra["state"] == rb["state"] == "done"
    assert ra.get("attempts") == "1", ra  # re-placed once
    assert rb.get("attempts", "0") in ("", "0"), rb
    assert "retried" not in [e["event"] for e in b.events()]
    reasons = [e.get("reason") for e in a.events() if e.get("reason")]
    assert "worker restarted" in reasons, a.events()
    # The device is the same worker: a replaced slot is not a restart.
    assert farm2.status()["devices"][0]["incarnation"] == before


def test_a_job_that_kills_two_slots_is_poison_and_the_other_slots_job_finishes(
    farm2: Farm,
) -> None:
    other = hooked(farm2, "sleep:3", "the other slot")
    wait_running(other)
    bad = hooked(farm2, "abort", "aborts its slot")
    with pytest.raises(JobFailed) as info:
        bad.result(60)
    assert info.value.error.startswith("poison:"), info.value.error
    assert pixels(other)
    assert other.record().get("attempts", "0") in ("", "0")
    assert farm2.submit(MODEL, "after the poison", **SMALL).result(60).png


def test_one_slot_runs_one_job_at_a_time(models_dir: Path) -> None:
    with (
        local_farm(models_dir, "oneslot", "--engines", "1") as local,
        Farm(local.url, submitter="engines-tests") as farm,
    ):
        a, b = hooked(farm, "sleep:1.5"), hooked(farm, "sleep:1.5")
        assert pixels(a) == pixels(b)
        assert overlap(a, b) < SERIAL, (window(a), window(b))


def test_a_job_that_does_not_fit_beside_the_running_one_waits(models_dir: Path) -> None:
    # Room for one engine of the tiny model, not two: the second job waits for the first.
    estimate = job_estimate_here(models_dir)
    limit = str(int(estimate * 1.5))
    with (
        local_farm(models_dir, "tightslots", "--engines", "2", "--memory-limit", limit) as local,
        Farm(local.url, submitter="engines-tests") as farm,
    ):
        a = hooked(farm, "sleep:2")
        wait_running(a)
        b = hooked(farm, "sleep:0")
        time.sleep(1.0)
        assert b.state() == "queued", b.record()  # not placed beside the running one
        assert pixels(a) == pixels(b)
        assert overlap(a, b) < SERIAL, (window(a), window(b))


def job_estimate_here(models_dir: Path) -> int:
    """The scheduler's estimate of one SMALL job of the tiny model on this host's CPU."""
    from sdfarm.native.catalog import Catalog
    from sdfarm.native.devices import choose_compute_device
    from sdfarm.native.estimate import job_estimate, model_facts
    from sdfarm.native.probe import read_host_figures

    device = choose_compute_device(read_host_figures(None), "cpu")
    facts = model_facts(Catalog([str(models_dir)]).load(MODEL), device)
    return job_estimate(facts, SMALL["width"], SMALL["height"])
