"""The store's transitions against a real redis-server: every key a job creates expires, on
every way a job can end; scheduler writes are fenced; stale claims claim nothing; a waiter
never strips the done token's TTL; the snapshot reads what placement needs in one script."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sdfarm.store import NOT_LEADER, JobSpec, QuotaExceededError, Store, keys, transport
from sdfarm.store.records import new_dispatch_id

from helpers.leader import HELD, TOKEN

SPEC = JobSpec(model="m", params={"prompt": "a cat", "width": 64, "height": 64})


def submit(store: Store, spec: JobSpec = SPEC) -> str:
    job_id, _, _ = store.submit(spec, 100)
    assert job_id is not None
    return job_id


def place(store: Store, job_id: str, device: str = "h/CPU") -> str:
    dispatch = new_dispatch_id()
    assert store.place(TOKEN, job_id, 5, device, dispatch, 123, "loaded", (), HELD) == 1
    return dispatch


def assert_all_keys_expire(store: Store, ceiling: int) -> None:
    """Every key in Redis has a TTL of at most `ceiling`, but the farm-wide ones (and the
    Celery lists of the transport, which Celery owns)."""
    held = transport.queue_name("nowhere/none")
    for raw in store.r.scan_iter(count=1000):
        name = raw.decode()
        ttl = store.r.ttl(name)
        if keys.farm_wide(name) or name == held:
            continue
        assert 0 < ttl <= ceiling, f"{name} has TTL {ttl}"


def test_a_finished_job_leaves_only_expiring_keys(store: Store) -> None:
    job_id = submit(store)
    assert set(store.ttls(job_id)) == {keys.job_key(job_id), keys.events_key(job_id)}
    assert_all_keys_expire(store, keys.JOB_TTL)
    dispatch = place(store, job_id)
    claim = store.claim(job_id, dispatch, "inc-1", "w1")
    assert claim is not None and claim.estimate == 123 and not claim.cancelled
    assert claim.tiling is None  # placed without a tiling plan
    assert not store.publish_progress(job_id, 1, 2, 0.5)
    assert store.finish(
        job_id, dispatch, "h/CPU", "done", meta={"a": 1}, records=[], pngs=[b"png-bytes"]
    )
    ttls = store.ttls(job_id)
    assert set(ttls) == {keys.key(k, job_id) for k in ("job", "events", "progress", "result",
                                                       "done")}  # fmt: skip
    assert all(0 < t <= keys.RESULT_TTL for t in ttls.values()), ttls
    assert_all_keys_expire(store, keys.JOB_TTL)
    # Waiting twice (two clients) sees the token and leaves it, TTL and all.
    assert store.wait(job_id, 1) and store.wait(job_id, 1)
    assert 0 < store.ttls(job_id)[keys.done_key(job_id)] <= keys.RESULT_TTL
    ended = store.ended(job_id)
    assert ended.state == "done" and ended.pngs == [b"png-bytes"] and ended.meta == {"a": 1}
    assert store.recent() == [job_id]


def test_previews_keep_one_event_in_the_list_and_go_at_the_finish(store: Store) -> None:
    job_id = submit(store)
    dispatch = place(store, job_id)
    assert store.claim(job_id, dispatch, "inc-1", "w1") is not None
    for seq in range(1, keys.EVENTS_CAP + 51):  # more previews than the list holds
        store.publish_preview(job_id, {"seq": seq, "step": seq, "image": "QUJD" * 100})
        if seq % 50 == 0:
            store.publish_progress(job_id, seq, 500, 0.1)
    events = store.events(job_id)
    kinds = [e["event"] for e in events]
    assert kinds[:3] == ["queued", "placed", "running"]  # nothing pushed out
    assert kinds.count("preview") == 1 and kinds.count("step") == 5
    (newest,) = [e for e in events if e["event"] == "preview"]
    assert newest["seq"] == keys.EVENTS_CAP + 50 and events[-2] == newest  # then its step
    assert store.preview(job_id) == newest
    assert store.previews_of([job_id, "0" * 32]) == [newest, None]
    assert 0 < store.ttls(job_id)[keys.preview_key(job_id)] <= keys.RESULT_TTL
    assert store.finish(job_id, dispatch, "h/CPU", "done", meta={}, records=[], pngs=[b"p"])
    assert store.preview(job_id) is None and keys.preview_key(job_id) not in store.ttls(job_id)
    assert [e["event"] for e in store.events(job_id)].count("preview") == 1  # history
    assert_all_keys_expire(store, keys.JOB_TTL)


def test_every_other_ending_expires_too(store: Store) -> None:
    queued = submit(store)
    assert store.cancel(queued) == 1  # cancelled while queued

    refused = submit(store)
    assert store.fail(TOKEN, refused, 5, "too large", [{"device": "h/CPU"}], 10**12) == 1

    running = submit(store)
    dispatch = place(store, running)
    assert store.claim(running, dispatch, "inc-1", "w1") is not None
    assert store.cancel(running) == 2  # a request for its worker
    assert store.publish_progress(running, 1, 4, 0.1)  # the worker sees it
    assert store.finish(running, dispatch, "h/CPU", "cancelled")

    poisoned = submit(store)
    for attempt in range(2):
        dispatch = place(store, poisoned)
        job = store.record(poisoned)
        assert store.claim(poisoned, dispatch, f"inc-{attempt}", "w") is not None
        job = store.record(poisoned)
        rc = store.requeue(TOKEN, poisoned, job, "h/CPU", reason="lost", count=True,
                           max_attempts=2, poison_error="poison: twice")  # fmt: skip
        assert rc == (1 if attempt == 0 else 2)

    states = {j: store.state(j) for j in (queued, refused, running, poisoned)}
    assert states == {queued: "cancelled", refused: "failed", running: "cancelled",
                      poisoned: "failed"}  # fmt: skip
    for job_id in states:
        ttls = store.ttls(job_id)
        assert keys.job_key(job_id) in ttls and keys.done_key(job_id) in ttls
        assert all(0 < t <= keys.RESULT_TTL for t in ttls.values()), (job_id, ttls)
    assert_all_keys_expire(store, keys.JOB_TTL)


def test_scheduler_writes_are_fenced_on_the_lease(store: Store) -> None:
    job_id = submit(store)
    other = "another-scheduler"
    assert store.place(other, job_id, 5, "h/CPU", "d", 1, "t", (), HELD) == NOT_LEADER
    assert store.fail(other, job_id, 5, "x", [], 1) == NOT_LEADER
    assert store.forget(other, "h/CPU", job_id, "d") == NOT_LEADER
    assert store.state(job_id) == "queued"
    assert store.release_lease(TOKEN) and store.lease_holder() is None
    assert store.place(TOKEN, job_id, 5, "h/CPU", "d", 1, "t", (), HELD) == NOT_LEADER


def test_a_stale_dispatch_claims_nothing(store: Store) -> None:
    job_id = submit(store)
    dispatch = place(store, job_id)
    assert store.claim(job_id, "old-dispatch", "inc", "w") is None
    assert store.state(job_id) == "placed"
    assert store.claim(job_id, dispatch, "inc", "w") is not None
    assert store.claim(job_id, dispatch, "inc", "w") is None  # a redelivered message
    assert not store.finish(job_id, "old-dispatch", "h/CPU", "done", meta={})


def test_a_full_queue_refuses_and_says_its_depth(store: Store) -> None:
    store.publish_config(queue_limit=2, backlog=2)
    submit(store)
    submit(store)
    job_id, depth, limit = store.submit(SPEC, 100)
    assert (job_id, depth, limit) == (None, 2, 2)


def test_snapshot_reads_heads_with_their_fields_and_clears_wake(store: Store) -> None:
    ids = [submit(store) for _ in range(6)]
    urgent = submit(store, JobSpec(model="u", params={"prompt": "now"}, priority=0))
    store.r.rpush(keys.pending_key(5), "no-record")
    reading = store.snapshot(heads=10, facts=2)
    assert reading.heads[5] == [*ids, "no-record"] and reading.heads[0] == [urgent]
    assert reading.head_fields[ids[0]][:2] == ["queued", "m"]
    assert ids[1] in reading.head_fields and ids[2] not in reading.head_fields  # first 2 only
    assert store.r.llen(keys.WAKE_KEY) == 7  # each submit nudged; not asked to clear
    store.snapshot(clear_wake=True)
    assert store.r.llen(keys.WAKE_KEY) == 0
    assert store.drop_stale("no-record", 5) == 1
    assert store.drop_stale(ids[0], 5) == 0  # still queued: kept


def test_a_retried_submit_queues_nothing_twice(store: Store) -> None:
    """A client whose submit reply was lost retries with the same id: one job, one entry."""
    first = store.submit(SPEC, 100, "retried-job-id")
    again = store.submit(SPEC, 100, "retried-job-id")
    assert first[0] == again[0] == "retried-job-id"
    assert store.queues()["pending"] == 1
    assert store.snapshot(heads=10).heads[5] == ["retried-job-id"]


def test_an_overdue_job_fails_and_its_worker_is_told_to_stop(store: Store) -> None:
    job_id = submit(store)
    dispatch = place(store, job_id)
    assert store.claim(job_id, dispatch, "inc", "w") is not None
    assert store.overdue("other", job_id, dispatch, "h/CPU", "late") == NOT_LEADER
    assert store.overdue(TOKEN, job_id, "old", "h/CPU", "late") == 0
    assert store.overdue(TOKEN, job_id, dispatch, "h/CPU", "deadline: late") == 1
    assert store.state(job_id) == "failed" and store.record(job_id)["error"] == "deadline: late"
    assert store.cancel_requested(job_id)
    assert job_id not in store.snapshot().running.get("h/CPU", {})
    assert not store.finish(job_id, dispatch, "h/CPU", "done", meta={})  # too late: refused
    state, placed, deadline, now = store.watch(job_id)
    assert (state, deadline) == ("failed", 3600.0) and placed is not None and now >= placed


def test_input_images_travel_with_the_job_and_expire_with_it(store: Store) -> None:
    images = {"init_image": b"\x89PNG fake", "mask_image": b"\x89PNG mask"}
    job_id, _, _ = store.submit(SPEC, 100, inputs=images)
    assert job_id is not None and store.inputs(job_id) == images
    assert 0 < store.ttls(job_id)[keys.input_key(job_id)] <= keys.JOB_TTL
    assert store.cancel(job_id) == 1
    assert 0 < store.ttls(job_id)[keys.input_key(job_id)] <= keys.RESULT_TTL
    plain = submit(store)
    assert store.inputs(plain) == {} and keys.input_key(plain) not in store.ttls(plain)
    dispatch = place(store, plain)
    assert store.claim(plain, dispatch, "inc", "w") is not None
    with_inputs, _, _ = store.submit(SPEC, 100, inputs=images)
    dispatch = place(store, with_inputs)
    assert store.claim(with_inputs, dispatch, "inc", "w") is not None
    assert store.finish(with_inputs, dispatch, "h/CPU", "done", meta={}, pngs=[b"x"])
    assert 0 < store.ttls(with_inputs)[keys.input_key(with_inputs)] <= keys.RESULT_TTL


def test_an_owner_at_its_quota_is_refused_until_a_job_ends(store: Store) -> None:
    """The live-jobs quota: counted per owner in one script, ended (or expired) jobs pruned
    at the next submit, a retry of an admitted job still idempotent, the set expiring."""
    mine, theirs = replace(SPEC, owner="owner-a"), replace(SPEC, owner="owner-b")
    first, _, _ = store.submit(mine, 100, quota=2)
    second, _, _ = store.submit(mine, 100, quota=2)
    assert first and second
    before = store.queues()["pending"]
    with pytest.raises(QuotaExceededError) as info:
        store.submit(mine, 100, quota=2)
    assert (info.value.live, info.value.quota) == (2, 2)
    assert store.queues()["pending"] == before  # nothing queued
    assert store.submit(mine, 100, second, quota=2)[0] == second  # a retry: no refusal
    assert store.submit(theirs, 100, quota=2)[0]  # another owner: its own count
    assert store.submit(SPEC, 100, quota=1)[0]  # no owner: no quota
    assert store.cancel(first) == 1
    third, _, _ = store.submit(mine, 100, quota=2)  # the cancelled job no longer counts
    assert third
    store.r.delete(keys.job_key(second))  # a record that expired counts no more either
    assert store.submit(mine, 100, quota=2)[0]
    owned = [m.decode() for m in store.r.zrange(keys.owned_key("owner-a"), 0, -1)]
    assert first not in owned and second not in owned and third in owned
    assert 0 < store.r.ttl(keys.owned_key("owner-a")) <= keys.JOB_TTL


def test_the_tiling_plan_travels_from_placement_to_the_claim(store: Store) -> None:
    job_id = submit(store)
    plan = {"tiled": True, "estimate": 456, "warning": "decoded in tiles: ..."}
    dispatch = new_dispatch_id()
    assert store.place(TOKEN, job_id, 5, "h/CPU", dispatch, 456, "fits", (), HELD, plan) == 1
    assert store.record(job_id)["estimate"] == "456"
    (placed,) = [e for e in store.events(job_id) if e["event"] == "placed"]
    assert placed["tiled"] is True
    claim = store.claim(job_id, dispatch, "inc", "w")
    assert claim is not None and claim.tiling == plan and claim.estimate == 456


def test_heartbeat_catalogs_are_stored_once_and_read_back_in_place(store: Store) -> None:
    """Two devices of one catalog share one `facts:{digest}` key; every read puts `models`
    and `loras` back; a snapshot reuses an unchanged heartbeat and shares the catalog."""
    catalog = {"models": {"m": {"bytes": 5, "native_size": [64, 64]}}, "loras": {"l": 3}}
    for name in ("a", "b"):
        store.beat(f"{name}/CPU", {"host": name, "state": "idle", **catalog}, 5.0)
    facts = list(store.r.keys("sdfarm:facts:*"))
    assert len(facts) == 1 and 0 < store.r.pttl(facts[0]) <= 5000
    assert b"models" not in store.r.get(keys.heartbeat_key("a/CPU"))  # only its digest
    assert store.heartbeat("a/CPU") == {"host": "a", "state": "idle", **catalog}
    assert store.heartbeats()["b/CPU"]["loras"] == {"l": 3}
    first = store.snapshot()
    assert first.heartbeats["a/CPU"] == {"host": "a", "state": "idle", **catalog}
    assert first.heartbeats["a/CPU"]["models"] is first.heartbeats["b/CPU"]["models"]
    second = store.snapshot()
    assert second.heartbeats["a/CPU"] is first.heartbeats["a/CPU"]  # unchanged: not parsed
    store.beat("a/CPU", {"host": "a", "state": "busy", **catalog}, 5.0)
    third = store.snapshot()
    assert third.heartbeats["a/CPU"]["state"] == "busy"
    assert third.heartbeats["b/CPU"] is first.heartbeats["b/CPU"]
    store.beat("c/CPU", {"host": "c"}, 5.0)  # no catalog: stored whole
    assert store.heartbeat("c/CPU") == {"host": "c"}


def test_a_heartbeat_whose_catalog_expired_lists_no_models(store: Store) -> None:
    store.beat("a/CPU", {"host": "a", "models": {"m": {}}, "loras": {}}, 5.0)
    for k in store.r.keys("sdfarm:facts:*"):
        store.r.delete(k)
    assert store.snapshot().heartbeats["a/CPU"]["models"] == {}  # no worker-less model placed
    store.beat("a/CPU", {"host": "a", "models": {"m": {}}, "loras": {}}, 5.0)
    assert store.snapshot().heartbeats["a/CPU"]["models"] == {"m": {}}


def test_place_many_places_each_in_order_and_is_fenced(store: Store) -> None:
    from sdfarm.store import Placement

    ids = [submit(store) for _ in range(3)]
    store.cancel(ids[1])
    sends = [Placement(j, 5, "h/CPU", new_dispatch_id(), 7, "fits", (), HELD) for j in ids]
    assert store.place_many(TOKEN, sends) == [1, 0, 1]
    assert [store.state(j) for j in ids] == ["placed", "cancelled", "placed"]
    assert store.record(ids[0])["dispatch"] == sends[0].dispatch
    assert store.r.llen(HELD[0]) == 2 and store.place_many(TOKEN, []) == []
    other = submit(store)
    assert store.place_many("other", [replace(sends[0], job_id=other)]) == [NOT_LEADER]
    assert store.state(other) == "queued"
