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
   LREM the pending list; DECR `pending:count`; send the Celery task TASK_NAME with args
   [job_id, dispatch] to queue_name(device). Refuse: state=failed with the reason and figures,
   RPUSH `done:{id}` "failed". Wait: leave it pending.
3. run (the worker's task): claim atomically (CLAIM_LUA: state must be placed and dispatch
   must match, else the message is stale and is dropped: this is what keeps a job from
   running twice); state=running, incarnation=<the worker process's id>; engine from the
   cache (event `loading` when it loads); generate, publishing `progress:{id}` and `step`
   events; then hand the images to the uploader thread and return, so PNG encoding and the
   upload never delay the next generation. The uploader writes `result:{id}` (TTL), sets
   state=done (or failed with `error`), HDELs `running:{device}`, RPUSHes `done:{id}`,
   LPUSHes `wake`.
4. wait (client): if the job record is final read the result, else BLPOP `done:{id}` and
   push the token back for other waiters.
5. recover (scheduler): a device whose heartbeat expired, or whose `incarnation` differs
   from the one a running job recorded, lost that job: attempts += 1; at 2 the job fails as
   poison with the last records the worker stored in the job's `records` field; otherwise
   it goes back to the front of its pending list with a new dispatch id.
6. cancel (client): queued -> removed from pending, state=cancelled; placed/running -> SET
   `cancel:{id}`; the worker checks it before it starts and while it runs (master-596 has
   no cancel call, so the worker ends its own process; Celery starts a fresh one and the
   engine is loaded again).
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
