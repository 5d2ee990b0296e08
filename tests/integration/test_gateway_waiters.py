"""Many generation requests waiting at once on a real local farm (redis-server, scheduler, one
CPU worker with the tiny model, test hooks on): the gateway awaits each job on its event loop,
so all of them are submitted and waiting together (a thread per waiter would cap that at the
threadpool's 40), /healthz keeps answering meanwhile, and each gets its own image once the
worker is free."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sdfarm.client.farm import Farm, JobCancelled
from sdfarm.store import JobSpec

from helpers.gateway import cpu_farm, served_gateway

MODEL = "tiny-q8_0"
TOKEN = "waiters-test-token"
WAITERS = 100
SMALL = {"size": "64x64", "steps": 1}
PNG = b"\x89PNG\r\n\x1a\n"
LIVE = ("queued", "placed", "running")


@pytest.fixture(scope="module")
def local_farm(models_dir: Path) -> Iterator[Any]:
    with cpu_farm(models_dir, "waitershost", test_hooks=True) as farm:
        yield farm


def _live(farm: Farm) -> int:
    counts = farm.store.count_by_state()
    return sum(counts.get(s, 0) for s in LIVE)


async def _ask(http: httpx.AsyncClient, k: int) -> tuple[int, dict[str, Any]]:
    """Half through the OpenAI route, half through A1111's: (seed asked, the answer)."""
    seed = 1000 + k
    if k % 2:
        body = {"prompt": f"waiter {k}", "seed": seed, "width": 64, "height": 64, "steps": 1,
                "override_settings": {"sd_model_checkpoint": MODEL}}  # fmt: skip
        r = await http.post("/sdapi/v1/txt2img", json=body)
    else:
        body = {"model": MODEL, "prompt": f"waiter {k}", "seed": seed, **SMALL}
        r = await http.post("/v1/images/generations", json={**body, "response_format": "b64_json"})
    assert r.status_code == 200, r.text[:300]
    return seed, r.json()


def test_many_waiting_requests_all_get_their_images(local_farm: Any) -> None:
    with (
        served_gateway(local_farm.url, [TOKEN], 300.0) as url,
        Farm(local_farm.url, submitter="waiters-tests") as farm,
    ):
        # One long job holds the only worker, so every request below waits behind it.
        params = {"prompt": "blocker", "negative_prompt": "", "seed": 1, "width": 64,
                  "height": 64, "steps": 1}  # fmt: skip
        blocker = farm.submit_spec(JobSpec(model=MODEL, params=params, test_hook="sleep:600"))
        deadline = time.monotonic() + 60
        while blocker.state() != "running":
            assert time.monotonic() < deadline, "the blocker never ran"
            time.sleep(0.05)

        async def run() -> tuple[list[tuple[int, dict[str, Any]]], list[float], int]:
            limits = httpx.Limits(max_connections=WAITERS + 10)
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with (
                httpx.AsyncClient(base_url=url, headers=auth, limits=limits, timeout=300) as http,
                httpx.AsyncClient(base_url=url, timeout=10) as probe,
            ):
                tasks = [asyncio.create_task(_ask(http, k)) for k in range(WAITERS)]
                health: list[float] = []
                seen = 0
                until = time.monotonic() + 120
                while seen < WAITERS + 1 and time.monotonic() < until:
                    t = time.perf_counter()
                    r = await probe.get("/healthz")
                    health.append(time.perf_counter() - t)
                    assert r.status_code == 200 and r.json() == {"ok": True}
                    seen = await asyncio.to_thread(_live, farm)
                    await asyncio.sleep(0.05)
                assert not any(t.done() for t in tasks)  # nobody answered: all are waiting
                # Every request's job is in the farm at once, with the blocker.
                assert seen == WAITERS + 1
                await asyncio.to_thread(blocker.cancel)
                answers = await asyncio.gather(*tasks)
            return answers, health, seen

        answers, health, _ = asyncio.run(run())
        with pytest.raises(JobCancelled):
            blocker.result(10)

    assert len(answers) == WAITERS
    for seed, doc in answers:
        if "images" in doc:  # A1111
            assert len(doc["images"]) == 1
            assert base64.b64decode(doc["images"][0]).startswith(PNG)
            assert json.loads(doc["info"])["seed"] == seed
        else:
            assert len(doc["data"]) == 1
            assert base64.b64decode(doc["data"][0]["b64_json"]).startswith(PNG)
    # A sanity bound only (the figures are bench/gateway_waiters.py's): the event loop was
    # never stuck behind the waiters.
    assert health and max(health) < 5.0
