"""The farm's counters and histograms against a real redis-server: every transition that ends,
submits or requeues a job counts it in the same script, by model and device; a transition
that finds the job moved on counts nothing; a new model past the series cap is `_other`."""

from __future__ import annotations

import pytest

from sdfarm.store import JobSpec, Store, keys
from sdfarm.store.metrics import OTHER_MODEL, read_farm_metrics
from sdfarm.store.records import new_dispatch_id

from helpers.leader import HELD, TOKEN

DEV = "h/CPU"


def submit(store: Store, model: str = "m") -> str:
    spec = JobSpec(model=model, params={"prompt": "a cat", "width": 64, "height": 64})
    job_id, _, _ = store.submit(spec, 1000)
    assert job_id is not None
    return job_id


def run(store: Store, job_id: str, device: str = DEV) -> str:
    dispatch = new_dispatch_id()
    assert store.place(TOKEN, job_id, 5, device, dispatch, 1, "loaded", (), HELD) == 1
    assert store.claim(job_id, dispatch, "inc", "w") is not None
    return dispatch


def test_every_ending_is_counted_once_by_model_and_device(store: Store) -> None:
    done = submit(store)
    d = run(store, done)
    assert store.finish(done, d, DEV, "done", meta={}, load_s=1.5, generate_s=0.2)
    # A retried finish finds the job ended: nothing is counted twice.
    assert not store.finish(done, d, DEV, "done", meta={}, load_s=1.5, generate_s=0.2)

    queued = submit(store, "n")
    assert store.cancel(queued) == 1
    assert store.cancel(queued) == 0
    refused = submit(store, "n")
    assert store.fail(TOKEN, refused, 5, "too large", [], 10**12) == 1
    late = submit(store)
    d = run(store, late, "h/GPU0")
    assert store.overdue(TOKEN, late, d, "h/GPU0", "deadline") == 1

    poisoned = submit(store)
    for attempt in range(2):
        d = run(store, poisoned)
        rc = store.requeue(TOKEN, poisoned, store.record(poisoned), DEV, reason="lost",
                           count=True, max_attempts=2, poison_error="poison")  # fmt: skip
        assert rc == (1 if attempt == 0 else 2)

    m = read_farm_metrics(store.r)
    assert m.jobs == {
        ("submitted", "m", ""): 3,
        ("submitted", "n", ""): 2,
        ("done", "m", DEV): 1,
        ("cancelled", "n", ""): 1,
        ("failed", "n", ""): 1,
        ("failed", "m", "h/GPU0"): 1,
        ("failed", "m", DEV): 1,
        ("requeued", "m", DEV): 1,
    }
    # Queue wait: one per claim (the poisoned job was claimed twice).
    assert m.seconds[("queue_wait", "m", DEV)].count == 3
    assert m.seconds[("queue_wait", "m", "h/GPU0")].count == 1
    load = m.seconds[("load", "m", DEV)]
    assert load.count == 1 and load.total == pytest.approx(1.5)
    assert dict(load.buckets)["1.0"] == 0 and dict(load.buckets)["2.5"] == 1
    assert m.seconds[("generate", "m", DEV)].count == 1
    ends = {s: h.count for s, h in m.seconds.items() if s[0] == "end_to_end"}
    assert ends == {
        ("end_to_end", "m", DEV): 2,
        ("end_to_end", "n", ""): 2,
        ("end_to_end", "m", "h/GPU0"): 1,
    }
    # A job that loaded nothing observes no load.
    warm = submit(store)
    d = run(store, warm)
    assert store.finish(warm, d, DEV, "done", meta={}, generate_s=0.1)
    m = read_farm_metrics(store.r)
    assert m.seconds[("load", "m", DEV)].count == 1
    assert m.seconds[("generate", "m", DEV)].count == 2


def test_a_new_model_past_the_cap_is_counted_as_other(store: Store) -> None:
    # Fill the counters hash to its cap with series of other models (as the script would).
    store.r.hset(
        keys.METRICS_JOBS_KEY,
        mapping={f"submitted|x{i}|": 1 for i in range(keys.METRICS_SERIES_CAP)},
    )
    submit(store, "known")
    submit(store, "x7")  # an existing series keeps counting under its own name
    m = read_farm_metrics(store.r)
    assert m.jobs[("submitted", OTHER_MODEL, "")] == 1
    assert m.jobs[("submitted", "x7", "")] == 2
    assert ("submitted", "known", "") not in m.jobs
