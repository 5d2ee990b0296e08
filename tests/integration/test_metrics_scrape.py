"""A gateway scrape costs the same Redis work whatever the number of finished jobs: the Redis
commands one `/metrics` exposition sends (INFO commandstats) are the same with 20 finished
jobs as with 400, and the series it exports are the same."""

from __future__ import annotations

import redis
from prometheus_client import generate_latest

from sdfarm.client.farm import Farm
from sdfarm.gateway.metrics import gateway_registry
from sdfarm.store import JobSpec, Store, transport
from sdfarm.store.records import new_dispatch_id

TOKEN = "leader"


def finish_jobs(store: Store, start: int, stop: int) -> None:
    """Jobs end through the real transitions, over two models and two devices."""
    for i in range(start, stop):
        device = f"h/CPU{i % 2}"
        spec = JobSpec(model=f"m{i % 2}", params={"prompt": "p", "width": 64, "height": 64})
        job_id, _, _ = store.submit(spec, 10**6)
        assert job_id is not None
        dispatch = new_dispatch_id()
        held = (transport.queue_name(device), "{}")
        assert store.place(TOKEN, job_id, 5, device, dispatch, 1, "loaded", (), held) == 1
        assert store.claim(job_id, dispatch, "inc", "w") is not None
        assert store.finish(job_id, dispatch, device, "done", meta={}, generate_s=0.3)


def commands(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name: int(v["calls"]) for name, v in stats.items()}


def scrape_cost(client: redis.Redis, registry) -> tuple[int, set[str]]:
    """(Redis commands one scrape sent, the sample names and labels it exported)."""
    before = commands(client)
    text = generate_latest(registry).decode()
    after = commands(client)
    # The INFO call that read `before` is counted in `after`: leave it out.
    sent = sum(after.values()) - sum(before.values()) - 1
    series = {line.split(" ")[0] for line in text.splitlines() if line.startswith("sdfarm_")}
    return sent, series


def test_a_scrape_sends_the_same_commands_for_20_or_400_finished_jobs(redis_url: str) -> None:
    farm = Farm(redis_url)
    try:
        store = farm.store
        assert store.take_lease(TOKEN, 60_000)
        registry = gateway_registry(farm)
        finish_jobs(store, 0, 20)
        generate_latest(registry)  # scripts and connections warm
        small, small_series = scrape_cost(store.r, registry)
        finish_jobs(store, 20, 400)
        large, large_series = scrape_cost(store.r, registry)
        assert small == large and small < 20, (small, large)  # the old scan: 1 per job
        # The same series, only their values moved.
        assert {s.split("{")[0] for s in small_series} == {s.split("{")[0] for s in large_series}
        assert 'sdfarm_jobs_done_total{device="h/CPU1",model="m1"}' in large_series
    finally:
        farm.close()


def test_with_redis_away_the_gateway_still_answers_and_says_so() -> None:
    from fastapi.testclient import TestClient

    from sdfarm.gateway import create_app

    from helpers.gateway import free_port

    app = create_app(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    with TestClient(app, base_url="http://localhost") as http:
        assert http.get("/metrics").status_code == 200
        resp = http.get("/metrics")  # the first request is counted once it has answered
    assert resp.status_code == 200
    text = resp.text
    assert "\nsdfarm_redis_up 0.0\n" in text
    assert 'sdfarm_gateway_requests_total{method="GET",route="/metrics",status="200"} 1.0' in text
    assert "sdfarm_jobs_done_total" not in text and "process_cpu_seconds_total" in text
    app.state.farm.close()
