"""The leader's loop: place pending jobs on devices and recover jobs from lost workers.

The place and requeue transitions of `sdfarm.store`. One `cycle()` reads the farm
(`Registry.snapshot`), re-queues what lost workers held, then walks the pending jobs in
fair-share order and sends each one that a device can take now. Late binding: a device gets at
most `backlog` jobs beyond nothing (the running one included), so a batch is spread as devices
free up instead of being dealt out at submit time.

Every write is a store transition fenced on the leader token (a scheduler whose lease lapsed
cannot write even if it has not noticed yet) and on the job's state and dispatch id (a job
changes hands only from the state the scheduler saw, so a worker's claim or finish that lands
meanwhile always wins). Placing also pushes the job's Celery message
(`sdfarm.store.transport.CeleryOutbox`), so a job is recorded as placed and sent in one
atomic step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Protocol

from sdfarm.native import enginekey, upscale_params, video_params
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.estimate import UpscalerFacts, job_estimate
from sdfarm.native.params import MAX_SIZE, VAE_TILING, from_mapping
from sdfarm.scheduler import fairness, placement
from sdfarm.scheduler.index import DeviceIndex
from sdfarm.scheduler.registry import (
    DEFAULT_BACKLOG,
    DEFAULT_QUEUE_LIMIT,
    Registry,
    Snapshot,
    account,
    farm_upscalers,
)
from sdfarm.store import NOT_LEADER, Placement, Store, keys
from sdfarm.store.records import decode, new_dispatch_id, upscaler_key, upscaler_name

SEND_BATCH = 128
"""Placements sent to Redis in one round trip. A pass decides job after job on its own
accounting; sending each at once cost a round trip per job, which bounded a busy farm to a
few hundred placements a second. A send that finds its job gone meanwhile (cancelled) leaves
its device's slot unused until the next cycle, a few milliseconds later."""

MAX_ATTEMPTS = 2
"""A job whose worker died under it this many times is failed as poison (SPEC, worker)."""


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
    (a new process's first heartbeat can trail its first claim by one interval), and how long
    a device must look idle before a job placed on it counts as lost.
    `lost_message_grace`: how long after its placement a job's message may still be on its
    way to the worker. `blind_after`: a pause between two cycles longer than this means the
    scheduler could not watch the farm (its Redis away, a failover, the process stopped);
    `blind_grace`: after such a pause, and after becoming leader, how long it watches before
    a missing heartbeat counts as a lost worker (a heartbeat TTL and an interval: every live
    worker has beaten again by then)."""

    backlog: int = DEFAULT_BACKLOG
    queue_limit: int = DEFAULT_QUEUE_LIMIT
    scan: int = 1000
    max_attempts: int = MAX_ATTEMPTS
    unknown_grace: float = 10.0
    mismatch_grace: float = 3 * keys.HEARTBEAT_INTERVAL
    wake_timeout: float = 0.2
    forget_dead_after: float = 3600.0
    lost_message_grace: float = 10.0
    blind_after: float = 2 * keys.HEARTBEAT_INTERVAL
    blind_grace: float = keys.HEARTBEAT_TTL + keys.HEARTBEAT_INTERVAL

    def __post_init__(self) -> None:
        if self.backlog < 1:
            raise ValueError(f"backlog must be at least 1, got {self.backlog}")
        if self.queue_limit < 1:
            raise ValueError(f"queue limit must be at least 1, got {self.queue_limit}")


Hires = tuple[str, int, int, int]
"""A hires pass's model upscaler: (its name, the first pass's width and height, tile size)."""
Shape = tuple[str, int, int, bool, tuple[str, ...], int, Hires | None, str, int]
"""(engine, width, height, encodes an image, its LoRAs, tile size, its hires upscaler, its
vae_tiling choice, its images): an upscale job's engine is `upscaler:NAME`, its size the input
image's; a video job's tile size is minus its frame count (`_video_frames`)."""


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
    encodes: bool = False
    loras: tuple[str, ...] = ()
    tile_size: int = 0
    hires: Hires | None = None
    vae_tiling: str = "auto"
    batch: int = 1

    @cached_property
    def shape(self) -> Shape:
        """What the job's estimate depends on: jobs of one shape share it."""
        return (
            self.model, self.width, self.height, self.encodes, self.loras, self.tile_size,
            self.hires, self.vae_tiling, self.batch,
        )  # fmt: skip


class Outbox(Protocol):
    """Builds the Celery message placement pushes (`sdfarm.store.transport.CeleryOutbox`)."""

    def message(self, job_id: str, dispatch: str, device: str) -> tuple[str, str]:
        """(the Redis list to LPUSH, the message) for running `job_id` under `dispatch`."""
        ...


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
        store: Store,
        token: str,
        outbox: Outbox,
        config: DispatchConfig | None = None,
        log: Callable[..., None] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.token = token
        self.outbox = outbox
        self.config = config or DispatchConfig()
        self.log = log or (lambda kind, **fields: None)
        self.clock = clock
        self.monotonic = monotonic
        self.registry = Registry(store, self.config.backlog)
        self._meta: dict[str, PendingJob] = {}
        self._incarnations: dict[str, str] = {}
        self._mismatch_since: dict[str, float] = {}
        self._idle_since: dict[str, float] = {}
        self._missing_since: dict[str, float] = {}
        self._dead_since: dict[str, float] = {}
        self._last_cycle: float | None = None
        self._watching_since: float | None = None

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> None:
        """On becoming leader: publish the config clients read, start counting afresh."""
        self.store.publish_config(self.config.queue_limit, self.config.backlog)
        self._incarnations.clear()
        self._mismatch_since.clear()
        self._missing_since.clear()
        self._last_cycle = None

    def wait_for_work(self) -> None:
        """Block until something nudges `wake` (a submit, a finished job) or the timeout, so
        dead workers are noticed within it. The cycle's snapshot clears the other nudges."""
        self.store.wait_for_wake(self.config.wake_timeout)

    def cycle(self) -> dict[str, int]:
        """Recover, then place. Returns counts for logs and tests."""
        self._watch(self.monotonic())
        snap = self.registry.snapshot(heads=self.config.scan, clear_wake=True)
        stats = self.recover(snap)
        if any(stats.values()):
            snap = self.registry.snapshot(heads=self.config.scan)
        stats.update(self.place(snap))
        return stats

    def _watch(self, now: float) -> None:
        """Note this cycle's start; a first cycle, or one after a pause longer than
        `blind_after`, starts a new watch."""
        if self._last_cycle is None or now - self._last_cycle > self.config.blind_after:
            if self._last_cycle is not None:
                self.log("blind", seconds=round(now - self._last_cycle, 3))
            self._watching_since = now
        self._last_cycle = now

    def _watched_enough(self, now: float) -> bool:
        """Whether this scheduler has watched the farm without a pause for a heartbeat TTL
        and an interval. A worker's heartbeat lives `HEARTBEAT_TTL`; while Redis is away (a
        failover longer than the TTL) the workers cannot beat either, so the heartbeats
        expire with every worker alive. Seen right after the outage, a missing heartbeat says
        nothing; taking it for a lost worker would run its job a second time. One TTL of
        watching later, every live worker has beaten again and a missing one is dead."""
        since = self._watching_since
        return since is not None and now - since >= self.config.blind_grace

    def _check(self, rc: int) -> int:
        if rc == NOT_LEADER:
            raise NotLeader(self.token)
        return int(rc)

    # -- recovery (flow 5) --------------------------------------------------------------------

    def recover(self, snap: Snapshot) -> dict[str, int]:
        """Jobs past their deadline (failed, their worker told to stop), and jobs a device
        lost: its heartbeat expired, its worker process changed, or its task message never
        reached it (re-placed)."""
        stats = {"requeued": 0, "poisoned": 0, "forgotten": 0, "overdue": 0}
        now = self.monotonic()
        alive_jobs: set[str] = set()
        for device, entries in snap.running.items():
            hb = snap.heartbeats.get(device)
            incarnation = str(hb.get("incarnation") or "") if hb is not None else ""
            # With --engines N the device's incarnation is its worker's and each slot's
            # process claims under its own: a claim is live while its slot is listed.
            claims = {str(i) for i in (hb or {}).get("incarnations") or ()} | {incarnation}
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
                        self.store.forget(self.token, device, job_id, dispatch)
                    )
                    continue
                if (late := _overdue(job, snap.now)) is not None:
                    stats["overdue"] += self._overdue(job_id, job, device, late)
                    continue
                reason = None
                if hb is None:
                    if not self._watched_enough(now):
                        alive_jobs.add(job_id)  # its worker may be alive: look again later
                        continue
                    reason = "heartbeat expired"
                elif state == "placed" and changed:
                    reason = "worker restarted"
                elif state == "placed" and self._message_lost(job_id, hb, job, snap.now, now):
                    reason = "its task message never reached the worker"
                elif state == "running" and job.get("incarnation") not in ("", *claims):
                    since = self._mismatch_since.setdefault(job_id, now)
                    if incarnation and (
                        _beat_after_claim(hb, job) or now - since >= self.config.mismatch_grace
                    ):
                        reason = "worker restarted"
                alive_jobs.add(job_id)
                if reason is None:
                    continue
                # A job claimed ahead (`ahead`) had not begun; a `spared` one had ended its
                # native call when its process died running another: neither loss counts.
                ran = state == "running" and not job.get("ahead") and not job.get("spared")
                rc = self._lost(job_id, job, device, reason, count=ran)
                stats["poisoned" if rc == 2 else "requeued"] += rc > 0
                self._mismatch_since.pop(job_id, None)
        for since in (self._mismatch_since, self._idle_since):
            for job_id in list(since):
                if job_id not in alive_jobs:
                    del since[job_id]
        return stats

    def _message_lost(
        self, job_id: str, hb: dict[str, Any], job: dict[str, str], redis_now: float, now: float
    ) -> bool:
        """A placed job whose device has sat idle with an empty queue, for longer than the
        grace, well after the placement: its message is gone (a claim refused by a full Redis,
        a queue flushed). Re-placing it under a new dispatch id is safe even if the message
        turns up: its claim then finds the dispatch stale."""
        idle = hb.get("state") == "idle" and not hb.get("queue") and not hb.get("current_job")
        try:
            waited = redis_now - float(job.get("placed") or redis_now)
        except ValueError:
            waited = 0.0
        if not idle or waited < self.config.lost_message_grace:
            self._idle_since.pop(job_id, None)
            return False
        return now - self._idle_since.setdefault(job_id, now) >= self.config.mismatch_grace

    def _overdue(self, job_id: str, job: dict[str, str], device: str, late: float) -> int:
        deadline = float(job["deadline"])
        error = (
            f"deadline: the job was placed on {device} {deadline + late:.0f} s ago, past its "
            f"deadline of {deadline:g} s (deadline_s); its worker was told to stop it"
        )
        rc = self._check(self.store.overdue(self.token, job_id, job["dispatch"], device, error))
        if rc:
            self.log("overdue", job=job_id, device=device, error=error)
        return rc

    def _forget_dead(self, device: str, now: float) -> None:
        since = self._dead_since.setdefault(device, now)
        if now - since >= self.config.forget_dead_after:
            self.store.forget_device(device)
            self._dead_since.pop(device, None)
            self.log("forgotten-device", device=device)

    def _lost(self, job_id: str, job: dict[str, str], device: str, reason: str, count: bool) -> int:
        """Re-queue (front of its list, new dispatch id) or fail as poison; 0 if the job moved
        on meanwhile (finished, claimed by a live worker)."""
        attempts = int(job.get("attempts") or 0) + int(count)
        error = ""
        if count and attempts >= self.config.max_attempts:
            records, lost_on = self.store.lost_runs(job_id)
            devices = ", ".join(filter(None, [lost_on, device]))
            error = poison_error(job_id, devices, records or None)
        rc = self._check(
            self.store.requeue(
                self.token,
                job_id,
                job,
                device,
                reason=reason,
                count=count,
                max_attempts=self.config.max_attempts,
                poison_error=error,
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
            read.update(self.store.pending_fields(unread))
        for p, j in missing:
            meta = _pending_job(j, p, read[j])
            if meta is None:
                self.store.drop_stale(j, p)
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
        index = DeviceIndex(snap.devices)
        now = self.clock()
        estimates: dict[Shape, placement.JobRequest] = {}
        groups: dict[Shape, list[PendingJob]] = {}
        for job in jobs:
            groups.setdefault(job.shape, []).append(job)
        sizes = snap.loras()
        for shape, group in groups.items():
            model = shape[0]
            facts = snap.model_facts(model)
            if facts is None:
                if snap.heartbeats and self._unknown_expired(model):
                    error = self._unknown_error(model, snap)
                    stats["refused"] += sum(self._fail(j, error, (), 0) for j in group)
                continue
            self._missing_since.pop(model, None)
            _, width, height, encodes, loras, tile, hires, tiling, batch = shape
            extra = sum(sizes.get(n, 0) for n in loras) + _hires_bytes(snap, hires)
            size = {"encodes": encodes, "tile_size": tile, "extra_bytes": extra, "batch": batch}
            size["frames"] = _video_frames(size)
            upscale = upscaler_name(model) is not None  # no VAE: nothing to tile
            asked = _index_request(
                placement.JobRequest(
                    model,
                    job_estimate(facts, width, height, **size),
                    tiled_estimate=None
                    if upscale
                    else job_estimate(facts, width, height, tiled=True, **size),
                    vae_tiling=tiling,
                )
            )
            if index.roomiest is not None and asked.least <= index.roomiest:
                estimates[shape] = asked  # within a device's capacity: never refused
                continue
            outcome = placement.place(asked, list(index.devices.values()), now)
            if isinstance(outcome, placement.Refuse):
                fail = [self._fail(j, outcome.reason, outcome.figures, asked.least) for j in group]
                stats["refused"] += sum(fail)
            else:
                estimates[shape] = asked
        if not index.has_room():
            return stats
        by_id = {j.job_id: j for j in jobs}
        pending = [
            fairness.Pending(j.job_id, j.priority, j.submitter, j.created, i)
            for i, j in enumerate(jobs)
            if j.shape in estimates
        ]
        waits: set[tuple[str, int, str]] = set()
        sends: list[Placement] = []
        for p in fairness.iter_order(pending, snap.running_by_submitter()):
            job = by_id[p.job_id]
            asked = estimates[job.shape]
            if (job.model, asked.estimate, asked.vae_tiling) in waits:
                continue
            request = replace(asked, priority=job.priority, submitter=job.submitter)
            outcome = index.place(request, now)
            if isinstance(outcome, placement.Placed):
                # The plan on the device it got: placement's full walk carries one for a job
                # that may tile; the index's fast tiers place it untiled, where it fits so.
                estimate = outcome.tiling.estimate if outcome.tiling else asked.estimate
                sends.append(self._placement(job, outcome, estimate))
                device = index.devices[outcome.device]
                index.update(account(device, job.model, estimate, outcome.evict))
                if len(sends) >= SEND_BATCH:
                    stats["placed"] += self._send(sends)
                    sends = []
                if not index.has_room():
                    break
            elif isinstance(outcome, placement.Refuse):  # not reached: refusals went above
                stats["refused"] += self._fail(job, outcome.reason, outcome.figures, asked.least)
            else:
                waits.add((job.model, asked.estimate, asked.vae_tiling))
                held = index.reserve_device(request, now)
                if held is not None:
                    index.update(replace(index.devices[held], accepting=False))
                    if not index.has_room():
                        break
        stats["placed"] += self._send(sends)
        return stats

    def _unknown_expired(self, model: str) -> bool:
        since = self._missing_since.setdefault(model, self.monotonic())
        return self.monotonic() - since >= self.config.unknown_grace

    @staticmethod
    def _unknown_error(model: str, snap: Snapshot) -> str:
        if enginekey.is_key(model):
            return enginekey.unknown_error(model, snap.heartbeats, snap.models())
        upscaler = upscaler_name(model)
        if upscaler is not None:
            return (
                f"unknown upscaler {upscaler!r}: no live worker has it; the farm has: "
                f"{', '.join(farm_upscalers(snap.heartbeats)) or 'no upscalers'}"
            )
        return (
            f"unknown model {model!r}: no live worker has it; the farm has: "
            f"{', '.join(snap.models()) or 'no models'}"
        )

    def _placement(self, job: PendingJob, outcome: placement.Placed, estimate: int) -> Placement:
        """The store's record of sending `job` where `outcome` says, under a new dispatch id,
        with its VAE tiling plan when placement made one."""
        self._meta.pop(job.job_id, None)
        dispatch = new_dispatch_id()
        return Placement(
            job.job_id,
            job.priority,
            outcome.device,
            dispatch,
            estimate,
            outcome.tier,
            outcome.evict,
            self.outbox.message(job.job_id, dispatch, outcome.device),
            outcome.tiling.as_json() if outcome.tiling else None,
        )

    def _send(self, sends: list[Placement]) -> int:
        """Place `sends` in one round trip; how many were placed (a job cancelled meanwhile
        is not). NotLeader when the lease went elsewhere (then none was written)."""
        placed = 0
        for sent, rc in zip(sends, self.store.place_many(self.token, sends), strict=True):
            if self._check(rc) == 1:
                placed += 1
                self.log("placed", job=sent.job_id, device=sent.device, tier=sent.tier)
        return placed

    def _fail(
        self,
        job: PendingJob,
        error: str,
        figures: tuple[placement.Figures, ...],
        estimate: int,
    ) -> int:
        rc = self._check(
            self.store.fail(
                self.token,
                job.job_id,
                job.priority,
                error,
                [f.__dict__ for f in figures],
                estimate,
            )
        )
        self._meta.pop(job.job_id, None)
        if rc == 1:
            self.log("refused", job=job.job_id, error=error)
        return rc


def _index_request(asked: placement.JobRequest) -> placement.JobRequest:
    """The job as the device index's fast tiers judge it, by `estimate`: a job that must
    decode in tiles (`vae_tiling` on) by its tiled estimate. A job that may tile (auto) is
    judged untiled there, and where nothing fits it so, by placement's full walk, which plans
    the tiling per device."""
    if asked.vae_tiling == "on" and asked.tiled_estimate is not None:
        return replace(asked, estimate=asked.tiled_estimate)
    return asked


def _overdue(job: dict[str, str], now: float) -> float | None:
    """Seconds a placed or running job is past its deadline (both by the Redis clock), or
    None while it is within it (or either figure is missing)."""
    try:
        late = now - float(job["placed"]) - float(job["deadline"])
    except (KeyError, ValueError):
        return None
    return late if late > 0 else None


def _beat_after_claim(hb: dict[str, Any], job: dict[str, str]) -> bool:
    """A heartbeat from another process, stamped after the job's claim (both by the worker
    host's clock): the process that claimed the job is gone, no need to wait out the grace."""
    try:
        return float(hb.get("ts") or 0) > float(job.get("started") or job.get("ahead") or "inf")
    except (TypeError, ValueError):
        return False


def _pending_job(job_id: str, priority: int, values: list[Any]) -> PendingJob | None:
    """A queued job's placement facts; None when the record is gone or no longer queued. A
    spec that does not parse places at the default size (the client validated it)."""
    state, model, submitter, created, spec = (decode(v) for v in values)
    if state != "queued" or not model:
        return None
    tile, hires, batch = 0, None, 1
    try:
        doc = json.loads(spec)
        params = doc.get("params") or {}
        if doc.get("kind") == "video":
            # A video job: its frame size, its frame count as a negative tile size (the
            # shape's slot no video uses; `_video_frames`), never tiled.
            width, height, frames, encodes = video_params.placement_size(params)
            tile, loras, tiling = -frames, (), "off"
        elif upscaler_name(model) is not None:
            # An upscale job: its input size and tile size (a malformed size places as the
            # largest input, the worker refuses what does not fit).
            width, height = upscale_params.input_size(params) or (MAX_SIZE, MAX_SIZE)
            tile = int(params.get("tile_size", upscale_params.DEFAULT_TILE))
            encodes, loras, tiling = False, (), "off"
        else:
            gen = from_mapping(params)
            width, height = gen.final_size  # hires: the final size counts
            encodes = gen.encodes
            loras = tuple(str(pair[0]) for pair in params.get("loras") or [])
            tiling = gen.vae_tiling if gen.vae_tiling in VAE_TILING else "auto"
            batch = gen.batch_count
            if gen.hires_upscaler:
                hires = (str(gen.hires_upscaler), gen.width, gen.height, gen.hires_tile_size)
    except (ValueError, TypeError, AttributeError, IndexError, InvalidParameterError):
        width, height, encodes, loras, tiling = 256, 256, False, (), "auto"
    try:
        created_at = float(created or 0)
    except ValueError:
        created_at = 0.0
    return PendingJob(
        job_id, model, priority, submitter or "anonymous", created_at, width, height, encodes,
        loras, tile, hires, tiling, batch,
    )  # fmt: skip


def _video_frames(size: dict[str, Any]) -> int:
    """A video job's frame count from its shape's size (its tile size, negative), 0 for
    another job; the tile size it stood in for becomes 0."""
    if size["tile_size"] >= 0:
        return 0
    frames = -size["tile_size"]
    size["tile_size"] = 0
    return frames


def _hires_bytes(snap: Snapshot, hires: Hires | None) -> int:
    """What a hires pass's model upscaler adds to a generation's estimate
    (`UpscalerFacts.working`); 0 without one, or when no live worker has it (the client
    refuses such a job, the worker fails it by name)."""
    if hires is None:
        return 0
    facts = snap.model_facts(upscaler_key(hires[0]))
    return facts.working(*hires[1:]) if isinstance(facts, UpscalerFacts) else 0
