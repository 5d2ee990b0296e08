"""What workers, the scheduler and clients agree on in Redis: key names, the job record, the
result record and the events. The worker owns this module (data flows client -> scheduler ->
worker), so the scheduler and the client import it and never the other way round.

Keys (prefix `sdfarm:` by default, one farm per Redis database):

| key | type | written by | what |
|---|---|---|---|
| `job:{id}` | hash | client, scheduler, worker | the job record (JOB_FIELDS) |
| `pending:{priority}` | list | client (RPUSH), scheduler | job ids waiting to be placed |
| `pending:count` | string | client, scheduler | total jobs waiting (queue limit) |
| `result:{id}` | hash | worker | `png:{i}`, `meta`, `records` (TTL) |
| `done:{id}` | list | worker, scheduler | one element when the job ends (clients BLPOP) |
| `events:{id}` | list | everyone | the job's events as JSON, capped (SSE replay) |
| `progress:{id}` | string | worker | latest `{"step", "steps", "s_per_step"}` |
| `hb:{host}/{device}` | string | worker | heartbeat JSON with a TTL |
| `devices` | set | worker | every `{host}/{device}` that ever sent a heartbeat |
| `wake` | list | everyone | nudges the scheduler (BLPOP) |
| `leader` | string | scheduler | the active scheduler's id, with a TTL |
| `cancel:{id}` | string | client | a cancel request for a running job |
| `running:{host}/{device}` | hash | scheduler | job id -> dispatch id sent to that device |
| `config` | hash | scheduler | `queue_limit`, `backlog` |
| `sdfarm.{host}.{device}` | list | Celery | the device's Celery queue (no prefix) |

Job record fields the worker adds (all strings): `started` (time.time() of the claim),
`incarnation` (the worker process's uuid), `worker` (Celery hostname:pid), `records` (JSON list
of the engine's load records, written before generating, so a crash leaves them for the
poison report), `ended` (time.time() of the final state), `error` (failed only).

Result hash `result:{id}` (TTL RESULT_TTL): `png:0` .. `png:{count-1}` (PNG bytes, each with
the generation parameters in its `sdfarm` text chunk, see sdfarm.native.png), `count`,
`meta` (JSON: the parameters with the resolved seed, job, model, host, device, device_key,
backend, sd_version, estimate, fit_plan, warnings, timings {queued_s, load_s, warmup_s,
generate_s, encode_s}) and `records` (JSON list of {seq, level, message, source,
location} at the job's log level). A failed job has `meta` (with `error`) and `records` but no
images.

Heartbeat `hb:{host}/{device}` (JSON, SET every HEARTBEAT_INTERVAL with HEARTBEAT_TTL, by the
pool process that runs the jobs; deleted on a graceful stop): host, device (as the host lists
it: CPU, Vulkan1, CUDA0), key, backend (CPU / Vulkan / CUDA / Metal), type (cpu, gpu, igpu,
accel), description, free and total (startup probe), capacity (the device's figure when our
engines hold nothing, capped by --memory-limit), compute_figure (capacity minus the estimates
of loaded engines), slow_figure (a GPU: its remaining figure + MemAvailable; CPU: =
compute_figure), mem_available, loaded ([{name, estimate, busy, pinned, idle_since, idle_s}]),
loading (model name or null), models ({name: {bytes, native_size: [w, h], decode_per_pixel}}
for every model in the worker's directories; decode_per_pixel is what this device's VAE decode
adds to the estimate per output pixel), bad_models ({name: error}), queue (messages waiting
in its Celery queue), state (idle / loading / busy), current_job, version ({sdfarm, sd}),
incarnation (a uuid per pool process: a change means the process was replaced and its running
job is lost), pid, memory_limit, keep_alive, ts. All sizes in bytes.

Events (`events:{id}`, JSON with `event` and `t`): queued, placed, running (claimed: device,
incarnation), loading (model, estimate) and loaded (model, load_s, warmup_s) only when the
job made the worker load a model, step (step, steps, s_per_step; at most 10/s), done,
failed (error), cancelled, retried.

Flows (every step also appends an event to `events:{id}`):

1. submit (client): validate params with sdfarm.native.params.validate; refuse with
   FarmBusyError when `pending:count` >= the queue limit (`config` hash, field `queue_limit`,
   written by the scheduler); HSET `job:{id}` (new_job_record), RPUSH `pending:{priority}`,
   INCR `pending:count`, LPUSH `wake`.
2. place (the leader scheduler, woken by BLPOP `wake` with a short timeout): read heartbeats,
   walk pending jobs in fair-share order, compute each job's estimate from the model facts
   the heartbeats carry (`models`: bytes + native size, through
   sdfarm.native.memory.estimate_bytes at the job's size), call placement.place. Placed:
   HSET job state=placed, device, dispatch=<new uuid>; HSET `running:{device}` id dispatch;
   LREM the pending list; DECR `pending:count`; LPUSH the Celery task TASK_NAME with args
   [job_id, dispatch] on queue_name(device) (sdfarm.scheduler.outbox), all in one script.
   Refuse: state=failed with the reason and figures, RPUSH `done:{id}` "failed". Wait: leave
   it pending.
3. run (the worker's task): claim atomically (CLAIM_LUA: state must be placed and dispatch
   must match, else the message is stale and is dropped: this is what keeps a job from
   running twice); state=running, incarnation=<the worker process's id>; engine from the
   cache (event `loading` when it loads); generate, publishing `progress:{id}` and `step`
   events; then hand the images to the uploader thread and return, so PNG encoding and the
   upload never delay the next generation. The uploader writes `result:{id}` (TTL), sets
   state=done (or failed with `error`), HDELs `running:{device}`, RPUSHes `done:{id}`,
   LPUSHes `wake` when jobs are pending, all in one FINISH_LUA call (one round trip on the
   path of every job). It acts only while the job is still `running` under this dispatch
   id, so a worker whose job was re-placed meanwhile (flow 5) cannot overwrite the new run;
   a reader that sees a final state always sees the complete result. The worker also ends
   jobs itself (failed: invalid parameters, unknown model, load or generation
   errors; cancelled) through FINISH_LUA.
4. wait (client): if the job record is final read the result, else BLPOP `done:{id}` and
   push the token back for other waiters.
5. recover (scheduler): a device whose heartbeat expired, or whose `incarnation` differs
   from the one a running job recorded, lost that job: attempts += 1; at 2 the job fails as
   poison with the last records the worker stored in the job's `records` field; otherwise
   it goes back to the front of its pending list with a new dispatch id.
6. cancel (client): queued -> removed from pending, state=cancelled; placed/running -> SET
   `cancel:{id}`; the worker checks it before it starts and while it runs (master-596 has
   no cancel call, so the worker ends its own process; Celery starts a fresh one and the
   engine is loaded again). A cancel seen before generation starts (at the claim or after
   the load) ends the job without ending the process; only a cancel during generation
   costs the process (and the engines it held). The worker writes every finished result
   of earlier jobs before it ends itself.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

PREFIX = "sdfarm:"
TASK_NAME = "sdfarm.generate"
RESULT_TTL = 24 * 3600
EVENTS_CAP = 200
HEARTBEAT_INTERVAL = 1.0
HEARTBEAT_TTL = 5.0
MAX_RESULT_BYTES = 64 * 1024 * 1024
PRIORITIES = range(10)  # 0 = interactive (first) ... 9 = batch

STATES = ("queued", "placed", "running", "done", "failed", "cancelled")
FINAL_STATES = ("done", "failed", "cancelled")


def key(*parts: str) -> str:
    return PREFIX + ":".join(parts)


def job_key(job_id: str) -> str:
    return key("job", job_id)


def result_key(job_id: str) -> str:
    return key("result", job_id)


def done_key(job_id: str) -> str:
    return key("done", job_id)


def events_key(job_id: str) -> str:
    return key("events", job_id)


def progress_key(job_id: str) -> str:
    return key("progress", job_id)


def cancel_key(job_id: str) -> str:
    return key("cancel", job_id)


def pending_key(priority: int) -> str:
    return key("pending", str(priority))


def heartbeat_key(device_key: str) -> str:
    return key("hb", device_key)


def running_key(device_key: str) -> str:
    return key("running", device_key)


WAKE_KEY = key("wake")
DEVICES_KEY = key("devices")
LEADER_KEY = key("leader")
PENDING_COUNT_KEY = key("pending", "count")
CONFIG_KEY = key("config")
RECENT_KEY = key("recent")
RECENT_CAP = 32
"""`recent`: the ids of the last RECENT_CAP finished jobs, newest first (the status page's
thumbnails)."""


def device_key(host: str, device: str) -> str:
    return f"{host}/{device}"


def queue_name(device_key: str) -> str:
    """The Celery queue of one device: `sdfarm.{host}.{device}`."""
    return "sdfarm." + device_key.replace("/", ".")


def new_job_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class JobSpec:
    """What a client asks for. `params` are GenerationParams fields (validated by the client
    and again by the worker before any native call)."""

    model: str
    params: dict[str, Any]
    priority: int = 5
    submitter: str = "anonymous"
    log_level: str = "none"
    log_prompts: bool = False

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        return cls(**json.loads(text))


def new_job_record(job_id: str, spec: JobSpec, estimate: int) -> dict[str, str]:
    """The initial `job:{id}` hash. Every value is a string (Redis hashes)."""
    now = time.time()
    return {
        "id": job_id,
        "spec": spec.to_json(),
        "model": spec.model,
        "priority": str(spec.priority),
        "submitter": spec.submitter,
        "state": "queued",
        "estimate": str(estimate),
        "created": repr(now),
        "attempts": "0",
        "device": "",
        "dispatch": "",
        "error": "",
    }


def event(kind: str, **fields: Any) -> str:
    """One event as stored in `events:{id}`: queued, placed, loading, step, done, failed,
    cancelled, retried."""
    return json.dumps({"event": kind, "t": time.time(), **fields})


def decode(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


# -- worker-side atomic steps (flow 3) --------------------------------------------------------

CLAIM_LUA = """
-- KEYS: job, events, cancel   ARGV: dispatch, incarnation, started, event, events_cap, worker
local cur = redis.call('HMGET', KEYS[1], 'state', 'dispatch', 'spec', 'created')
if cur[1] ~= 'placed' or cur[2] ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'running', 'started', ARGV[3],
           'incarnation', ARGV[2], 'worker', ARGV[6])
redis.call('RPUSH', KEYS[2], ARGV[4])
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[5]), -1)
return {cur[3] or '', cur[4] or '', redis.call('EXISTS', KEYS[3])}
"""
"""Claim a placed job for this dispatch: its spec, created time and whether a cancel is
already asked for, in the same round trip (the start of every job is on the critical path);
0 when the message is stale."""

FINISH_LUA = """
-- KEYS: job, result, done, events, running, wake, progress, recent, pending count
-- ARGV: dispatch, state, error, ended, event, events_cap, ttl, job_id, meta, records, count,
--       n (how many job field ARGVs follow), n job field ARGVs (name, value pairs), then
--       the result's image fields (png:0, bytes, png:1, bytes, ...)
local cur = redis.call('HMGET', KEYS[1], 'state', 'dispatch')
if cur[1] ~= 'running' or cur[2] ~= ARGV[1] then
  return 0
end
local ttl = tonumber(ARGV[7])
local n = tonumber(ARGV[12])
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'error', ARGV[3], 'ended', ARGV[4])
if n > 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 13, 12 + n))
end
if ARGV[9] ~= '' then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'meta', ARGV[9], 'records', ARGV[10], 'count', ARGV[11])
  if #ARGV > 12 + n then
    redis.call('HSET', KEYS[2], unpack(ARGV, 13 + n))
  end
  redis.call('EXPIRE', KEYS[2], ttl)
end
if redis.call('HGET', KEYS[5], ARGV[8]) == ARGV[1] then
  redis.call('HDEL', KEYS[5], ARGV[8])
end
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('EXPIRE', KEYS[3], ttl)
redis.call('RPUSH', KEYS[4], ARGV[5])
redis.call('LTRIM', KEYS[4], -tonumber(ARGV[6]), -1)
redis.call('EXPIRE', KEYS[4], ttl)
if redis.call('EXISTS', KEYS[7]) == 1 then
  redis.call('EXPIRE', KEYS[7], ttl)
end
if tonumber(redis.call('GET', KEYS[9]) or '0') > 0 then
  redis.call('LPUSH', KEYS[6], ARGV[8])
  redis.call('LTRIM', KEYS[6], 0, 999)
end
if ARGV[2] == 'done' then
  redis.call('LPUSH', KEYS[8], ARGV[8])
  redis.call('LTRIM', KEYS[8], 0, RECENT_LAST)
end
return 1
"""
FINISH_LUA = FINISH_LUA.replace("RECENT_LAST", str(RECENT_CAP - 1))
"""End a running job of this dispatch: result images and meta, final state, running entry,
done token, event (1), in one round trip; a job that is no longer ours is left alone (0). It
wakes the scheduler only when jobs are pending (the freed slot is news only to them): an
idle farm's scheduler then does not compete with the client it just woke."""

CELERY_PRIORITY_STEPS = (0, 3, 6, 9)
"""kombu's redis transport keeps one list per priority step: `queue` and `queue\\x06\\x16{n}`."""


@dataclass(frozen=True)
class Claim:
    """What a successful claim returns: the job's spec JSON, when it was created, when this
    worker started it, and whether a cancel was asked for before it started."""

    spec: str
    created: float
    started: float
    cancelled: bool


def claim(client: Any, job_id: str, dispatch: str, incarnation: str, worker: str) -> Claim | None:
    """CLAIM_LUA: the Claim when this message may run the job, None when it is stale."""
    started = time.time()
    ev = event("running", incarnation=incarnation, worker=worker)
    got = client.register_script(CLAIM_LUA)(
        keys=[job_key(job_id), events_key(job_id), cancel_key(job_id)],
        args=[dispatch, incarnation, repr(started), ev, EVENTS_CAP, worker],
    )
    if not got:
        return None
    spec, created, cancelled = got
    try:
        created_t = float(decode(created)) if created else started
    except ValueError:
        created_t = started
    return Claim(decode(spec), created_t, started, bool(cancelled))


def finish(
    client: Any,
    job_id: str,
    dispatch: str,
    device_key: str,
    state: str,
    *,
    error: str = "",
    meta: dict[str, Any] | None = None,
    records: list[dict[str, Any]] | None = None,
    pngs: list[bytes] | None = None,
    job_fields: dict[str, str] | None = None,
    **event_fields: Any,
) -> bool:
    """FINISH_LUA: the final state (done, failed, cancelled) and everything that goes with
    it, atomically; `meta`/`records` and the images (`png:{i}`) land in `result:{id}` when
    `meta` is given, `job_fields` in the job
    record (a worker's memory refusal writes `figures` and `estimate` there, as placement's
    refusal does). False when the job is no longer running under `dispatch` (it was
    re-placed or ended by someone else)."""
    if state not in FINAL_STATES:
        raise ValueError(f"not a final state: {state!r}")
    fields = dict(event_fields)
    if error:
        fields["error"] = error
    ev = event(state, **fields)
    extra = [x for kv in (job_fields or {}).items() for x in kv]
    images = [x for i, data in enumerate(pngs or []) for x in (f"png:{i}", data)]
    return bool(
        client.register_script(FINISH_LUA)(
            keys=[
                job_key(job_id),
                result_key(job_id),
                done_key(job_id),
                events_key(job_id),
                running_key(device_key),
                WAKE_KEY,
                progress_key(job_id),
                RECENT_KEY,
                PENDING_COUNT_KEY,
            ],
            args=[
                dispatch,
                state,
                error,
                repr(time.time()),
                ev,
                EVENTS_CAP,
                RESULT_TTL,
                job_id,
                "" if meta is None else json.dumps(meta, default=str),
                json.dumps(records or []),
                len(pngs or []),
                len(extra),
                *extra,
                *images,
            ],
        )
    )


def push_event(client: Any, job_id: str, kind: str, **fields: Any) -> None:
    """Append one event to `events:{id}`, keeping the newest EVENTS_CAP."""
    k = events_key(job_id)
    pipe = client.pipeline(transaction=False)
    pipe.rpush(k, event(kind, **fields))
    pipe.ltrim(k, -EVENTS_CAP, -1)
    pipe.execute()


def read_events(client: Any, job_id: str) -> list[dict[str, Any]]:
    return [json.loads(e) for e in client.lrange(events_key(job_id), 0, -1)]


def celery_queue_length(client: Any, device_key: str) -> int:
    """Messages waiting in the device's Celery queue (every priority list); the message a
    worker has reserved is not counted."""
    q = queue_name(device_key)
    pipe = client.pipeline(transaction=False)
    for step in CELERY_PRIORITY_STEPS:
        pipe.llen(q if step == 0 else f"{q}\x06\x16{step}")
    return int(sum(pipe.execute()))
