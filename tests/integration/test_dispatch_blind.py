"""A failover (or any pause of the scheduler) longer than the heartbeat TTL must not run a
job twice: the Dispatcher against a real redis-server, its monotonic clock injected, a
worker played through the Store's own transitions (beat, claim, finish)."""

from __future__ import annotations

from sdfarm.scheduler.dispatch import DispatchConfig, Dispatcher
from sdfarm.store import JobSpec, Store, keys
from sdfarm.store.records import new_dispatch_id

from helpers.leader import HELD, TOKEN

DEVICE = "h/CPU"
INCARNATION = "inc-1"
CONFIG = DispatchConfig()
GRACE = CONFIG.blind_grace


class Clock:
    """The Dispatcher's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def beat(store: Store) -> None:
    store.beat(DEVICE, {"host": "h", "state": "busy", "incarnation": INCARNATION}, 60.0)


def running_job(store: Store) -> tuple[str, str]:
    """A job placed on DEVICE and claimed there by a live worker."""
    job_id, _, _ = store.submit(JobSpec(model="m", params={"prompt": "a cat"}), 100)
    assert job_id is not None
    dispatch = new_dispatch_id()
    assert store.place(TOKEN, job_id, 5, DEVICE, dispatch, 123, "loaded", (), HELD) == 1
    assert store.claim(job_id, dispatch, INCARNATION, "w1") is not None
    return job_id, dispatch


def cycles(dispatcher: Dispatcher, clock: Clock, until: float, step: float = 0.2) -> int:
    """Cycle every `step` seconds of the fake clock up to `until`; the jobs requeued."""
    requeued = 0
    while clock.t < until:
        requeued += dispatcher.cycle()["requeued"]
        clock.t = round(clock.t + step, 6)
    return requeued


def watching(store: Store) -> tuple[Dispatcher, Clock, list[tuple[str, dict]]]:
    clock, logged = Clock(), []
    dispatcher = Dispatcher(
        store, TOKEN, outbox=None, config=CONFIG, monotonic=clock,  # type: ignore[arg-type]
        log=lambda kind, **fields: logged.append((kind, fields)),
    )  # fmt: skip
    dispatcher.start()
    return dispatcher, clock, logged


def test_a_worker_that_dies_while_watched_is_recovered_at_once(store: Store) -> None:
    beat(store)
    job_id, _ = running_job(store)
    dispatcher, clock, _ = watching(store)
    assert cycles(dispatcher, clock, GRACE + 1) == 0
    store.withdraw(DEVICE)  # the heartbeat gone while the scheduler watched
    assert dispatcher.cycle()["requeued"] == 1
    assert store.record(job_id)["state"] == "queued"


def test_heartbeats_lost_to_an_outage_wait_one_ttl_and_the_job_runs_once(store: Store) -> None:
    beat(store)
    job_id, dispatch = running_job(store)
    dispatcher, clock, logged = watching(store)
    assert cycles(dispatcher, clock, GRACE + 1) == 0
    # Redis is away for 12 s (a failover): no cycle runs, and the worker cannot beat, so its
    # heartbeat has expired when the promoted replica answers.
    store.withdraw(DEVICE)
    clock.t += 12.0
    assert cycles(dispatcher, clock, clock.t + 1.0) == 0
    assert ("blind", {"seconds": 12.2}) in logged
    beat(store)  # the live worker reconnects and beats within the TTL
    assert cycles(dispatcher, clock, clock.t + 2 * GRACE) == 0
    assert store.record(job_id)["state"] == "running"
    assert store.finish(job_id, dispatch, DEVICE, "done", meta={}, records=[], pngs=[b"png"])
    assert store.record(job_id)["state"] == "done"
    running = [e for e in store.events(job_id) if e["event"] == "running"]
    assert len(running) == 1  # ran once


def test_a_worker_that_stays_gone_after_the_outage_is_recovered_one_ttl_later(
    store: Store,
) -> None:
    beat(store)
    job_id, _ = running_job(store)
    dispatcher, clock, _ = watching(store)
    assert cycles(dispatcher, clock, GRACE + 1) == 0
    store.withdraw(DEVICE)
    clock.t += 12.0
    back = clock.t
    assert cycles(dispatcher, clock, back + GRACE - 0.2) == 0  # still waiting
    assert store.record(job_id)["state"] == "running"
    assert cycles(dispatcher, clock, back + GRACE + 0.4) == 1
    assert store.record(job_id)["state"] == "queued"


def test_a_new_leader_watches_one_ttl_before_trusting_a_missing_heartbeat(store: Store) -> None:
    """A standby that takes over right after the outage has seen no heartbeat at all."""
    beat(store)
    job_id, _ = running_job(store)
    store.withdraw(DEVICE)
    dispatcher, clock, _ = watching(store)
    assert cycles(dispatcher, clock, GRACE - 0.2) == 0
    assert store.record(job_id)["state"] == "running"
    assert cycles(dispatcher, clock, GRACE + 0.4) == 1


def test_the_heartbeat_ttl_is_what_the_grace_covers() -> None:
    assert CONFIG.blind_grace >= keys.HEARTBEAT_TTL + keys.HEARTBEAT_INTERVAL
    assert CONFIG.blind_after < keys.HEARTBEAT_TTL
