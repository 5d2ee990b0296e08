"""The leader's loop: place pending jobs on devices and recover jobs from lost workers.

Flows 2 (place) and 5 (recover) of `sdfarm.worker.protocol`. One `cycle()` reads the farm
(`Registry.snapshot`), re-queues what lost workers held, then walks the pending jobs in
fair-share order and sends each one that a device can take now. Late binding: a device gets at
most `backlog` jobs beyond nothing (the running one included), so a batch is spread as devices
free up instead of being dealt out at submit time.

Every write is a Lua script that checks the leader token first (a fence: a scheduler whose
lease lapsed cannot write even if it has not noticed yet) and the job's state and dispatch id
(a job changes hands only from the state the scheduler saw, so a worker's claim or finish that
lands meanwhile always wins). The placement script also pushes the job's Celery message
(`sdfarm.scheduler.outbox`), so a job is recorded as placed and sent in one atomic step.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from sdfarm.scheduler import fairness, placement
from sdfarm.scheduler.outbox import CeleryOutbox
from sdfarm.scheduler.registry import (
    DEFAULT_BACKLOG,
    DEFAULT_QUEUE_LIMIT,
    PENDING_JOB_FIELDS,
    Registry,
    Snapshot,
    account,
    estimate_for,
)
from sdfarm.worker import protocol

MAX_ATTEMPTS = 2
"""A job whose worker died under it this many times is failed as poison (SPEC, worker)."""

# Shared Lua prelude: fence on the leader token, the Redis clock, capped events, final state.
_PRELUDE = """
local function fenced(leader, token)
  return redis.call('GET', leader) ~= token
end
local function now()
  local t = redis.call('TIME')
  return t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
end
local function log(events, ev, cap)
  redis.call('RPUSH', events, ev)
  redis.call('LTRIM', events, -tonumber(cap), -1)
end
local function uncount(count, n)
  if redis.call('DECRBY', count, n) < 0 then redis.call('SET', count, 0) end
end
local function finish(job, events, done, state, ev, cap, ttl)
  redis.call('HSET', job, 'state', state, 'ended', now())
  log(events, ev, cap)
  redis.call('RPUSH', done, state)
  for _, k in ipairs({job, events, done}) do redis.call('EXPIRE', k, ttl) end
end
"""

# KEYS: job, pending list, running hash, pending count, events, leader, device's Celery queue
# ARGV: token, id, dispatch, device, event, estimate, tier, cap, Celery message
_PLACE = (
    _PRELUDE
    + """
if fenced(KEYS[6], ARGV[1]) then return -1 end
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then
  local n = redis.call('LREM', KEYS[2], 0, ARGV[2])
  if n > 0 then uncount(KEYS[4], n) end
  return 0
end
if redis.call('LREM', KEYS[2], 1, ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'state', 'placed', 'device', ARGV[4], 'dispatch', ARGV[3],
  'estimate', ARGV[6], 'tier', ARGV[7], 'placed', now())
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
uncount(KEYS[4], 1)
log(KEYS[5], ARGV[5], ARGV[8])
redis.call('LPUSH', KEYS[7], ARGV[9])
return 1
"""
)

# KEYS: job, pending list, pending count, events, done, leader
# ARGV: token, id, error, figures json, event, cap, ttl, estimate
_FAIL_PENDING = (
    _PRELUDE
    + """
if fenced(KEYS[6], ARGV[1]) then return -1 end
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then return 0 end
if redis.call('LREM', KEYS[2], 1, ARGV[2]) == 0 then return 0 end
uncount(KEYS[3], 1)
redis.call('HSET', KEYS[1], 'error', ARGV[3], 'figures', ARGV[4], 'estimate', ARGV[8])
finish(KEYS[1], KEYS[4], KEYS[5], 'failed', ARGV[5], ARGV[6], ARGV[7])
return 1
"""
)

# KEYS: job, running hash, pending list, pending count, events, done, leader, cancel
# ARGV: token, id, expected state, expected dispatch, new dispatch, count attempt (0/1),
#       max attempts, device, retried event, failed event, cancelled event, poison error, cap, ttl
_REQUEUE = (
    _PRELUDE
    + """
if fenced(KEYS[7], ARGV[1]) then return -1 end
local state = redis.call('HGET', KEYS[1], 'state')
local dispatch = redis.call('HGET', KEYS[1], 'dispatch')
if state ~= ARGV[3] or dispatch ~= ARGV[4] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[2])
if redis.call('EXISTS', KEYS[8]) == 1 then
  finish(KEYS[1], KEYS[5], KEYS[6], 'cancelled', ARGV[11], ARGV[13], ARGV[14])
  return 3
end
if ARGV[6] == '1' then
  local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
  local lost = redis.call('HGET', KEYS[1], 'lost_on')
  if lost and lost ~= '' then lost = lost .. ',' .. ARGV[8] else lost = ARGV[8] end
  redis.call('HSET', KEYS[1], 'lost_on', lost)
  if attempts >= tonumber(ARGV[7]) then
    redis.call('HSET', KEYS[1], 'error', ARGV[12])
    finish(KEYS[1], KEYS[5], KEYS[6], 'failed', ARGV[10], ARGV[13], ARGV[14])
    return 2
  end
end
redis.call('HSET', KEYS[1], 'state', 'queued', 'device', '', 'dispatch', ARGV[5],
  'incarnation', '')
redis.call('LPUSH', KEYS[3], ARGV[2])
redis.call('INCR', KEYS[4])
log(KEYS[5], ARGV[9], ARGV[13])
return 1
"""
)

# KEYS: running hash, leader. ARGV: token, id, dispatch. A stale entry (the job ended or was
# re-placed and the worker could not clean up) is removed only if it still says `dispatch`.
_FORGET = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[3] then return 0 end
return redis.call('HDEL', KEYS[1], ARGV[2])
"""

# KEYS: job, pending list, pending count. A pending entry whose record is gone or not queued.
_DROP_STALE = """
if redis.call('HGET', KEYS[1], 'state') == 'queued' then return 0 end
local n = redis.call('LREM', KEYS[2], 0, ARGV[1])
if n > 0 and redis.call('DECRBY', KEYS[3], n) < 0 then redis.call('SET', KEYS[3], 0) end
return n
"""


class NotLeader(Exception):
    """A fenced write found another scheduler's token: stop dispatching at once."""


@dataclass(frozen=True)
class DispatchConfig:
    """Knobs the service passes in. `scan`: pending jobs read per priority per cycle (the
    heads of the lists; `Farm.map` keeps at most 256 of a caller's jobs queued, so fair share
    sees every concurrent batch). `forget_dead_after`: a device silent this long with nothing
    placed on it leaves the `devices` set (its worker re-adds it on its next heartbeat).
    `unknown_grace`: how long a job for a model no live worker
    lists waits (a worker restarting) before it fails. `mismatch_grace`: how long a running
    job's incarnation may differ from its device's heartbeat before the job counts as lost
    (a new process's first heartbeat can trail its first claim by one interval)."""

    backlog: int = DEFAULT_BACKLOG
    queue_limit: int = DEFAULT_QUEUE_LIMIT
    scan: int = 1000
    max_attempts: int = MAX_ATTEMPTS
    unknown_grace: float = 10.0
    mismatch_grace: float = 3 * protocol.HEARTBEAT_INTERVAL
    wake_timeout: float = 0.2
    forget_dead_after: float = 3600.0

    def __post_init__(self) -> None:
        if self.backlog < 1:
            raise ValueError(f"backlog must be at least 1, got {self.backlog}")
        if self.queue_limit < 1:
            raise ValueError(f"queue limit must be at least 1, got {self.queue_limit}")


@dataclass(frozen=True)
class PendingJob:
    """What the scheduler keeps of a queued job between cycles (none of it ever changes)."""

    job_id: str
    model: str
    priority: int
    submitter: str
    created: float
    width: int
    height: int


class Outbox(Protocol):
    """Builds the Celery message the placement script pushes (`outbox.CeleryOutbox`)."""

    def message(self, job_id: str, dispatch: str, device: str) -> tuple[str, str]:
        """(the Redis list to LPUSH, the message) for running `job_id` under `dispatch`."""
        ...


def make_celery_app(redis_url: str) -> Any:
    """The worker's own Celery app when it is importable (same serializer and transport
    options), else a JSON-only app on the same broker."""
    try:
        from sdfarm.worker.app import make_app  # type: ignore[import-not-found]
    except ImportError:
        make_app = None
    if make_app is not None:
        return make_app(redis_url)
    from celery import Celery

    app = Celery("sdfarm-scheduler", broker=redis_url)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
    )
    return app


def celery_outbox(client: Any, redis_url: str) -> CeleryOutbox:
    """The outbox of the worker's own Celery app on the farm's broker, its template captured
    now, so a Celery it cannot read stops the scheduler when it takes the lead."""
    return CeleryOutbox(client, make_celery_app(redis_url)).prepare()


def poison_error(job_id: str, lost_on: str, records: str | None, limit: int = 20) -> str:
    """The poison message: which workers the job killed and its last stored log records."""
    lines: list[str] = []
    try:
        parsed = json.loads(records) if records else []
    except ValueError:
        parsed = [records]
    for rec in parsed if isinstance(parsed, list) else [parsed]:
        if isinstance(rec, dict):
            lines.append(f"[{rec.get('level', '?')}] {rec.get('message', '')}".rstrip())
        else:
            lines.append(str(rec))
    quoted = "\n".join(lines[-limit:]) if lines else "(none stored)"
    return (
        f"poison: job {job_id} killed its worker twice ({lost_on}); not retried again. "
        f"Its last log records:\n{quoted}"
    )


class Dispatcher:
    """Place and recover, one `cycle()` at a time, as the holder of `token`."""

    def __init__(
        self,
        client: Any,
        token: str,
        outbox: Outbox,
        config: DispatchConfig | None = None,
        log: Callable[..., None] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.r = client
        self.token = token
        self.outbox = outbox
        self.config = config or DispatchConfig()
        self.log = log or (lambda kind, **fields: None)
        self.clock = clock
        self.monotonic = monotonic
        self.registry = Registry(client, self.config.backlog)
        self._place = client.register_script(_PLACE)
        self._fail_pending = client.register_script(_FAIL_PENDING)
        self._requeue = client.register_script(_REQUEUE)
        self._forget = client.register_script(_FORGET)
        self._drop_stale = client.register_script(_DROP_STALE)
        self._meta: dict[str, PendingJob] = {}
        self._incarnations: dict[str, str] = {}
        self._mismatch_since: dict[str, float] = {}
        self._missing_since: dict[str, float] = {}
        self._dead_since: dict[str, float] = {}

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> None:
        """On becoming leader: publish the config clients read, start counting afresh."""
        self.r.hset(
            protocol.CONFIG_KEY,
            mapping={"queue_limit": self.config.queue_limit, "backlog": self.config.backlog},
        )
        self._incarnations.clear()
        self._mismatch_since.clear()
        self._missing_since.clear()

    def wait_for_work(self) -> None:
        """Block until something nudges `wake` (a submit, a finished job) or the timeout, so
        dead workers are noticed within it. The cycle's snapshot clears the other nudges."""
        self.r.blpop([protocol.WAKE_KEY], timeout=self.config.wake_timeout)

    def cycle(self) -> dict[str, int]:
        """Recover, then place. Returns counts for logs and tests."""
        snap = self.registry.snapshot(heads=self.config.scan, clear_wake=True)
        stats = self.recover(snap)
        if any(stats.values()):
            snap = self.registry.snapshot(heads=self.config.scan)
        stats.update(self.place(snap))
        return stats

    def _check(self, rc: Any) -> int:
        if rc == -1:
            raise NotLeader(self.token)
        return int(rc)

    # -- recovery (flow 5) --------------------------------------------------------------------

    def recover(self, snap: Snapshot) -> dict[str, int]:
        """Jobs on devices whose heartbeat expired or whose worker process changed."""
        stats = {"requeued": 0, "poisoned": 0, "forgotten": 0}
        now = self.monotonic()
        alive_jobs: set[str] = set()
        for device, entries in snap.running.items():
            hb = snap.heartbeats.get(device)
            incarnation = str(hb.get("incarnation") or "") if hb is not None else ""
            previous = self._incarnations.get(device)
            changed = bool(hb) and bool(previous) and bool(incarnation) and incarnation != previous
            if hb is not None and incarnation:
                self._incarnations[device] = incarnation
            if hb is None and not entries:
                self._forget_dead(device, now)
            else:
                self._dead_since.pop(device, None)
            for job_id, dispatch in entries.items():
                job = snap.jobs.get(job_id)
                state = (job or {}).get("state")
                if job is None or state not in ("placed", "running") or job["dispatch"] != dispatch:
                    stats["forgotten"] += self._check(
                        self._forget(
                            keys=[protocol.running_key(device), protocol.LEADER_KEY],
                            args=[self.token, job_id, dispatch],
                        )
                    )
                    continue
                reason = None
                if hb is None:
                    reason = "heartbeat expired"
                elif state == "placed" and changed:
                    reason = "worker restarted"
                elif state == "running" and job.get("incarnation") not in ("", incarnation):
                    since = self._mismatch_since.setdefault(job_id, now)
                    if incarnation and (
                        _beat_after_claim(hb, job) or now - since >= self.config.mismatch_grace
                    ):
                        reason = "worker restarted"
                alive_jobs.add(job_id)
                if reason is None:
                    continue
                rc = self._lost(job_id, job, device, reason, count=state == "running")
                stats["poisoned" if rc == 2 else "requeued"] += rc > 0
                self._mismatch_since.pop(job_id, None)
        for job_id in list(self._mismatch_since):
            if job_id not in alive_jobs:
                del self._mismatch_since[job_id]
        return stats

    def _forget_dead(self, device: str, now: float) -> None:
        since = self._dead_since.setdefault(device, now)
        if now - since >= self.config.forget_dead_after:
            self.r.srem(protocol.DEVICES_KEY, device)
            self._dead_since.pop(device, None)
            self.log("forgotten-device", device=device)

    def _lost(self, job_id: str, job: dict[str, str], device: str, reason: str, count: bool) -> int:
        """Re-queue (front of its list, new dispatch id) or fail as poison; 0 if the job moved
        on meanwhile (finished, claimed by a live worker)."""
        attempts = int(job.get("attempts") or 0) + int(count)
        error = ""
        if count and attempts >= self.config.max_attempts:
            records, lost_on = self.r.hmget(protocol.job_key(job_id), ["records", "lost_on"])
            devices = ", ".join(filter(None, [protocol.decode(lost_on), device]))
            error = poison_error(job_id, devices, protocol.decode(records) or None)
        priority = job.get("priority") or "5"
        rc = self._check(
            self._requeue(
                keys=[
                    protocol.job_key(job_id),
                    protocol.running_key(device),
                    protocol.pending_key(int(priority)),
                    protocol.PENDING_COUNT_KEY,
                    protocol.events_key(job_id),
                    protocol.done_key(job_id),
                    protocol.LEADER_KEY,
                    protocol.cancel_key(job_id),
                ],
                args=[
                    self.token,
                    job_id,
                    job["state"],
                    job["dispatch"],
                    uuid.uuid4().hex,
                    "1" if count else "0",
                    self.config.max_attempts,
                    device,
                    protocol.event(
                        "retried", device=device, reason=reason, attempts=attempts, counted=count
                    ),
                    protocol.event("failed", error=error, device=device, reason="poison"),
                    protocol.event("cancelled", device=device, reason=reason),
                    error,
                    protocol.EVENTS_CAP,
                    protocol.RESULT_TTL,
                ],
            )
        )
        if rc:
            kind = {1: "requeued", 2: "poisoned", 3: "cancelled"}[rc]
            self.log(kind, job=job_id, device=device, reason=reason, attempts=attempts)
        return rc

    # -- placement (flow 2) ---------------------------------------------------------------------

    def _pending(self, snap: Snapshot) -> list[PendingJob]:
        """The heads of the pending lists (read with the snapshot), with their records (read
        once per job, then cached)."""
        listed = [(p, j) for p, ids in snap.heads.items() for j in ids]
        missing = [(p, j) for p, j in listed if j not in self._meta]
        read = {j: snap.head_fields[j] for _, j in missing if j in snap.head_fields}
        unread = [j for _, j in missing if j not in read]
        if unread:
            pipe = self.r.pipeline(transaction=False)
            for j in unread:
                pipe.hmget(protocol.job_key(j), PENDING_JOB_FIELDS)
            read.update(zip(unread, pipe.execute(), strict=True))
        for p, j in missing:
            meta = _pending_job(j, p, read[j])
            if meta is None:
                self._drop_stale(
                    keys=[
                        protocol.job_key(j),
                        protocol.pending_key(p),
                        protocol.PENDING_COUNT_KEY,
                    ],
                    args=[j],
                )
            else:
                self._meta[j] = meta
        seen = {j for _, j in listed}
        for j in list(self._meta):
            if j not in seen:
                del self._meta[j]
        return [self._meta[j] for _, j in listed if j in self._meta]

    def place(self, snap: Snapshot) -> dict[str, int]:
        """Fail what can never run, then send what fits now in fair-share order.

        Refusals and unknown models do not depend on the order, so they are decided once per
        (model, size) for all their jobs. Placing only fills devices, so within a pass a Wait
        for one (model, estimate) holds for every later job of it: the rest of a big batch of
        one model costs a set lookup while other models behind it still get placed, and the
        walk (lazy: `fairness.iter_order`) stops once no device has room."""
        stats = {"placed": 0, "refused": 0}
        jobs = self._pending(snap)
        if not jobs:
            return stats
        devices = {d.key: d for d in snap.devices}
        now = self.clock()
        estimates: dict[tuple[str, int, int], int] = {}
        groups: dict[tuple[str, int, int], list[PendingJob]] = {}
        for job in jobs:
            groups.setdefault((job.model, job.width, job.height), []).append(job)
        for (model, width, height), group in groups.items():
            facts = snap.model_facts(model)
            if facts is None:
                if snap.heartbeats and self._unknown_expired(model):
                    error = self._unknown_error(model, snap)
                    stats["refused"] += sum(self._fail(j, error, (), 0) for j in group)
                continue
            self._missing_since.pop(model, None)
            estimate = estimate_for(facts, width, height)
            outcome = placement.place(
                placement.JobRequest(model, estimate), list(devices.values()), now
            )
            if isinstance(outcome, placement.Refuse):
                fail = [self._fail(j, outcome.reason, outcome.figures, estimate) for j in group]
                stats["refused"] += sum(fail)
            else:
                estimates[(model, width, height)] = estimate
        if not _room(devices):
            return stats
        by_id = {j.job_id: j for j in jobs}
        pending = [
            fairness.Pending(j.job_id, j.priority, j.submitter, j.created, i)
            for i, j in enumerate(jobs)
            if (j.model, j.width, j.height) in estimates
        ]
        waits: set[tuple[str, int]] = set()
        for p in fairness.iter_order(pending, snap.running_by_submitter()):
            job = by_id[p.job_id]
            estimate = estimates[(job.model, job.width, job.height)]
            if (job.model, estimate) in waits:
                continue
            request = placement.JobRequest(job.model, estimate, job.priority, job.submitter)
            outcome = placement.place(request, list(devices.values()), now)
            if isinstance(outcome, placement.Placed):
                if self._send(job, outcome, estimate):
                    stats["placed"] += 1
                    devices[outcome.device] = account(
                        devices[outcome.device], job.model, estimate, outcome.evict
                    )
                    if not _room(devices):
                        break
            elif isinstance(outcome, placement.Refuse):  # not reached: refusals went above
                stats["refused"] += self._fail(job, outcome.reason, outcome.figures, estimate)
            else:
                waits.add((job.model, estimate))
                held = placement.reserve_device(request, list(devices.values()), now)
                if held is not None:
                    devices[held] = replace(devices[held], accepting=False)
                    if not _room(devices):
                        break
        return stats

    def _unknown_expired(self, model: str) -> bool:
        since = self._missing_since.setdefault(model, self.monotonic())
        return self.monotonic() - since >= self.config.unknown_grace

    @staticmethod
    def _unknown_error(model: str, snap: Snapshot) -> str:
        return (
            f"unknown model {model!r}: no live worker has it; the farm has: "
            f"{', '.join(snap.models()) or 'no models'}"
        )

    def _send(self, job: PendingJob, outcome: placement.Placed, estimate: int) -> bool:
        dispatch = uuid.uuid4().hex
        queue, message = self.outbox.message(job.job_id, dispatch, outcome.device)
        rc = self._check(
            self._place(
                keys=[
                    protocol.job_key(job.job_id),
                    protocol.pending_key(job.priority),
                    protocol.running_key(outcome.device),
                    protocol.PENDING_COUNT_KEY,
                    protocol.events_key(job.job_id),
                    protocol.LEADER_KEY,
                    queue,
                ],
                args=[
                    self.token,
                    job.job_id,
                    dispatch,
                    outcome.device,
                    protocol.event(
                        "placed",
                        device=outcome.device,
                        tier=outcome.tier,
                        evict=list(outcome.evict),
                        estimate=estimate,
                    ),
                    estimate,
                    outcome.tier,
                    protocol.EVENTS_CAP,
                    message,
                ],
            )
        )
        self._meta.pop(job.job_id, None)
        if rc != 1:
            return False
        self.log("placed", job=job.job_id, device=outcome.device, tier=outcome.tier)
        return True

    def _fail(
        self,
        job: PendingJob,
        error: str,
        figures: tuple[placement.Figures, ...],
        estimate: int,
    ) -> int:
        rc = self._check(
            self._fail_pending(
                keys=[
                    protocol.job_key(job.job_id),
                    protocol.pending_key(job.priority),
                    protocol.PENDING_COUNT_KEY,
                    protocol.events_key(job.job_id),
                    protocol.done_key(job.job_id),
                    protocol.LEADER_KEY,
                ],
                args=[
                    self.token,
                    job.job_id,
                    error,
                    json.dumps([f.__dict__ for f in figures]),
                    protocol.event("failed", error=error, estimate=estimate),
                    protocol.EVENTS_CAP,
                    protocol.RESULT_TTL,
                    estimate,
                ],
            )
        )
        self._meta.pop(job.job_id, None)
        if rc == 1:
            self.log("refused", job=job.job_id, error=error)
        return rc


def _beat_after_claim(hb: dict[str, Any], job: dict[str, str]) -> bool:
    """A heartbeat from another process, stamped after the job's claim (both by the worker
    host's clock): the process that claimed the job is gone, no need to wait out the grace."""
    try:
        return float(hb.get("ts") or 0) > float(job.get("started") or "inf")
    except (TypeError, ValueError):
        return False


def _room(devices: dict[str, placement.DeviceState]) -> bool:
    """Whether any live device that takes work has backlog room left."""
    return any(d.alive and d.accepting and d.has_room for d in devices.values())


def _pending_job(job_id: str, priority: int, values: list[Any]) -> PendingJob | None:
    """A queued job's placement facts; None when the record is gone or no longer queued. A
    spec that does not parse places at the default size (the client validated it)."""
    state, model, submitter, created, spec = (protocol.decode(v) for v in values)
    if state != "queued" or not model:
        return None
    try:
        params = json.loads(spec).get("params") or {}
        width, height = int(params.get("width", 256)), int(params.get("height", 256))
    except (ValueError, TypeError, AttributeError):
        width = height = 256
    try:
        created_at = float(created or 0)
    except ValueError:
        created_at = 0.0
    return PendingJob(job_id, model, priority, submitter or "anonymous", created_at, width, height)
