"""The records the farm keeps in Redis: the job record, its events, the result, the heartbeat.

Every value of a Redis hash is a string; these helpers turn records into strings and back, so
the client, the scheduler, the worker and the gateway read them one way.

Job record `job:{id}` (hash), written at submit and then by each transition:

| field | set by | what |
|---|---|---|
| id, spec, model, kind, priority, submitter, owner | submit | the request (`spec`: JobSpec JSON) |
| state | every transition | queued, placed, running, done, failed, cancelled |
| created | submit (Redis clock) | when it was queued |
| deadline | submit | seconds the job may take once placed (then it fails, its worker stops) |
| estimate | place, fail | the job's memory estimate in bytes (the worker and engine use it) |
| tiling | place | the VAE tiling plan the worker's engine obeys: {tiled, estimate, warning} |
| device, dispatch, tier, placed | place | where it went and the dispatch id its message carries |
| attempts, lost_on | requeue | lost runs and the devices that lost them |
| started, incarnation, worker | claim | when and which worker process runs it |
| ahead | claim_ahead, until start | claimed during the job before it, not begun yet (when) |
| spared | restore_held | its process died running another job: its loss is not counted |
| records | worker after a load | the load's log records (for a poison report) |
| inputs | submit | the key of the job's input images, when it has some |
| ended, error | the end | when it ended (done, failed, cancelled) and why it failed |
| figures | fail, worker refusal | the memory figures of a refusal (JSON list) |

`kind` is generate or upscale; `model` names the engine the job needs: a model, or for an
upscale job `upscaler:NAME` (`upscaler_key`).

Result `result:{id}` (hash): `png:0` .. `png:{count-1}` (PNG bytes, each with its parameters in
a text chunk), `count`, `meta` (JSON: the parameters with the resolved seed, job, model, host,
device, device_key, backend, sd_version, estimate, fit_plan, warnings, timings {queued_s,
load_s, warmup_s, worker_pre_s, generate_s, encode_s, begun_at: when the worker began the run,
epoch seconds by its clock}) and `records` (JSON list of {seq, level, message,
source, location} at the job's log level). A failed job has `meta` (with `error`) and
`records`, no images.

Events (`events:{id}`, JSON with `event` and `t`): queued, placed, running (claimed: device,
incarnation), loading (model, estimate) and loaded (model, load_s, warmup_s) when the job made
the worker load a model, step (step, steps, s_per_step; at most 10 a second), preview (a job
with `preview_every`: seq, step, steps, width, height, format, image as base64, at most
MAX_PREVIEW_BYTES before base64; only the newest stays in the list, also in `preview:{id}`),
done, failed (error), cancelled, retried.

Heartbeat `hb:{host}/{device}` (JSON, see HEARTBEAT_FIELDS), written every HEARTBEAT_INTERVAL
by the worker process that runs the jobs and deleted on a graceful stop. Its catalog (`models`,
`loras`: the bulk of it, and the same on every device of one model folder) is stored apart
under the digest of its JSON (`facts:{digest}`, CATALOG_FIELDS) and put back by every read.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

STATES = ("queued", "placed", "running", "done", "failed", "cancelled")
FINAL_STATES = ("done", "failed", "cancelled")

RUNNING_JOB_FIELDS = (
    "state",
    "dispatch",
    "device",
    "model",
    "estimate",
    "submitter",
    "priority",
    "incarnation",
    "attempts",
    "placed",
    "started",
    "ahead",
    "spared",
    "deadline",
)
"""What the scheduler reads of each job that sits in a `running:{device}` hash."""

PENDING_JOB_FIELDS = ("state", "model", "submitter", "created", "spec")
"""What the scheduler reads of a queued job to place it (once per job: it keeps them)."""

HEARTBEAT_FIELDS = {
    "host": "the host's name in the farm",
    "device": "the device as the host lists it: CPU, Vulkan1, CUDA0",
    "key": "{host}/{device}",
    "backend": "CPU, Vulkan, CUDA or Metal",
    "type": "cpu, gpu, igpu or accel",
    "description": "the device's description",
    "free": "the device's free bytes at the worker's start (ggml)",
    "total": "the device's total bytes (ggml)",
    "capacity": "what our engines may hold together: the device's figure, capped by --memory-limit",
    "compute_figure": "capacity minus the estimates of the loaded engines",
    "slow_figure": "a GPU: its remaining figure + MemAvailable; CPU: compute_figure",
    "mem_available": "the host's MemAvailable now",
    "loaded": "[{name, estimate, busy, pinned, idle_since, idle_s, slot}] the engines held "
    "(with N slots a model may be listed once per slot)",
    "loading": "the model being loaded, or null",
    "models": "{name: {bytes, native_size: [w, h], decode_per_pixel}} the models it can load",
    "bad_models": "{name: error} models in its folders that do not load",
    "loras": "{name: bytes} the LoRA files it can apply",
    "upscalers": "{name: {bytes, scale, tile_per_pixel, overhead}} the upscalers it can load",
    "queue": "messages waiting in its Celery queue",
    "state": "idle, loading or busy",
    "current_job": "the job it runs, or null",
    "unwritten": "{job: why} jobs whose end Redis refused; the worker keeps trying",
    "version": "{sdfarm, sd}",
    "incarnation": "a uuid per worker process: a new one means its running job was lost "
    "(with --engines N > 1: the worker's, made at its start)",
    "pid": "the worker process (with N > 1 slots: the worker's main process)",
    "slots": "engine slots (--engines N): jobs the device runs at once, each on its own engine",
    "incarnations": "N > 1: each live slot's process uuid (a running job's claim is checked "
    "against these)",
    "current_jobs": "N > 1: the jobs the slots run",
    "pids": "N > 1: the slots' processes",
    "memory_limit": "--memory-limit in bytes, or null",
    "keep_alive": "seconds an idle engine stays loaded",
    "ts": "when it was written (the worker's clock)",
}
"""Every field of a heartbeat, as the worker writes it (sizes in bytes)."""


def decode(value: bytes | str | None) -> str:
    """A Redis reply as text ("" for nothing)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def decode_hash(raw: dict[Any, Any]) -> dict[str, str]:
    return {decode(k): decode(v) for k, v in raw.items()}


def loads(raw: Any, default: Any) -> Any:
    """JSON from Redis, or `default` when absent or unreadable."""
    if raw in (None, b"", ""):
        return default
    try:
        return json.loads(raw)
    except (ValueError, TypeError):
        return default


def new_job_id() -> str:
    return uuid.uuid4().hex


def new_dispatch_id() -> str:
    return uuid.uuid4().hex


JOB_KINDS = ("generate", "upscale", "video")
"""What a job does: generate images with a model, upscale an image with an upscaler, or make a
video with a (Wan) model (sdfarm.native.video_params)."""
UPSCALER_PREFIX = "upscaler:"
"""An upscale job's `model`: the engine it needs, `upscaler:NAME`, so the engine cache, the
heartbeat's loaded engines and placement name an upscaler apart from a model of that name."""


def upscaler_key(name: str) -> str:
    """The engine name of upscaler `name` (a job's `model`, an engine cache key)."""
    return UPSCALER_PREFIX + name


def upscaler_name(model: str) -> str | None:
    """The upscaler an engine name stands for, or None for a model."""
    return model[len(UPSCALER_PREFIX) :] if model.startswith(UPSCALER_PREFIX) else None


@dataclass(frozen=True)
class JobSpec:
    """What a client asks for: a job kind, the engine it needs (a model, or `upscaler:NAME`),
    its parameters (GenerationParams or UpscaleParams fields, validated by the client and
    again by the worker before any native call) and the job's options. `owner` names who may
    read the job back through the gateway (a token's fingerprint; "" for anyone with access
    to the farm). `test_hook` is honoured only by workers started with SDFARM_TEST_HOOKS=1."""

    model: str
    params: dict[str, Any]
    kind: str = "generate"
    # The job options (sdfarm.native.params.JobOptions, field for field):
    priority: int = 5
    submitter: str = "anonymous"
    log_level: str = "none"
    log_prompts: bool = False
    deadline_s: float = 3600.0
    webhook: str = ""
    # Set by the farm, not by the caller:
    owner: str = ""
    test_hook: str | None = None

    def to_json(self) -> str:
        doc = asdict(self)
        if doc["test_hook"] is None:
            del doc["test_hook"]
        return json.dumps(doc, sort_keys=True)


def new_job_record(job_id: str, spec: JobSpec) -> dict[str, str]:
    """The `job:{id}` hash a submit writes (the script adds `created` by the Redis clock)."""
    return {
        "id": job_id,
        "spec": spec.to_json(),
        "model": spec.model,
        "kind": spec.kind,
        "priority": str(spec.priority),
        "submitter": spec.submitter,
        "owner": spec.owner,
        "state": "queued",
        "deadline": repr(float(spec.deadline_s)),
        "webhook": spec.webhook,
        "estimate": "",
        "attempts": "0",
        "device": "",
        "dispatch": "",
        "error": "",
    }


def event(kind: str, **fields: Any) -> str:
    """One event as stored in `events:{id}`."""
    return json.dumps({"event": kind, "t": time.time(), **fields}, default=str)


@dataclass(frozen=True)
class Claim:
    """A successful claim: the job's spec JSON, when it was created and when this worker
    started it, the estimate the scheduler placed it with (0 when none was recorded),
    whether a cancel was asked for before it started, and the VAE tiling plan it was placed
    with (the JSON of sdfarm.native.tiling.TilingPlan; None when none was recorded)."""

    spec: str
    created: float
    started: float
    estimate: int
    cancelled: bool
    tiling: dict[str, Any] | None = None


class Began(NamedTuple):
    """A worker process's start mark (sdfarm.worker.startmark): the job whose run it began
    last, under which dispatch, and the process's incarnation."""

    job_id: str
    dispatch: str
    incarnation: str


@dataclass
class JobResult:
    """A job's record and result hash as a waiting client reads them after the end."""

    record: dict[str, str]
    pngs: list[bytes] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    records: list[Any] = field(default_factory=list)

    @property
    def state(self) -> str:
        return self.record.get("state", "")

    @classmethod
    def parse(cls, raw_record: dict[Any, Any], raw_result: dict[Any, Any]) -> JobResult:
        record = decode_hash(raw_record)
        res = {decode(k): v for k, v in raw_result.items()}
        records = loads(res.get("records"), None)
        if records is None:
            records = loads(record.get("records"), [])
        count = int(decode(res.get("count")) or 0)
        pngs = [res[f"png:{i}"] for i in range(count) if f"png:{i}" in res]
        return cls(record, pngs, loads(res.get("meta"), {}), records)


CATALOG_FIELDS = ("models", "loras")
"""The heartbeat fields that change only when a worker's model folders do: stored once per
distinct catalog (`facts:{digest}`), so a scheduler cycle reads a small document per device."""
CATALOG_REF = "facts"
"""The field of a stored heartbeat that names its catalog's digest."""


def split_heartbeat(doc: Mapping[str, Any]) -> tuple[str, str, str]:
    """(the heartbeat without its catalog, the catalog's digest, the catalog) as JSON; the
    digest is "" when the document has no catalog fields (then it is stored whole)."""
    catalog = {k: doc[k] for k in CATALOG_FIELDS if k in doc}
    if not catalog:
        return json.dumps(doc), "", ""
    text = json.dumps(catalog, sort_keys=True)
    digest = hashlib.sha1(text.encode()).hexdigest()
    rest = {k: v for k, v in doc.items() if k not in CATALOG_FIELDS}
    rest[CATALOG_REF] = digest
    return json.dumps(rest), digest, text


def parse_heartbeat(raw: bytes | str | None) -> dict[str, Any] | None:
    """A heartbeat value, or None when absent or unreadable (counted as dead: a worker that
    writes garbage must not get jobs)."""
    doc = loads(raw, None) if raw is not None else None
    return doc if isinstance(doc, dict) else None
