"""The webhook queue in the store, against a real redis-server: every way a job ends queues
its webhook in the same step (and a job without one queues nothing); only the leader takes;
a taken webhook is hidden for its lease and comes back after it when never settled (a
deliverer that died between send and settle: at least once); settling retries, delivers or
fails it with a job event; a webhook whose job expired is dropped."""

from __future__ import annotations

import time
from dataclasses import replace

from sdfarm.store import JobSpec, Store, keys
from sdfarm.store.records import new_dispatch_id

from helpers.leader import HELD, TOKEN

HOOK = "https://hooks.example.com/sdfarm"
SPEC = JobSpec(model="m", params={"prompt": "a cat"}, webhook=HOOK)


def submit(store: Store, spec: JobSpec = SPEC) -> str:
    job_id, _, _ = store.submit(spec, 100)
    assert job_id is not None
    return job_id


def run(store: Store, job_id: str) -> str:
    dispatch = new_dispatch_id()
    assert store.place(TOKEN, job_id, 5, "h/CPU", dispatch, 1, "loaded", (), HELD) == 1
    assert store.claim(job_id, dispatch, "inc", "w") is not None
    return dispatch


def webhook_events(store: Store, job_id: str) -> list[dict]:
    return [e for e in store.events(job_id) if e["event"] == "webhook"]


def test_every_ending_queues_the_webhook_once(store: Store) -> None:
    done = submit(store)
    assert store.finish(done, run(store, done), "h/CPU", "done", meta={}, pngs=[b"x"])
    failed = submit(store)
    assert store.finish(failed, run(store, failed), "h/CPU", "failed", error="boom")
    cancelled = submit(store)
    assert store.cancel(cancelled) == 1
    refused = submit(store)
    assert store.fail(TOKEN, refused, 5, "too large", [], 10**12) == 1
    overdue = submit(store)
    assert store.overdue(TOKEN, overdue, run(store, overdue), "h/CPU", "past its deadline") == 1
    poisoned = submit(store)
    for attempt in range(2):
        run(store, poisoned)
        rc = store.requeue(TOKEN, poisoned, store.record(poisoned), "h/CPU", reason="lost",
                           count=True, max_attempts=2, poison_error="poison")  # fmt: skip
        assert rc == 1 + attempt
    quiet = submit(store, replace(SPEC, webhook=""))
    assert store.cancel(quiet) == 1

    queued = store.webhooks_queued()
    assert set(queued) == {done, failed, cancelled, refused, overdue, poisoned}
    # A second ending of the same job is refused by its script, so nothing is queued twice.
    assert store.cancel(cancelled) == 0 and len(store.webhooks_queued()) == 6
    assert keys.farm_wide(keys.WEBHOOKS_KEY)
    now = float(store.r.time()[0])
    assert all(abs(t - now) < 5 for t in queued.values())  # due at once, on the Redis clock


def test_only_the_leader_takes_and_a_take_hides_it_for_its_lease(store: Store) -> None:
    job_id = submit(store)
    assert store.cancel(job_id) == 1
    assert store.take_webhooks("a-standby", 60, 10) == []
    assert store.take_webhooks(TOKEN, 60, 10) == [(job_id, 1)]
    assert store.take_webhooks(TOKEN, 60, 10) == []  # in flight: hidden
    assert store.settle_webhook(job_id, "retry", 0.0, tries=1, status=500, error="HTTP 500")
    assert store.take_webhooks(TOKEN, 60, 10) == [(job_id, 2)]
    assert store.settle_webhook(job_id, "delivered", tries=2, status=200)
    assert store.webhooks_queued() == {}
    assert store.record(job_id)["webhook_state"] == "delivered"
    events = webhook_events(store, job_id)
    assert [(e["outcome"], e["tries"]) for e in events] == [("retry", 1), ("delivered", 2)]
    assert not store.settle_webhook(job_id, "delivered")  # no longer queued: nothing happens


def test_a_webhook_never_settled_comes_back_after_its_lease(store: Store) -> None:
    job_id = submit(store)
    assert store.cancel(job_id) == 1
    assert store.take_webhooks(TOKEN, 0.3, 10) == [(job_id, 1)]
    assert store.take_webhooks(TOKEN, 0.3, 10) == []
    time.sleep(0.4)  # the deliverer "died" after sending: the next take sends it again
    assert store.take_webhooks(TOKEN, 0.3, 10) == [(job_id, 2)]


def test_the_last_failed_try_is_a_job_event_and_leaves_the_queue(store: Store) -> None:
    job_id = submit(store)
    assert store.cancel(job_id) == 1
    store.take_webhooks(TOKEN, 60, 10)
    assert store.settle_webhook(job_id, "failed", tries=5, error="HTTP 503")
    assert store.webhooks_queued() == {} and store.record(job_id)["webhook_state"] == "failed"
    assert webhook_events(store, job_id)[-1]["error"] == "HTTP 503"


def test_a_webhook_whose_job_expired_is_dropped(store: Store) -> None:
    job_id = submit(store)
    assert store.cancel(job_id) == 1
    store.r.delete(*keys.job_keys(job_id))
    assert store.take_webhooks(TOKEN, 60, 10) == []
    assert store.webhooks_queued() == {}
    assert not store.r.exists(keys.job_key(job_id))  # the take created no key without a TTL
