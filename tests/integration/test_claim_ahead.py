"""A job claimed ahead (store/lua/claim_ahead.lua: the worker's lookahead claims the next job
during the image before it) against a real redis-server: it counts as a run only once it
began, the slot's next process settles it from the start mark, a stopping worker gives it
back, and the scheduler re-places a lost one without an attempt unless it began."""

from __future__ import annotations

from sdfarm.scheduler.dispatch import DispatchConfig, Dispatcher
from sdfarm.store import JobSpec, Store, keys, transport
from sdfarm.store.records import Began, new_dispatch_id

from helpers.leader import HELD, TOKEN

DEVICE = "h/CPU"
DEAD, LIVE = "inc-dead", "inc-live"


def placed_job(store: Store, prompt: str = "a cat") -> tuple[str, str]:
    job_id, _, _ = store.submit(JobSpec(model="m", params={"prompt": prompt}), 100)
    assert job_id is not None
    dispatch = new_dispatch_id()
    assert store.place(TOKEN, job_id, 5, DEVICE, dispatch, 123, "loaded", (), HELD) == 1
    return job_id, dispatch


def taken(store: Store, job_id: str, dispatch: str) -> transport.Message:
    """The job's message, as the lookahead takes it from the device's queue (slot 0). (The
    placement pushed one already; the test pushes its own, in Celery's layout.)"""
    (first,) = transport.queue_lists(DEVICE)[:1]
    store.r.delete(*transport.queue_lists(DEVICE))
    url = "redis://{host}:{port}/{db}".format(**store.r.connection_pool.connection_kwargs)
    outbox = transport.CeleryOutbox(store.r, transport.make_app(url))
    store.r.lpush(first, outbox.message(job_id, dispatch, DEVICE)[1])
    message = store.next_message(DEVICE)
    assert message is not None and message.job_id == job_id
    return message


def test_claimed_ahead_is_running_but_not_begun_until_its_start(store: Store) -> None:
    job_id, dispatch = placed_job(store)
    claim = store.claim_ahead(job_id, dispatch, DEAD, "w1", DEVICE)
    assert claim is not None and claim.estimate == 123 and not claim.cancelled
    rec = store.record(job_id)
    assert rec["state"] == "running" and rec["ahead"] and rec["incarnation"] == DEAD
    assert not rec.get("started")
    assert "running" not in [e["event"] for e in store.events(job_id)]
    # another process cannot claim it; this one may claim it again (a reply it did not hear)
    assert store.claim_ahead(job_id, dispatch, LIVE, "w2", DEVICE) is None
    assert store.claim(job_id, dispatch, LIVE, "w2") is None
    assert store.claim_ahead(job_id, dispatch, DEAD, "w1", DEVICE) is not None
    assert store.start(job_id, dispatch, DEAD, "w1") is False
    rec = store.record(job_id)
    assert "ahead" not in rec and float(rec["started"]) > 0
    assert [e["event"] for e in store.events(job_id)].count("running") == 1
    assert store.finish(job_id, dispatch, DEVICE, "done", meta={}, pngs=[b"x"])
    assert store.start(job_id, dispatch, DEAD, "w1") is None  # not running: not ours


def test_the_same_process_claims_its_job_claimed_ahead_the_ordinary_way(store: Store) -> None:
    """A run that lost track of its claim ahead (its reply lost, its preparation failed)
    claims the job as any message's run does, and it begins."""
    job_id, dispatch = placed_job(store)
    assert store.claim_ahead(job_id, dispatch, DEAD, "w1", DEVICE) is not None
    assert store.claim(job_id, dispatch, DEAD, "w1") is not None
    rec = store.record(job_id)
    assert rec["state"] == "running" and "ahead" not in rec and rec["started"]


def test_a_cancel_while_claimed_ahead_is_told_at_its_start(store: Store) -> None:
    job_id, dispatch = placed_job(store)
    assert store.claim_ahead(job_id, dispatch, DEAD, "w1", DEVICE) is not None
    assert store.cancel(job_id) == 2  # a request its worker acts on
    assert store.start(job_id, dispatch, DEAD, "w1") is True


def test_the_next_process_places_again_a_job_claimed_ahead_that_never_began(
    store: Store,
) -> None:
    job_id, dispatch = placed_job(store)
    message = taken(store, job_id, dispatch)
    assert store.claim_ahead(message.job_id, message.dispatch, DEAD, "w1", DEVICE) is not None
    # the process died during the job before it: its start mark names that one
    mark = Began("the-job-before", "d-before", DEAD)
    assert store.restore_held(DEVICE, "0", mark) == (True, "unclaimed", 0)
    rec = store.record(job_id)
    assert rec["state"] == "placed" and "ahead" not in rec and not rec.get("incarnation")
    again = store.next_message(DEVICE)  # its message is back at the head of the queue
    assert again is not None and again.job_id == job_id
    assert store.claim(job_id, dispatch, LIVE, "w2") is not None
    assert store.restore_held(DEVICE, "0", None) == (True, "", 0)  # held, never claimed ahead


def test_the_next_process_charges_a_job_claimed_ahead_whose_run_began(store: Store) -> None:
    job_id, dispatch = placed_job(store)
    message = taken(store, job_id, dispatch)
    assert store.claim_ahead(job_id, dispatch, DEAD, "w1", DEVICE) is not None
    # its run began (the start mark names it) and the process died before the start reached
    # Redis: charged as a run, and its message is spent
    assert store.restore_held(DEVICE, "0", Began(job_id, dispatch, DEAD)) == (False, "charged", 0)
    rec = store.record(job_id)
    assert rec["state"] == "running" and "ahead" not in rec and rec["incarnation"] == DEAD
    assert rec["started"]
    assert store.next_message(DEVICE) is None
    assert message.dispatch == dispatch


def test_a_stopping_worker_gives_back_a_job_claimed_ahead(store: Store) -> None:
    job_id, dispatch = placed_job(store)
    message = taken(store, job_id, dispatch)
    assert store.claim_ahead(job_id, dispatch, DEAD, "w1", DEVICE) is not None
    assert store.unclaim(job_id, dispatch, DEVICE)
    store.push_back(DEVICE, message)
    assert store.record(job_id)["state"] == "placed"
    assert store.r.hgetall(transport.held_key(DEVICE)) == {}
    assert store.claim(job_id, dispatch, LIVE, "w2") is not None
    assert not store.unclaim(job_id, dispatch, DEVICE)  # begun elsewhere: left alone


def requeued_after_watching(store: Store) -> int:
    """A scheduler (its clock injected) cycling every 0.2 s for one heartbeat TTL and a
    second: a missing heartbeat counts as a dead worker only once it has watched that long."""
    clock = [0.0]
    dispatcher = Dispatcher(
        store, TOKEN, outbox=None, config=DispatchConfig(),  # type: ignore[arg-type]
        monotonic=lambda: clock[0], log=lambda kind, **fields: None,
    )  # fmt: skip
    dispatcher.start()
    requeued = 0
    while clock[0] < DispatchConfig().blind_grace + 1:
        requeued += dispatcher.cycle()["requeued"]
        clock[0] = round(clock[0] + 0.2, 6)
    return requeued


def test_the_scheduler_counts_a_lost_job_only_when_it_began(store: Store) -> None:
    """The worker is gone, and no next process of its slot settled anything (the whole worker
    died): a job begun is counted, the jobs claimed ahead are not."""
    store.beat(DEVICE, {"host": "h", "state": "busy", "incarnation": DEAD}, 60.0)
    begun, _ = placed_job(store, "begun")
    d = store.record(begun)["dispatch"]
    assert store.claim(begun, d, DEAD, "w1") is not None
    ahead, da = placed_job(store, "ahead")
    assert store.claim_ahead(ahead, da, DEAD, "w1", DEVICE) is not None
    charged, dc = placed_job(store, "charged")
    taken(store, charged, dc)
    assert store.claim_ahead(charged, dc, DEAD, "w1", DEVICE) is not None
    store.withdraw(DEVICE)  # the worker is gone: no process settles anything
    assert requeued_after_watching(store) == 3
    attempts = {j: store.record(j).get("attempts", "0") for j in (begun, ahead, charged)}
    assert attempts == {begun: "1", ahead: "0", charged: "0"}
    assert all(store.record(j)["state"] == "queued" for j in attempts)
    assert "ahead" not in store.record(ahead)


def test_a_taken_message_is_held_until_the_next_take_and_restored_to_the_head(
    store: Store,
) -> None:
    """A slot's process that dies between taking a message and claiming its job: the next
    process of that slot puts the message back at the head of its list."""
    (first,) = transport.queue_lists(DEVICE)[:1]
    taken(store, "a", "d-a")  # fills the list with a's message and takes it (slot 0)
    url = "redis://{host}:{port}/{db}".format(**store.r.connection_pool.connection_kwargs)
    outbox = transport.CeleryOutbox(store.r, transport.make_app(url))
    for job in ("b", "c"):
        store.r.lpush(first, outbox.message(job, f"d-{job}", DEVICE)[1])
    b = store.next_message(DEVICE, taker="1")
    assert b is not None and b.job_id == "b"
    assert store.restore_held(DEVICE, "1") == (True, "", 0)  # slot 1 died holding b
    assert store.restore_held(DEVICE, "1") == (False, "", 0)  # once
    assert store.r.llen(first) == 2
    again = store.next_message(DEVICE, taker="1")
    assert again is not None and again.job_id == "b"  # back at the head, before c
    assert store.restore_held(DEVICE, "0") == (True, "", 0)  # slot 0's message comes back too
    a = store.next_message(DEVICE)
    assert a is not None and a.job_id == "a"


def test_an_abort_is_charged_to_the_marked_job_and_the_job_before_is_spared(
    store: Store,
) -> None:
    """The process died running `killer` (its start mark) while the result of `finished`
    (its native call over) was still being written: the next process of the slot spares
    `finished`, so the scheduler counts only `killer`'s loss. A job of another process is
    left alone."""
    store.beat(DEVICE, {"host": "h", "state": "busy", "incarnation": DEAD}, 60.0)
    jobs = {}
    for name, incarnation in (("finished", DEAD), ("killer", DEAD), ("other", LIVE)):
        job_id, dispatch = placed_job(store, name)
        assert store.claim(job_id, dispatch, incarnation, "w1") is not None
        jobs[name] = (job_id, dispatch)
    killer, dispatch = jobs["killer"]
    assert store.restore_held(DEVICE, "0", Began(killer, dispatch, DEAD)) == (False, "", 1)
    assert store.record(jobs["finished"][0]).get("spared") == "1"
    assert not store.record(killer).get("spared")
    assert not store.record(jobs["other"][0]).get("spared")
    store.withdraw(DEVICE)
    assert requeued_after_watching(store) == 3
    attempts = {n: store.record(j).get("attempts", "0") for n, (j, _) in jobs.items()}
    assert attempts == {"finished": "0", "killer": "1", "other": "1"}
    assert not store.record(jobs["finished"][0]).get("spared")  # a new life starts clean


def test_a_claim_ahead_wakes_the_scheduler_when_jobs_are_pending(store: Store) -> None:
    """It leaves room in the device's backlog: the scheduler is told at once, as by a finish,
    but only when there is something to place."""
    job_id, dispatch = placed_job(store)
    store.r.delete(keys.WAKE_KEY)
    assert store.claim_ahead(job_id, dispatch, DEAD, "w1", DEVICE) is not None
    assert store.r.llen(keys.WAKE_KEY) == 0  # nothing pending
    waiting, _, _ = store.submit(JobSpec(model="m", params={"prompt": "next"}), 100)
    assert waiting is not None
    other, d2 = placed_job(store, "another")
    store.r.delete(keys.WAKE_KEY)
    assert store.claim_ahead(other, d2, DEAD, "w1", DEVICE) is not None
    assert store.r.lrange(keys.WAKE_KEY, 0, -1) == [other.encode()]


def test_a_job_whose_start_never_reached_redis_is_recorded_as_run_at_its_finish(
    store: Store,
) -> None:
    """Its start write failed, or was lost with a master that died before its replica had it
    (a Sentinel failover): the job ran, so its finish writes the running event it lacks, once,
    before its end."""
    job_id, dispatch = placed_job(store)
    claim = store.claim_ahead(job_id, dispatch, DEAD, "w1", DEVICE)
    assert claim is not None
    assert store.finish(job_id, dispatch, DEVICE, "done", meta={}, pngs=[b"x"])
    kinds = [e["event"] for e in store.events(job_id)]
    assert kinds.count("running") == 1 and kinds[-2:] == ["running", "done"]
    running = next(e for e in store.events(job_id) if e["event"] == "running")
    assert running["incarnation"] == DEAD and running["recorded"] == "at its end"
    rec = store.record(job_id)
    assert rec["started"] and "ahead" not in rec
    # a job whose start did reach Redis gets no second running event
    other, d2 = placed_job(store, "started")
    assert store.claim_ahead(other, d2, DEAD, "w1", DEVICE) is not None
    assert store.start(other, d2, DEAD, "w1") is False
    assert store.finish(other, d2, DEVICE, "done", meta={}, pngs=[b"x"])
    assert [e["event"] for e in store.events(other)].count("running") == 1
