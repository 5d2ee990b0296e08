"""The client (`Farm`, `Job`, `Result`, `map`) against a real local farm: redis-server, the
scheduler service and one CPU worker running the tiny model (sdfarm.localfarm.farm),
shared by the module; tests that need a farm without a scheduler use `redis_url`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sdfarm.client.farm import (
    Farm,
    JobCancelled,
    JobFailed,
    UnknownModelError,
)
from sdfarm.native.errors import InvalidParameterError
from sdfarm.store import JobSpec

from helpers.gateway import cpu_farm

F16 = "tiny-f16"
SMALL = {"width": 64, "height": 64, "steps": 1}
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def local_farm(models_dir: Path) -> Iterator[Any]:
    with cpu_farm(models_dir, "clienthost", test_hooks=True) as farm:
        yield farm


@pytest.fixture
def farm(local_farm: Any) -> Iterator[Farm]:
    with Farm(local_farm.url, submitter="client-tests") as f:
        yield f


def test_bad_parameters_fail_before_anything_is_queued(farm: Farm) -> None:
    bad: list[dict[str, Any]] = [
        {"width": 65},
        {"steps": 0},
        {"sampler": "nope"},
        {"priority": 12},
        {"log_level": "loud"},
    ]
    before = farm.store.count_by_state()
    for kwargs in bad:
        with pytest.raises(InvalidParameterError):
            farm.submit(F16, "x", **{**SMALL, **kwargs})
    assert farm.store.queues()["pending"] == 0
    assert farm.store.count_by_state() == before


def test_unknown_model_names_what_the_farm_has(farm: Farm) -> None:
    with pytest.raises(UnknownModelError) as info:
        farm.submit("no-such-model", "x", **SMALL)
    assert info.value.available == ["tiny-f16", "tiny-q8_0"]
    assert "tiny-q8_0" in str(info.value)


def test_result_has_images_metadata_and_records(farm: Farm, tmp_path: Path) -> None:
    job = farm.submit(F16, "a red boat", seed=7, batch_count=2, log_level="info", **SMALL)
    result = job.result(TIMEOUT)
    assert job.state() == "done"
    assert len(result.pngs) == 2 and result.png == result.pngs[0]
    assert result.png.startswith(b"\x89PNG")
    assert result.image.size == (64, 64)
    assert result.metadata["model"] == F16
    assert result.metadata["host"] == "clienthost"
    assert result.metadata["seed"] == 7
    assert result.records and all("message" in r for r in result.records)
    written = result.save(tmp_path / "boat.png")
    assert [p.name for p in written] == ["boat.png", "boat-1.png"]
    assert written[1].read_bytes() == result.pngs[1]
    kinds = [e["event"] for e in job.events()]
    assert kinds[:3] == ["queued", "placed", "running"] and kinds[-1] == "done"
    progress = job.progress()
    assert progress is not None and progress["steps"] >= 1


def test_waiting_adds_almost_no_latency(farm: Farm) -> None:
    farm.submit(F16, "warm", **SMALL).result(TIMEOUT)
    lags = []
    for i in range(5):
        job = farm.submit(F16, f"lag {i}", **SMALL)
        job.result(TIMEOUT)
        lags.append(time.time() - float(job.record()["ended"]))
    assert sorted(lags)[2] < 0.05, lags  # median: BLPOP wakes on the done token


def test_queued_job_times_out_and_cancels(redis_url: str) -> None:
    with Farm(redis_url) as farm:  # no scheduler, no workers: the job stays queued
        job = farm.submit(F16, "never placed", **SMALL)
        assert job.state() == "queued"
        with pytest.raises(TimeoutError):
            job.result(timeout=0.2)
        assert job.cancel()
        assert job.state() == "cancelled"
        assert not job.cancel()  # already final
        with pytest.raises(JobCancelled):
            job.result(1)
        queues = farm.store.queues()
        assert queues["pending"] == 0 and queues["queues"][5] == 0


def test_cancel_a_running_job(farm: Farm) -> None:
    params = {"prompt": "slow", "negative_prompt": "", "seed": 1, **SMALL}
    job = farm.submit_spec(JobSpec(model=F16, params=params, test_hook="sleep:3"))
    deadline = time.monotonic() + TIMEOUT
    while job.state() != "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert job.cancel()
    with pytest.raises(JobCancelled):
        job.result(TIMEOUT)
    # The farm goes on (the worker replaced its process).
    assert farm.submit(F16, "after cancel", **SMALL).result(TIMEOUT).png


def test_map_yields_in_order(farm: Farm) -> None:
    items = [{"prompt": f"item {i}", "seed": 100 + i} for i in range(8)]
    seeds = [r.metadata["seed"] for r in farm.map(items, model=F16, window=3, **SMALL)]
    assert seeds == [100 + i for i in range(8)]
    texts = [r.metadata["prompt"] for r in farm.map(["a", "b", "c"], model=F16, **SMALL)]
    assert texts == ["a", "b", "c"]


def test_map_raises_the_first_failure(farm: Farm) -> None:
    items: list[Any] = ["fine", {"prompt": "too big", "width": 4096, "height": 4096}, "never"]
    results = farm.map(items, model=F16, window=1, **{**SMALL, "width": 64})
    assert next(results).png
    with pytest.raises(JobFailed) as info:
        next(results)
    assert "needs an estimated" in info.value.error
    assert info.value.figures and info.value.estimate


def test_status_and_models(farm: Farm) -> None:
    status = farm.status()
    (device,) = status["devices"]
    assert device["key"] == "clienthost/CPU" and device["alive"]
    assert device["figure"] <= 4 * 1024**3  # the worker's --memory-limit
    assert status["leader"]
    assert status["config"]["queue_limit"] == "10000"
    assert set(status["queues"]) == set(range(10))
    models = {m["name"]: m for m in farm.models()}
    assert set(models) == {"tiny-f16", "tiny-q8_0"}
    assert models[F16]["devices"] == ["clienthost/CPU"]
    assert models[F16]["bytes"] > 0
