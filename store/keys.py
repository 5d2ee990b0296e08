"""Every Redis key of a farm, and how long each lives. No other module builds a key name.

One farm per Redis database; every key starts with PREFIX. A job's keys all expire: each
has JOB_TTL from the moment it is written while the job is live, and RESULT_TTL from the
moment the job ends (done, failed or cancelled). The farm-wide keys below the line are the
only ones without a TTL; each is bounded (a capped list, a set of devices, a hash per device).

| key | type | TTL | what (written by) |
|---|---|---|---|
| `job:{id}` | hash | JOB_TTL, then RESULT_TTL | the job record (client, scheduler, worker) |
| `events:{id}` | list | JOB_TTL, then RESULT_TTL | the newest EVENTS_CAP events as JSON (all) |
| `progress:{id}` | string | RESULT_TTL | the latest step of a running job (worker) |
| `preview:{id}` | string | RESULT_TTL | a running job's latest preview; gone at finish (worker) |
| `cancel:{id}` | string | RESULT_TTL | a cancel request for a placed or running job (client) |
| `result:{id}` | hash | RESULT_TTL | `png:{i}`, `count`, `meta`, `records` (worker) |
| `input:{id}` | hash | JOB_TTL, then RESULT_TTL | the job's input images by name (client) |
| `done:{id}` | list | RESULT_TTL | one token once the job ended; waiters block on it (all) |
| `events:{id}` channel | pub/sub | - | each event appended to the list, published too (all) |
| `owned:{owner}` | zset | JOB_TTL | an owner's jobs admitted under a live-jobs quota (client) |
| `hb:{host}/{device}` | string | HEARTBEAT_TTL | a device's heartbeat, catalog by digest (worker) |
| `facts:{digest}` | string | HEARTBEAT_TTL | a catalog (`models`, `loras`) devices share (worker) |
| `leader` | string | the lease | the active scheduler's token (scheduler) |
| `rate:{...}` | string | 2 windows | a caller's count in one rate window (gateway, `limits`) |
| farm-wide, no TTL: | | | |
| `pending:{priority}` | list | - | ids of jobs waiting to be placed, 0 first (client, scheduler) |
| `pending:count` | string | - | how many jobs wait; the queue limit counts these |
| `running:{host}/{device}` | hash | - | job id -> dispatch id sent there (scheduler, worker) |
| `devices` | set | - | every device that sent a heartbeat; forgotten an hour after death |
| `wake` | list | - | nudges for the scheduler, at most WAKE_CAP (all) |
| `config` | hash | - | `queue_limit`, `backlog` (scheduler) |
| `recent` | list | - | the last RECENT_CAP finished job ids, newest first (worker) |
| `prefs` | hash | - | `{owner}:{name}` -> a caller's setting, e.g. its default model (gateway) |
| `metrics:jobs` | hash | - | kind, model, device (joined by a bar) -> jobs counted as they happen |
| `metrics:seconds` | hash | - | histogram, model, device, bucket or `sum` -> counts, sums |
| `webhooks` | zset | - | job id -> when its webhook's next try is due (all; scheduler) |
| `results:bytes` | string | - | PNG bytes the Redis result store holds now (worker, delete) |
| `results:sizes` | hash | - | job id -> PNG bytes of each result held in Redis (worker, delete) |
| `results:expiry` | zset | - | job id -> when its result expires (uncounted then) |

The Celery queues (`sdfarm.{host}.{device}` and kombu's priority lists) are named in
`sdfarm.store.transport`, the one module that knows Celery's wire format, and so is each
queue's `.held` hash (no TTL; one message per engine slot: the one it last took from the
queue itself, put back if its process dies before claiming the job).
"""

from __future__ import annotations

import os

PREFIX = "sdfarm:"

JOB_TTL = 7 * 24 * 3600
"""A live job's keys: a job nobody places or runs for a week is gone (the scheduler then drops
its id from the pending list, and a waiting client is told the job is unknown)."""
RESULT_TTL = int(os.environ.get("SDFARM_RESULT_TTL") or 24 * 3600)
"""Every key of a finished job: its record, result, events and tokens ($SDFARM_RESULT_TTL
seconds; every process of a farm must see the same value)."""
HEARTBEAT_TTL = 5.0
HEARTBEAT_INTERVAL = 1.0

EVENTS_CAP = 200
WAKE_CAP = 100
RECENT_CAP = 32
PRIORITIES = range(10)  # 0 = interactive (placed first) ... 9 = batch

JOB_KEY_KINDS = ("job", "events", "progress", "preview", "cancel", "result", "done", "input")
"""The kinds of key one job creates; `job_keys(id)` names them all."""


def key(*parts: str) -> str:
    return PREFIX + ":".join(parts)


def job_key(job_id: str) -> str:
    return key("job", job_id)


def events_key(job_id: str) -> str:
    return key("events", job_id)


def events_channel(job_id: str) -> str:
    """The pub/sub channel every event of the job is published on (by the scripts' `log`, in
    the same step that appends it): the events key's own name, so a script needs no more
    arguments to publish. The gateway's waiters and event streams subscribe to it."""
    return events_key(job_id)


def progress_key(job_id: str) -> str:
    return key("progress", job_id)


def preview_key(job_id: str) -> str:
    return key("preview", job_id)


def cancel_key(job_id: str) -> str:
    return key("cancel", job_id)


def result_key(job_id: str) -> str:
    return key("result", job_id)


def done_key(job_id: str) -> str:
    return key("done", job_id)


def input_key(job_id: str) -> str:
    return key("input", job_id)


JOB_PREFIX = key("job", "")
"""`job:` ids are appended to (the scripts that read other jobs' records: submit's quota)."""


def owned_key(owner: str) -> str:
    """The jobs `owner` (a gateway token's fingerprint) submitted under a live-jobs quota: ids
    scored by submit time, ended ones pruned at its next submit, so it holds at most the
    quota; JOB_TTL from its last submit."""
    return key("owned", owner)


def job_keys(job_id: str) -> list[str]:
    """Every key job `job_id` may create (for tests and deletion)."""
    return [key(kind, job_id) for kind in JOB_KEY_KINDS]


def heartbeat_key(device_key: str) -> str:
    return key("hb", device_key)


def facts_key(digest: str) -> str:
    """A heartbeat's catalog (its `models` and `loras`) under the digest of its JSON: every
    device of one catalog names the same key, so the scheduler reads it once, not per cycle."""
    return key("facts", digest)


def running_key(device_key: str) -> str:
    return key("running", device_key)


def pending_key(priority: int) -> str:
    return key("pending", str(priority))


def device_key(host: str, device: str) -> str:
    """`{host}/{device}`: how the farm names one device of one host."""
    return f"{host}/{device}"


RATE_PREFIX = key("rate")
"""The gateway's rate-limit counters: the `limits` package names them below this prefix
(`sdfarm:rate:{gateway/<caller>/<n>/<seconds>/second}`, and that with `/-1`: its sliding
window's current and previous counts) and sets their TTLs itself (two windows); see
sdfarm.gateway.ratelimit."""
LEADER_KEY = key("leader")
PENDING_COUNT_KEY = key("pending", "count")
DEVICES_KEY = key("devices")
WAKE_KEY = key("wake")
CONFIG_KEY = key("config")
RECENT_KEY = key("recent")
PREFS_KEY = key("prefs")
METRICS_JOBS_KEY = key("metrics", "jobs")
METRICS_SECONDS_KEY = key("metrics", "seconds")
METRICS_KEYS = (METRICS_JOBS_KEY, METRICS_SECONDS_KEY)
RESULTS_BYTES_KEY = key("results", "bytes")
RESULTS_SIZES_KEY = key("results", "sizes")
RESULTS_EXPIRY_KEY = key("results", "expiry")
RESULTS_KEYS = (RESULTS_BYTES_KEY, RESULTS_SIZES_KEY, RESULTS_EXPIRY_KEY)
"""What the Redis result store holds (sdfarm.store.results): the total its cap is checked
against, each result's size and expiry. Bounded by that cap: an entry per result held."""
"""The farm's counters and histograms (`sdfarm.store.metrics`): the transition scripts that
count take them as their last two KEYS. Bounded: at most METRICS_SERIES_CAP series each."""
WEBHOOKS_KEY = key("webhooks")
"""Ended jobs whose webhook is not delivered yet: job id -> when its next try is due (Redis
clock). The scripts that end a job add it in the same step (`notify` in prelude.lua); the
leader scheduler takes, sends and settles them (sdfarm.scheduler.webhooks). An entry leaves
once delivered, once its last try failed, or when its job's record expired."""
WEBHOOKS_CAP = 10_000
"""Webhooks the queue may hold; a job ending while it is full gets a failed delivery event
(a farm whose receivers are all down, or with no scheduler, cannot grow it without bound)."""
METRICS_SERIES_CAP = 2000
"""Series (kind or histogram, model, device) each metrics hash may hold; past it a new model
name is counted as `_other` (a client naming models at random cannot grow them)."""

FARM_WIDE = (
    key("pending", ""),
    PENDING_COUNT_KEY,
    key("running", ""),
    DEVICES_KEY,
    WAKE_KEY,
    CONFIG_KEY,
    RECENT_KEY,
    PREFS_KEY,
    METRICS_JOBS_KEY,
    METRICS_SECONDS_KEY,
    WEBHOOKS_KEY,
    *RESULTS_KEYS,
)
"""The keys without a TTL (a name, or a prefix ending in ':'), each bounded as the table says."""


def farm_wide(name: str) -> bool:
    """True for a key of FARM_WIDE, the only ones that may live without a TTL."""
    return any(name == k or (k.endswith(":") and name.startswith(k)) for k in FARM_WIDE)
