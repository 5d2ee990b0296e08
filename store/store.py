"""`Store`: the one owner of the farm's Redis. Every key is named in `keys.py`, every record is
shaped in `records.py`, every state change is a Lua script in `lua/`; this class is how the
client, the scheduler, the worker and the gateway read and change them.

A job's life, one named transition each (every one also appends an event):

1. submit (client): queue the job unless `pending:count` is at the queue limit.
2. place (the leader scheduler): a queued job goes to a device with a new dispatch id, and
   its Celery message onto that device's queue, atomically; or fail: no device could ever
   hold it. Every scheduler write is fenced on the leader token.
3. claim (worker): a placed job of this dispatch starts running; a message whose dispatch is
   stale claims nothing, which is what keeps a job from running twice. Then loaded (after a
   model load), progress (each step; both say whether a cancel is asked for), preview (the
   latest preview image, when the job asks for them) and finish
   (result, final state, done token), only while the job is still this dispatch's.
4. wait (client): block on the done token, then read the record and the result together.
5. requeue (scheduler): a job whose worker died (heartbeat expired, or a new worker process)
   goes back to the front of its list with a new dispatch id; after two lost runs it fails as
   poison. forget: a stale running entry is removed.
6. cancel (client): a queued job ends at once; a placed or running one gets a request its
   worker acts on (master-596 has no cancel call: the worker ends its own process).
7. webhooks (the leader scheduler): every ending above queues the job's webhook in the same
   script; take_webhooks (fenced, with a lease: at least once) and settle_webhook deliver it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from sdfarm.store import keys, scripts, transport
from sdfarm.store.keys import (
    CONFIG_KEY,
    DEVICES_KEY,
    EVENTS_CAP,
    JOB_TTL,
    LEADER_KEY,
    METRICS_KEYS,
    PENDING_COUNT_KEY,
    PREFS_KEY,
    PRIORITIES,
    RECENT_CAP,
    RECENT_KEY,
    RESULT_TTL,
    WAKE_CAP,
    WAKE_KEY,
    WEBHOOKS_KEY,
)
from sdfarm.store.records import (
    CATALOG_REF,
    FINAL_STATES,
    PENDING_JOB_FIELDS,
    RUNNING_JOB_FIELDS,
    Claim,
    JobResult,
    JobSpec,
    decode,
    decode_hash,
    event,
    loads,
    new_dispatch_id,
    new_job_id,
    new_job_record,
    parse_heartbeat,
    split_heartbeat,
)

NOT_LEADER = -1
"""What a fenced transition returns when the caller's token no longer holds the lease."""


class QuotaExceededError(Exception):
    """A submit refused because the job's owner already has `quota` live jobs (`live`)."""

    def __init__(self, owner: str, live: int, quota: int) -> None:
        super().__init__(
            f"too many jobs: {live} of this token's jobs are queued or running, at most {quota} "
            "at once; wait for one to end"
        )
        self.owner = owner
        self.live = live
        self.quota = quota


def refusing_writes_reason(info: Mapping[str, Any]) -> str | None:
    """Why a Redis whose INFO memory is `info` refuses writes, in words, else None."""
    used, limit = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
    policy = info.get("maxmemory_policy", "")
    if isinstance(policy, bytes):
        policy = policy.decode()
    if limit and used >= limit and policy == "noeviction":
        return (
            f"the farm's Redis is full: used memory {used} bytes of maxmemory {limit} "
            f"(policy {policy}), so it refuses every write"
        )
    return None


@dataclass
class FarmReading:
    """The farm at one instant, as `snapshot` reads it: the known devices, the live ones'
    heartbeats, {device: {job id: dispatch id}} of what was sent to each, the
    RUNNING_JOB_FIELDS of those jobs, the first ids of each pending list by priority, and
    the PENDING_JOB_FIELDS of the first few of them; `now` is the Redis clock then."""

    known: list[str] = field(default_factory=list)
    heartbeats: dict[str, dict[str, Any]] = field(default_factory=dict)
    running: dict[str, dict[str, str]] = field(default_factory=dict)
    jobs: dict[str, dict[str, str]] = field(default_factory=dict)
    heads: dict[int, list[str]] = field(default_factory=dict)
    head_fields: dict[str, list[str]] = field(default_factory=dict)
    now: float = 0.0


@dataclass(frozen=True)
class Placement:
    """One job sent to a device (`Store.place_many`): where, under which dispatch id, with
    its estimate, tier, the engines the worker evicts first and its Celery message
    `(queue list, body)`."""

    job_id: str
    priority: int
    device: str
    dispatch: str
    estimate: int
    tier: str
    evict: tuple[str, ...]
    message: tuple[str, str]
    tiling: Mapping[str, Any] | None = None
    """The job's VAE tiling plan on that device (the JSON of sdfarm.native.tiling.TilingPlan),
    kept in the record for its worker; None: the worker's engine plans by itself."""


class Store:
    """The farm's Redis (a redis-py client with decode_responses off). Thread-safe as redis-py
    is: the scripts are registered once per Store, on its client's connection pool."""

    def __init__(self, client: Any) -> None:
        self.r = client
        self._lua = scripts.register(client)
        self._catalogs: dict[str, dict[str, Any]] = {}
        self._parsed: dict[str, tuple[bytes, dict[str, Any]]] = {}

    @classmethod
    def connect(cls, url: str, **options: Any) -> Store:
        """A Store of `url` (`redis://` or `redis+sentinel://`, see store/connect.py)."""
        from sdfarm.store.connect import sync_client

        return cls(sync_client(url, **options))

    def close(self) -> None:
        self.r.close()

    def ping(self) -> bool:
        return bool(self.r.ping())

    # -- submit, cancel, wait (client) ------------------------------------------------------

    def submit(
        self,
        spec: JobSpec,
        default_queue_limit: int,
        job_id: str | None = None,
        inputs: Mapping[str, bytes] | None = None,
        quota: int = 0,
    ) -> tuple[str | None, int, int]:
        """(job id, queue depth, queue limit); the id is None when the queue was full. Given
        the `job_id` of an earlier try, a retried submit queues nothing twice. `inputs` (the
        job's images by name, already checked) are stored with the job, in the same step.
        `quota` > 0: the job's owner may have that many live jobs (queued, placed, running);
        at it, QuotaExceededError and nothing is queued."""
        job_id = job_id or new_job_id()
        record = [x for kv in new_job_record(job_id, spec).items() for x in kv]
        images = [x for kv in (inputs or {}).items() for x in kv]
        queued = event("queued", priority=spec.priority, submitter=spec.submitter)
        ok, depth, limit = self._lua["submit"](
            keys=[
                keys.job_key(job_id),
                keys.pending_key(spec.priority),
                PENDING_COUNT_KEY,
                keys.events_key(job_id),
                WAKE_KEY,
                CONFIG_KEY,
                keys.input_key(job_id),
                keys.owned_key(spec.owner),
                *METRICS_KEYS,
            ],
            args=[job_id, default_queue_limit, queued, EVENTS_CAP, JOB_TTL, WAKE_CAP,
                  quota if spec.owner else 0, keys.JOB_PREFIX, len(images), *images, *record],
        )  # fmt: skip
        if int(ok) < 0:
            raise QuotaExceededError(spec.owner, int(depth), int(limit))
        return (job_id if ok else None), int(depth), int(limit)

    def cancel(self, job_id: str, by: str = "client") -> int:
        """1 cancelled while queued, 2 cancel requested (placed or running), 0 already ended
        or no such job."""
        priority = decode(self.r.hget(keys.job_key(job_id), "priority"))
        if not priority.isdigit():
            return 0
        return int(
            self._lua["cancel"](
                keys=[
                    keys.job_key(job_id),
                    PENDING_COUNT_KEY,
                    keys.events_key(job_id),
                    keys.done_key(job_id),
                    keys.cancel_key(job_id),
                    keys.pending_key(int(priority)),
                    *METRICS_KEYS,
                    WEBHOOKS_KEY,
                ],
                args=[job_id, event("cancelled", by=by), EVENTS_CAP, RESULT_TTL],
            )
        )

    def wait(self, job_id: str, timeout: float) -> bool:
        """Block until the job's done token exists (True) or `timeout` seconds pass (False).
        The token is rotated in place (BLMOVE onto its own list), never popped: other waiters
        see it too and its key keeps its TTL. A full Redis refuses that: then it polls."""
        done = keys.done_key(job_id)
        try:
            got = self.r.blmove(done, done, max(0.001, timeout), src="RIGHT", dest="LEFT")
        except redis.OutOfMemoryError:
            # A full Redis refuses BLMOVE (it writes): look, without writing, twice a second.
            time.sleep(min(timeout, 0.5))
            return bool(self.r.exists(done))
        return got is not None

    def ended(self, job_id: str) -> JobResult:
        """The record and the result of a job, read together (one round trip)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.job_key(job_id))
        pipe.hgetall(keys.result_key(job_id))
        raw_record, raw_result = pipe.execute()
        return JobResult.parse(raw_record, raw_result)

    # -- reading jobs ------------------------------------------------------------------------

    def record(self, job_id: str) -> dict[str, str]:
        return decode_hash(self.r.hgetall(keys.job_key(job_id)))

    def state(self, job_id: str) -> str:
        """queued, placed, running, done, failed or cancelled; "" for no such job."""
        return decode(self.r.hget(keys.job_key(job_id), "state"))

    def watch(self, job_id: str) -> tuple[str, float | None, float | None, float]:
        """(state, placed, deadline seconds, the Redis clock now) in one round trip: what a
        waiter needs to know whether the job is past its deadline."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(keys.job_key(job_id), ["state", "placed", "deadline"])
        pipe.time()
        (state, placed, deadline), (sec, usec) = pipe.execute()
        return decode(state), _float(placed), _float(deadline), sec + usec / 1e6

    def refusing_writes(self) -> str | None:
        """Why Redis refuses writes now, in words (full: used memory above maxmemory with
        noeviction), else None."""
        return refusing_writes_reason(self.r.info("memory"))

    def progress(self, job_id: str) -> dict[str, Any] | None:
        return loads(self.r.get(keys.progress_key(job_id)), None)

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return [e for e in (loads(x, None) for x in self.raw_events(job_id)) if isinstance(e, dict)]

    def raw_events(self, job_id: str) -> list[bytes]:
        return list(self.r.lrange(keys.events_key(job_id), 0, -1))

    def events_exist(self, job_id: str) -> bool:
        return bool(self.r.exists(keys.events_key(job_id)))

    def inputs(self, job_id: str) -> dict[str, bytes]:
        """The job's input images by name ({} when it has none)."""
        return {decode(k): v for k, v in self.r.hgetall(keys.input_key(job_id)).items()}

    def image_count(self, job_id: str) -> int:
        count = decode(self.r.hget(keys.result_key(job_id), "count"))
        return int(count) if count.isdigit() else 0

    def jobs_fields(self, job_ids: Sequence[str], names: Sequence[str]) -> list[list[str]]:
        """The fields `names` of each job (one round trip)."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(keys.job_key(job_id), list(names))
        return [[decode(v) for v in values] for values in pipe.execute()]

    def progress_of(self, job_ids: Sequence[str]) -> list[dict[str, Any] | None]:
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.get(keys.progress_key(job_id))
        return [loads(raw, None) for raw in pipe.execute()]

    def preview(self, job_id: str) -> dict[str, Any] | None:
        """The latest preview event of a running job (None without one)."""
        return loads(self.r.get(keys.preview_key(job_id)), None)

    def previews_of(self, job_ids: Sequence[str]) -> list[dict[str, Any] | None]:
        """The latest preview event of each job (one round trip)."""
        if not job_ids:
            return []
        return [loads(raw, None) for raw in self.r.mget([keys.preview_key(j) for j in job_ids])]

    def recent(self, count: int = RECENT_CAP) -> list[str]:
        """The ids of the latest finished jobs, newest first."""
        return [decode(x) for x in self.r.lrange(RECENT_KEY, 0, count - 1)]

    def count_by_state(self) -> dict[str, int]:
        """How many job records Redis holds in each state (live jobs and those finished
        within RESULT_TTL). Scans every record: for occasional reads, not a hot path."""
        counts: dict[str, int] = {}
        batch: list[bytes] = []
        for k in self.r.scan_iter(match=keys.job_key("*"), count=1000):
            batch.append(k)
            if len(batch) >= 1000:
                self._count_states(batch, counts)
                batch = []
        self._count_states(batch, counts)
        return counts

    def _count_states(self, batch: list[bytes], counts: dict[str, int]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for k in batch:
            pipe.hget(k, "state")
        for s in pipe.execute():
            counts[decode(s)] = counts.get(decode(s), 0) + 1

    # -- the farm ------------------------------------------------------------------------------

    def heartbeats(self) -> dict[str, dict[str, Any]]:
        """Live heartbeats by device key (two round trips, no script)."""
        known = sorted(decode(k) for k in self.r.smembers(DEVICES_KEY))
        values = self.r.mget([keys.heartbeat_key(k) for k in known]) if known else []
        out = {}
        for k, raw in zip(known, values, strict=True):
            hb = parse_heartbeat(raw)
            if hb is not None:
                out[k] = hb
        self._with_catalogs(out.values())
        return out

    def heartbeat(self, device_key: str) -> dict[str, Any] | None:
        hb = parse_heartbeat(self.r.get(keys.heartbeat_key(device_key)))
        if hb is not None:
            self._with_catalogs([hb])
        return hb

    def _with_catalogs(self, hbs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """Put each heartbeat's catalog (`models`, `loras`) back in place of its digest, read
        once per digest and kept: every heartbeat of one catalog gets the same objects (read
        them, never change them). Returns the heartbeats whose catalog is gone (expired)."""
        hbs = [hb for hb in hbs if isinstance(hb.get(CATALOG_REF), str)]
        wanted = sorted({hb[CATALOG_REF] for hb in hbs} - self._catalogs.keys())
        if wanted:
            raws = self.r.mget([keys.facts_key(d) for d in wanted])
            for digest, raw in zip(wanted, raws, strict=True):
                doc = loads(raw, None)
                if isinstance(doc, dict):
                    self._catalogs[digest] = doc
        missing = []
        for hb in hbs:
            catalog = self._catalogs.get(hb.pop(CATALOG_REF))
            if catalog is None:
                missing.append(hb)
            hb.update(catalog or {"models": {}, "loras": {}})
        return missing

    def queues(self) -> dict[str, Any]:
        """Queue depth by priority, jobs pending, the leader's token and the config."""
        pipe = self.r.pipeline(transaction=False)
        for p in PRIORITIES:
            pipe.llen(keys.pending_key(p))
        pipe.get(PENDING_COUNT_KEY)
        pipe.get(LEADER_KEY)
        pipe.hgetall(CONFIG_KEY)
        *depths, count, leader, config = pipe.execute()
        return {
            "queues": {p: int(n) for p, n in zip(PRIORITIES, depths, strict=True)},
            "pending": int(decode(count) or 0),
            "leader": decode(leader) or None,
            "config": decode_hash(config),
        }

    def snapshot(self, heads: int = 0, clear_wake: bool = False, facts: int = 4) -> FarmReading:
        """The farm in one round trip; with `heads` > 0 also the first `heads` ids of every
        pending list and the PENDING_JOB_FIELDS of the first `facts` of each; `clear_wake`
        empties the wake list in the same atomic step."""
        pending = [keys.pending_key(p) for p in PRIORITIES] if heads > 0 else []
        raw_devices, raw_heads, raw_facts, now = self._lua["snapshot"](
            keys=[DEVICES_KEY, WAKE_KEY, *pending],
            args=[
                "1" if clear_wake else "0",
                keys.heartbeat_key(""),
                keys.running_key(""),
                keys.job_key(""),
                heads,
                facts,
                len(RUNNING_JOB_FIELDS),
                *RUNNING_JOB_FIELDS,
                *PENDING_JOB_FIELDS,
            ],
        )
        out = FarmReading(now=float(decode(now)))
        parsed, fresh = self._parsed, {}
        for raw_key, raw_hb, raw_running, raw_jobs in raw_devices:
            k = decode(raw_key)
            out.known.append(k)
            seen = parsed.get(k)
            if seen is not None and raw_hb is not None and seen[0] == raw_hb:
                hb: dict[str, Any] | None = seen[1]  # unchanged since the last read: parsed
            else:
                hb = parse_heartbeat(raw_hb)
                if hb is not None and raw_hb is not None:
                    fresh[k] = (raw_hb, hb)
            if hb is not None:
                out.heartbeats[k] = hb
            ids = [decode(x) for x in raw_running[0::2]]
            out.running[k] = dict(zip(ids, (decode(x) for x in raw_running[1::2]), strict=True))
            for j, values in zip(ids, raw_jobs, strict=True):
                if values[0] is not None:
                    out.jobs[j] = {
                        f: decode(v) for f, v in zip(RUNNING_JOB_FIELDS, values, strict=True)
                    }
        if pending:
            out.heads = {
                p: [decode(i) for i in ids] for p, ids in zip(PRIORITIES, raw_heads, strict=True)
            }
        out.head_fields = {
            decode(i): [decode(v) for v in values]
            for ids, got in zip(raw_heads, raw_facts, strict=True)
            for i, values in zip(ids, got, strict=False)
        }
        self._remember(out.heartbeats, fresh)
        return out

    def _remember(
        self, heartbeats: dict[str, dict[str, Any]], fresh: dict[str, tuple[bytes, Any]]
    ) -> None:
        """Resolve the catalogs of the heartbeats parsed now and keep each device's latest
        (raw, parsed) pair: a heartbeat changes once a second, a busy scheduler reads the farm
        many times a second, and parsing every device's document each time was most of a
        cycle on a large farm. Catalogs no live heartbeat names are let go."""
        missing = self._with_catalogs(hb for _, hb in fresh.values())
        gone = {id(hb) for hb in missing}
        parsed = {k: v for k, v in self._parsed.items() if k in heartbeats and k not in fresh}
        parsed.update((k, v) for k, v in fresh.items() if id(v[1]) not in gone)
        self._parsed = parsed
        if len(self._catalogs) > 64:
            named = {id(hb.get("models")) for hb in heartbeats.values()}
            self._catalogs = {
                d: c for d, c in self._catalogs.items() if id(c.get("models")) in named
            }

    # -- place, fail, requeue, forget (the leader scheduler) -----------------------------------

    def place(
        self,
        token: str,
        job_id: str,
        priority: int,
        device: str,
        dispatch: str,
        estimate: int,
        tier: str,
        evict: Iterable[str],
        message: tuple[str, str],
        tiling: Mapping[str, Any] | None = None,
    ) -> int:
        """1 placed (and its Celery message `(queue list, body)` pushed), 0 no longer queued,
        NOT_LEADER. `tiling` is the job's VAE tiling plan on that device (the JSON of
        sdfarm.native.tiling.TilingPlan), kept in the record for its worker."""
        placing = Placement(job_id, priority, device, dispatch, estimate, tier, tuple(evict),
                            message, tiling)  # fmt: skip
        return int(self._lua["place"](*self._place_call(token, placing)))

    def place_many(self, token: str, placements: Sequence[Placement]) -> list[int]:
        """`place` for each of `placements`, in order, in one round trip (a pipeline: each
        is its own atomic step, as a `place` call is); their return codes in order."""
        if not placements:
            return []
        pipe = self.r.pipeline(transaction=False)
        for placing in placements:
            self._lua["place"](*self._place_call(token, placing), client=pipe)
        return [int(rc) for rc in pipe.execute()]

    @staticmethod
    def _place_call(token: str, p: Placement) -> tuple[list[Any], list[Any]]:
        """The keys and arguments of place.lua for `p`."""
        queue, body = p.message
        plan = json.dumps(dict(p.tiling)) if p.tiling is not None else ""
        tiled = bool(p.tiling and p.tiling.get("tiled"))
        placed = event("placed", device=p.device, tier=p.tier, evict=list(p.evict),
                       estimate=p.estimate, tiled=tiled)  # fmt: skip
        return (
            [
                keys.job_key(p.job_id),
                keys.pending_key(p.priority),
                keys.running_key(p.device),
                PENDING_COUNT_KEY,
                keys.events_key(p.job_id),
                LEADER_KEY,
                queue,
            ],
            [token, p.job_id, p.dispatch, p.device, placed, p.estimate, p.tier, EVENTS_CAP,
             body, JOB_TTL, plan],
        )  # fmt: skip

    def fail(
        self,
        token: str,
        job_id: str,
        priority: int,
        error: str,
        figures: Sequence[Mapping[str, Any]],
        estimate: int,
    ) -> int:
        """A queued job that can never run fails with its estimate and the figures: 1 failed,
        0 no longer queued, NOT_LEADER."""
        return int(
            self._lua["fail"](
                keys=[
                    keys.job_key(job_id),
                    keys.pending_key(priority),
                    PENDING_COUNT_KEY,
                    keys.events_key(job_id),
                    keys.done_key(job_id),
                    LEADER_KEY,
                    *METRICS_KEYS,
                    WEBHOOKS_KEY,
                ],
                args=[
                    token,
                    job_id,
                    error,
                    json.dumps(list(figures)),
                    event("failed", error=error, estimate=estimate),
                    EVENTS_CAP,
                    RESULT_TTL,
                    estimate,
                ],
            )
        )

    def requeue(
        self,
        token: str,
        job_id: str,
        job: Mapping[str, str],
        device: str,
        *,
        reason: str,
        count: bool,
        max_attempts: int,
        poison_error: str,
    ) -> int:
        """A job `device` lost goes back to the front of its list (1), fails as poison when
        this lost run reaches `max_attempts` (2), or ends cancelled when a cancel was asked
        for (3); 0 when it moved on meanwhile (`job` holds the state and dispatch the caller
        saw); NOT_LEADER."""
        attempts = int(job.get("attempts") or 0) + int(count)
        return int(
            self._lua["requeue"](
                keys=[
                    keys.job_key(job_id),
                    keys.running_key(device),
                    keys.pending_key(int(job.get("priority") or 5)),
                    PENDING_COUNT_KEY,
                    keys.events_key(job_id),
                    keys.done_key(job_id),
                    LEADER_KEY,
                    keys.cancel_key(job_id),
                    *METRICS_KEYS,
                    WEBHOOKS_KEY,
                ],
                args=[
                    token,
                    job_id,
                    job["state"],
                    job["dispatch"],
                    new_dispatch_id(),
                    "1" if count else "0",
                    max_attempts,
                    device,
                    event(
                        "retried", device=device, reason=reason, attempts=attempts, counted=count
                    ),
                    event("failed", error=poison_error, device=device, reason="poison"),
                    event("cancelled", device=device, reason=reason),
                    poison_error,
                    EVENTS_CAP,
                    RESULT_TTL,
                    JOB_TTL,
                ],
            )  # fmt: skip
        )

    def overdue(self, token: str, job_id: str, dispatch: str, device: str, error: str) -> int:
        """A placed or running job of `dispatch` past its deadline fails with `error`, and its
        worker is asked to stop it: 1, 0 when it moved on, NOT_LEADER."""
        return int(
            self._lua["overdue"](
                keys=[
                    keys.job_key(job_id),
                    keys.running_key(device),
                    keys.events_key(job_id),
                    keys.done_key(job_id),
                    LEADER_KEY,
                    keys.cancel_key(job_id),
                    *METRICS_KEYS,
                    WEBHOOKS_KEY,
                ],
                args=[
                    token,
                    job_id,
                    dispatch,
                    error,
                    event("failed", error=error, device=device, reason="deadline"),
                    EVENTS_CAP,
                    RESULT_TTL,
                ],
            )
        )

    def lost_runs(self, job_id: str) -> tuple[str, str]:
        """(the job's stored load records JSON, the devices that lost it so far)."""
        records, lost_on = self.r.hmget(keys.job_key(job_id), ["records", "lost_on"])
        return decode(records), decode(lost_on)

    def forget(self, token: str, device: str, job_id: str, dispatch: str) -> int:
        """Drop a stale `running` entry if it still names `dispatch`: 1, 0, or NOT_LEADER."""
        return int(
            self._lua["forget"](
                keys=[keys.running_key(device), LEADER_KEY], args=[token, job_id, dispatch]
            )
        )

    def drop_stale(self, job_id: str, priority: int) -> int:
        """Remove a pending entry whose record is gone or no longer queued."""
        return int(
            self._lua["drop_stale"](
                keys=[keys.job_key(job_id), keys.pending_key(priority), PENDING_COUNT_KEY],
                args=[job_id],
            )
        )

    def pending_fields(self, job_ids: Sequence[str]) -> dict[str, list[str]]:
        """{id: PENDING_JOB_FIELDS values} of queued jobs the snapshot did not read."""
        return dict(zip(job_ids, self.jobs_fields(job_ids, PENDING_JOB_FIELDS), strict=True))

    def publish_config(self, queue_limit: int, backlog: int) -> None:
        """What clients read of the leader's configuration (the queue limit)."""
        self.r.hset(CONFIG_KEY, mapping={"queue_limit": queue_limit, "backlog": backlog})

    def preference(self, owner: str, name: str) -> str | None:
        """A caller's setting (`owner`: a token's fingerprint, "" on an open gateway), or None.
        Bounded by the tokens and the few names the gateway sets (PREFS_KEY)."""
        raw = self.r.hget(PREFS_KEY, f"{owner}:{name}")
        return raw.decode() if raw is not None else None

    def set_preference(self, owner: str, name: str, value: str) -> None:
        self.r.hset(PREFS_KEY, f"{owner}:{name}", value)

    def wait_for_wake(self, timeout: float) -> None:
        """Block until something nudges the scheduler (a submit, a freed device) or timeout."""
        self.r.blpop([WAKE_KEY], timeout=timeout)

    def forget_device(self, device_key: str) -> None:
        """A device dead for long: it leaves the known set (its worker re-adds it)."""
        self.r.srem(DEVICES_KEY, device_key)

    # -- the leader lease ------------------------------------------------------------------------

    def take_lease(self, token: str, ttl_ms: int) -> bool:
        """True when the lease was free and is now `token`'s."""
        return bool(self.r.set(LEADER_KEY, token, nx=True, px=ttl_ms))

    def renew_lease(self, token: str, ttl_ms: int) -> bool:
        return bool(self._lua["lease_renew"](keys=[LEADER_KEY], args=[token, ttl_ms]))

    def release_lease(self, token: str) -> bool:
        return bool(self._lua["lease_release"](keys=[LEADER_KEY], args=[token]))

    def lease_holder(self) -> str | None:
        value = self.r.get(LEADER_KEY)
        return decode(value) if value is not None else None

    # -- claim, loaded, progress, finish (the worker) ----------------------------------------------

    def claim(self, job_id: str, dispatch: str, incarnation: str, worker: str) -> Claim | None:
        """The Claim when this message may run the job; None when it is stale."""
        started = time.time()
        got = self._lua["claim"](
            keys=[
                keys.job_key(job_id),
                keys.events_key(job_id),
                keys.cancel_key(job_id),
                *METRICS_KEYS,
            ],
            args=[
                dispatch,
                incarnation,
                repr(started),
                event("running", incarnation=incarnation, worker=worker),
                EVENTS_CAP,
                worker,
                JOB_TTL,
            ],
        )
        if not got:
            return None
        spec, created, estimate, cancelled, tiling = got
        try:
            created_t = float(decode(created)) if created else started
        except ValueError:
            created_t = started
        est = decode(estimate)
        plan = loads(tiling, None)
        return Claim(decode(spec), created_t, started, int(est) if est.isdigit() else 0,
                     bool(cancelled), plan if isinstance(plan, dict) else None)  # fmt: skip

    def loaded(self, job_id: str, records: list[dict[str, Any]]) -> bool:
        """Keep a load's log records in the job record; True when a cancel came meanwhile."""
        return bool(
            self._lua["loaded"](
                keys=[keys.job_key(job_id), keys.cancel_key(job_id)], args=[json.dumps(records)]
            )
        )

    def publish_progress(self, job_id: str, step: int, steps: int, s_per_step: float) -> bool:
        """The job's latest step and its step event; True when a cancel is asked for."""
        doc = {"step": step, "steps": steps, "s_per_step": round(float(s_per_step), 4)}
        return bool(
            self._lua["progress"](
                keys=[keys.progress_key(job_id), keys.events_key(job_id), keys.cancel_key(job_id)],
                args=[json.dumps(doc), event("step", **doc), EVENTS_CAP, RESULT_TTL, JOB_TTL],
            )
        )

    def publish_preview(self, job_id: str, fields: Mapping[str, Any]) -> None:
        """The job's latest preview (sdfarm.native.preview: step, size, the image base64) as
        its `preview` event; the events list keeps only the newest one (lua/preview.lua)."""
        self._lua["preview"](
            keys=[keys.preview_key(job_id), keys.events_key(job_id)],
            args=[event("preview", **fields), EVENTS_CAP, RESULT_TTL, JOB_TTL],
        )

    def push_event(self, job_id: str, kind: str, **fields: Any) -> None:
        self._lua["event"](
            keys=[keys.events_key(job_id)], args=[event(kind, **fields), EVENTS_CAP, JOB_TTL]
        )

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self.r.exists(keys.cancel_key(job_id)))

    def finish(
        self,
        job_id: str,
        dispatch: str,
        device_key: str,
        state: str,
        *,
        error: str = "",
        meta: dict[str, Any] | None = None,
        records: list[dict[str, Any]] | None = None,
        pngs: list[bytes] | None = None,
        count: int | None = None,
        job_fields: dict[str, str] | None = None,
        load_s: float | None = None,
        generate_s: float | None = None,
        **event_fields: Any,
    ) -> bool:
        """End a running job of `dispatch` (done, failed, cancelled) with everything that goes
        with it, atomically: `meta`, `records` and the images land in `result:{id}` when
        `meta` is given, `job_fields` in the record (a worker's memory refusal writes
        `figures` and `estimate` there, as placement's refusal does). `load_s` (a load this
        job waited for) and `generate_s` are observed in the farm's histograms, in the same
        step that counts the end (sdfarm.store.metrics). `count`: how many images the job
        has when they live in another result store than Redis (`pngs` then empty; the
        record's `results` field says where). False when the job is no longer running under
        `dispatch`."""
        if state not in FINAL_STATES:
            raise ValueError(f"not a final state: {state!r}")
        if error:
            event_fields["error"] = error
        extra = [x for kv in (job_fields or {}).items() for x in kv]
        images = [x for i, data in enumerate(pngs or []) for x in (f"png:{i}", data)]
        return bool(
            self._lua["finish"](
                keys=[
                    keys.job_key(job_id),
                    keys.result_key(job_id),
                    keys.done_key(job_id),
                    keys.events_key(job_id),
                    keys.running_key(device_key),
                    WAKE_KEY,
                    keys.progress_key(job_id),
                    RECENT_KEY,
                    PENDING_COUNT_KEY,
                    keys.cancel_key(job_id),
                    *METRICS_KEYS,
                    keys.preview_key(job_id),
                    WEBHOOKS_KEY,
                ],
                args=[
                    dispatch,
                    state,
                    error,
                    repr(time.time()),
                    event(state, **event_fields),
                    EVENTS_CAP,
                    RESULT_TTL,
                    job_id,
                    "" if meta is None else json.dumps(meta, default=str),
                    json.dumps(records or []),
                    len(pngs or []) if count is None else count,
                    WAKE_CAP,
                    RECENT_CAP,
                    _seconds(load_s),
                    _seconds(generate_s),
                    len(extra),
                    *extra,
                    *images,
                ],
            )
        )

    # -- webhooks (the leader scheduler; sdfarm.scheduler.webhooks) ------------------------------

    def take_webhooks(self, token: str, lease_s: float, most: int) -> list[tuple[str, int]]:
        """The due webhooks as (job id, this try's number), each hidden from the next take
        for `lease_s` seconds (the try's time to be sent and settled); a token that does not
        hold the leader lease takes nothing ([]): a standby never sends."""
        out = self._lua["webhook_take"](
            keys=[WEBHOOKS_KEY, LEADER_KEY], args=[token, lease_s, most, keys.JOB_PREFIX]
        )
        if not isinstance(out, list):
            return []
        return [(decode(out[i]), int(out[i + 1])) for i in range(0, len(out), 2)]

    def settle_webhook(
        self, job_id: str, outcome: str, delay_s: float = 0.0, **event_fields: Any
    ) -> bool:
        """One try's outcome: `retry` (due again in `delay_s`), `delivered` or `failed` (the
        last try), with a `webhook` job event; False when it was no longer queued."""
        if outcome not in ("retry", "delivered", "failed"):
            raise ValueError(f"not a webhook outcome: {outcome!r}")
        return bool(
            self._lua["webhook_settle"](
                keys=[WEBHOOKS_KEY, keys.job_key(job_id), keys.events_key(job_id)],
                args=[
                    job_id,
                    outcome,
                    delay_s,
                    event("webhook", outcome=outcome, **event_fields),
                    EVENTS_CAP,
                    RESULT_TTL,
                ],
            )
        )

    def webhooks_queued(self) -> dict[str, float]:
        """{job id: when its next try is due} of every queued webhook (tests, operators)."""
        return {decode(k): float(v) for k, v in self.r.zrange(WEBHOOKS_KEY, 0, -1, withscores=True)}

    # -- the Redis result store's total (sdfarm.store.results) -------------------------------

    def reserve_result(self, job_id: str, size: int, cap: int) -> tuple[int, int]:
        """(1 reserved, 0 refused, -1 the job's result is already written by another run;
        bytes held): room for `size` PNG bytes of job `job_id` in Redis, unless the results
        held (those not yet expired) and this one would pass `cap`."""
        ok, total = self._lua["results_reserve"](
            keys=[*keys.RESULTS_KEYS, keys.result_key(job_id)],
            args=[job_id, size, cap, RESULT_TTL],
        )
        return int(ok), int(total)

    def release_result(self, job_id: str) -> None:
        """Give back a reservation whose result was not written (the job was not ours);
        a result another run wrote keeps its share."""
        self._lua["results_release"](
            keys=[*keys.RESULTS_KEYS, keys.result_key(job_id)], args=[job_id]
        )

    def results_held(self) -> int:
        """PNG bytes the Redis result store counts now (expired ones leave at a reserve)."""
        return int(decode(self.r.get(keys.RESULTS_BYTES_KEY)) or 0)

    def delete_keys(self, job_id: str) -> int:
        """Every key of an ended job, atomically: 1 deleted, 0 no such job, -1 the job is
        live (cancel it first). The images in another store are the caller's to delete
        first (sdfarm.store.results.delete_job does both)."""
        names = keys.job_keys(job_id)
        return int(
            self._lua["delete"](
                keys=[*names, RECENT_KEY, *keys.RESULTS_KEYS], args=[job_id, len(names)]
            )
        )

    # -- heartbeats and queues (the worker) ----------------------------------------------------

    def beat(self, device_key: str, doc: Mapping[str, Any], ttl_s: float) -> None:
        """Write the device's heartbeat with a TTL and add it to the known devices. Its
        catalog goes first, under its digest, with the same TTL (records.split_heartbeat), so
        a reader that sees the heartbeat finds the catalog."""
        text, digest, catalog = split_heartbeat(doc)
        ttl = int(ttl_s * 1000)
        pipe = self.r.pipeline(transaction=False)
        if digest:
            pipe.set(keys.facts_key(digest), catalog, px=ttl)
        pipe.set(keys.heartbeat_key(device_key), text, px=ttl)
        pipe.sadd(DEVICES_KEY, device_key)
        pipe.execute()

    def withdraw(self, device_key: str) -> None:
        """A graceful stop: the scheduler sees the device gone at once."""
        self.r.delete(keys.heartbeat_key(device_key))

    def queue_length(self, device_key: str) -> int:
        """Messages waiting in the device's Celery queue (every priority list); the message a
        worker has reserved is not counted."""
        pipe = self.r.pipeline(transaction=False)
        for name in transport.queue_lists(device_key):
            pipe.llen(name)
        return int(sum(pipe.execute()))

    # -- tests and operators ---------------------------------------------------------------------

    def ttls(self, job_id: str) -> dict[str, int]:
        """{key: TTL in seconds} of every key job `job_id` has now (-1: none set)."""
        names = keys.job_keys(job_id)
        pipe = self.r.pipeline(transaction=False)
        for name in names:
            pipe.ttl(name)
        return {n: int(t) for n, t in zip(names, pipe.execute(), strict=True) if int(t) != -2}


def _float(raw: Any) -> float | None:
    try:
        return float(decode(raw))
    except ValueError:
        return None


def _seconds(value: float | None) -> str:
    """A duration for a script: "" for none (the script then observes nothing)."""
    return "" if value is None else repr(max(0.0, float(value)))
