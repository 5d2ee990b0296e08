"""The farm as the scheduler sees it: every heartbeat turned into a placement `DeviceState`.

Workers write one heartbeat JSON per device (`hb:{host}/{device}`, with a TTL) and add the
device to the `devices` set; the scheduler owns `running:{device}` (job id -> dispatch id),
so a device's queued work is counted from the scheduler's own writes and never lags a
heartbeat. The conversions are pure functions (tested in tests/unit/test_registry.py);
`Registry.snapshot` is the only I/O: one Lua script per scheduler cycle.

Heartbeat fields read here (missing ones take the default shown, so an older or newer worker
still places):

| field | meaning | default |
|---|---|---|
| `host`, `device` | names (the key also carries them) | from the key |
| `type` | cpu / gpu / igpu (accel counts as gpu) | cpu |
| `free`, `total` | the device's bytes as ggml reports them | 0 |
| `mem_available` | the host's MemAvailable | `free` |
| `memory_limit` | the worker's --memory-limit in bytes (null: none) | null |
| `compute_figure`, `slow_figure`, `capacity` | figures the worker computed itself | derived |
| `loaded` | engines: list of {name, estimate, busy, pinned, idle_since} | [] |
| `models` | {name: {bytes, native_size: [w, h], decode_per_pixel}} the worker can load | {} |
| `accepting` | false while draining | true |
| `incarnation` | the id of the process that runs jobs | "" |
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sdfarm.native.devices import Device, gpu_figure
from sdfarm.native.memory import estimate_bytes
from sdfarm.scheduler.placement import DeviceState, LoadedModel
from sdfarm.worker import protocol

DEFAULT_BACKLOG = 2
DEFAULT_QUEUE_LIMIT = 10_000
DEFAULT_NATIVE_SIZE = (512, 512)

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
)
"""What the scheduler reads of each job that sits in a `running:{device}` hash."""

PENDING_JOB_FIELDS = ("state", "model", "submitter", "created", "spec")
"""What the scheduler reads of a queued job to place it (once per job: it keeps them)."""


# -- pure conversions ---------------------------------------------------------------------------


def _int(value: Any, default: int = 0) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return default


def device_type(hb: Mapping[str, Any]) -> str:
    """Placement knows cpu / gpu / igpu; an accelerator computes like a discrete GPU."""
    t = str(hb.get("type") or "cpu").lower()
    return "gpu" if t == "accel" else t if t in ("cpu", "gpu", "igpu") else "cpu"


def loaded_models(hb: Mapping[str, Any]) -> tuple[LoadedModel, ...]:
    """The engines a heartbeat lists (a list of dicts, or a {name: info} mapping)."""
    raw = hb.get("loaded") or []
    items: Iterable[tuple[str, Any]]
    if isinstance(raw, Mapping):
        items = raw.items()
    else:
        items = ((str(m.get("name", "")), m) for m in raw if isinstance(m, Mapping))
    out = []
    for name, info in items:
        if not name:
            continue
        info = info if isinstance(info, Mapping) else {}
        busy = bool(info.get("busy")) or info.get("state") in ("busy", "loading")
        try:
            idle = float(info.get("idle_since") or info.get("last_used") or 0.0)
        except (TypeError, ValueError):
            idle = 0.0
        out.append(
            LoadedModel(
                name=name,
                estimate=_int(info.get("estimate", info.get("bytes", 0))),
                busy=busy,
                pinned=bool(info.get("pinned")),
                idle_since=idle,
            )
        )
    return tuple(sorted(out, key=lambda m: m.name))


def own_figure(hb: Mapping[str, Any]) -> int:
    """The bytes a new model may use on this device now, before any --memory-limit cap: a
    discrete GPU's figure by the seed's rules (free, or total without a budget, 0 over budget);
    host memory (MemAvailable) for the CPU and integrated GPUs, whose own figures count the
    same RAM again."""
    if device_type(hb) == "gpu":
        dev = Device(
            0, str(hb.get("device", "")), "", "gpu", _int(hb.get("free")), _int(hb.get("total"))
        )
        return gpu_figure(dev) or 0
    return _int(hb.get("mem_available", hb.get("free")))


def host_slow_figures(heartbeats: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """{host: its discrete GPUs' figures + MemAvailable}: the slower path's figure, which
    spans every GPU of the host, so it is summed over that host's heartbeats."""
    gpus: dict[str, int] = {}
    mem: dict[str, int] = {}
    for key, hb in heartbeats.items():
        host = str(hb.get("host") or key.split("/", 1)[0])
        mem[host] = max(mem.get(host, 0), _int(hb.get("mem_available", hb.get("free"))))
        if device_type(hb) == "gpu":
            gpus[host] = gpus.get(host, 0) + own_figure(hb)
    return {h: gpus.get(h, 0) + mem[h] for h in mem}


def device_state(
    key: str,
    hb: Mapping[str, Any],
    *,
    queued: int = 0,
    backlog_limit: int = DEFAULT_BACKLOG,
    host_slow: int | None = None,
) -> DeviceState:
    """One live heartbeat as placement's `DeviceState`.

    Figures the worker sent (`compute_figure`, `slow_figure`, `capacity`) are taken as they are
    (the worker applied its own --memory-limit). Otherwise they are derived: compute = the
    device's own figure; slow = `host_slow` for a GPU (the host's GPUs + MemAvailable), the
    compute figure for host-memory devices; capacity = compute + what the engines hold. A
    `memory_limit` then caps them: a worker never holds more than its limit, so what is left
    of it after the loaded engines bounds compute and slow, and the limit bounds capacity.
    """
    host, _, device = key.partition("/")
    loaded = loaded_models(hb)
    held = sum(m.estimate for m in loaded)
    typ = device_type(hb)
    compute = own_figure(hb)
    slow = compute if typ != "gpu" or host_slow is None else max(compute, host_slow)
    capacity = compute + held
    if typ == "gpu" and _int(hb.get("total")) > 0:
        capacity = min(capacity, _int(hb.get("total")))
    limit = hb.get("memory_limit")
    if limit is not None:
        limit = _int(limit)
        left = max(0, limit - held)
        compute, slow, capacity = min(compute, left), min(slow, left), min(capacity, limit)
    if "compute_figure" in hb:
        compute = _int(hb["compute_figure"])
    if "slow_figure" in hb:
        slow = _int(hb["slow_figure"])
    if "capacity" in hb:
        capacity = _int(hb["capacity"])
    return DeviceState(
        host=str(hb.get("host") or host),
        device=str(hb.get("device") or device),
        type=typ,
        compute_figure=compute,
        slow_figure=max(slow, compute),
        capacity=max(capacity, compute),
        loaded=loaded,
        queued=queued,
        backlog_limit=backlog_limit,
        alive=True,
        accepting=bool(hb.get("accepting", True)),
    )


def dead_state(key: str, queued: int = 0, backlog_limit: int = DEFAULT_BACKLOG) -> DeviceState:
    """A device whose heartbeat expired: placement skips it and a refusal counts it as dead."""
    host, _, device = key.partition("/")
    return DeviceState(
        host=host,
        device=device,
        type="cpu",
        compute_figure=0,
        slow_figure=0,
        capacity=0,
        queued=queued,
        backlog_limit=backlog_limit,
        alive=False,
    )


def account(
    state: DeviceState, model: str, estimate: int, evict: Iterable[str] = (), sent: int = 1
) -> DeviceState:
    """The device as it will be once a job for `model` runs there, before any heartbeat says
    so: `sent` more queued jobs, `evict`ed engines gone, the model counted as loaded (busy) and
    its estimate taken from the figures. Used for every job sent in a pass and for jobs already
    sent whose model the heartbeat does not list yet, so two jobs of one model go where the
    first one's load is, and two new models are not put on a device that holds one."""
    evicted = set(evict)
    gone = sum(m.estimate for m in state.loaded if m.name in evicted)
    kept = [m for m in state.loaded if m.name not in evicted]
    taken = 0
    if any(m.name == model for m in kept):
        kept = [replace(m, busy=True) if m.name == model else m for m in kept]
    else:
        kept.append(LoadedModel(model, max(0, estimate), busy=True))
        taken = max(0, estimate)
    return replace(
        state,
        loaded=tuple(sorted(kept, key=lambda m: m.name)),
        queued=state.queued + sent,
        compute_figure=max(0, state.compute_figure + gone - taken),
        slow_figure=max(0, state.slow_figure + gone - taken),
    )


def _model_items(hb: Mapping[str, Any]) -> Iterable[tuple[str, Mapping[str, Any]]]:
    """(name, info) of each model a heartbeat lists (a {name: info} dict or a list)."""
    raw = hb.get("models") or {}
    items: Iterable[tuple[str, Any]]
    if isinstance(raw, Mapping):
        items = raw.items()
    else:
        items = ((str(m.get("name", "")), m) for m in raw if isinstance(m, Mapping))
    return ((name, info) for name, info in items if name and isinstance(info, Mapping))


def heartbeat_models(hb: Mapping[str, Any]) -> dict[str, tuple[int, tuple[int, int]]]:
    """{name: (bytes, native size)} a heartbeat's worker can load (a dict or a list)."""
    out = {}
    for name, info in _model_items(hb):
        size = info.get("native_size") or DEFAULT_NATIVE_SIZE
        try:
            native = (int(size[0]), int(size[1]))
        except (TypeError, ValueError, IndexError):
            native = DEFAULT_NATIVE_SIZE
        out[name] = (_int(info.get("bytes", info.get("total_bytes", 0))), native)
    return out


ModelFactsT = tuple[int, tuple[int, int], int]
"""(bytes, native size, decode bytes per output pixel) of a model, as placement uses them."""


def decode_per_pixel(hb: Mapping[str, Any], name: str) -> int:
    """What the heartbeat's device adds per output pixel to `name`'s estimate for its decode
    (the full VAE without direct convolution on CUDA; 0 when the worker does not say)."""
    for listed, info in _model_items(hb):
        if listed == name:
            return _int(info.get("decode_per_pixel"))
    return 0


def model_facts(heartbeats: Mapping[str, Mapping[str, Any]], name: str) -> ModelFactsT | None:
    """(bytes, native size, decode per pixel) of `name` from every heartbeat that lists it;
    hosts whose copies or decode paths differ give the largest (the cautious estimate: one
    estimate per job, valid on every device that may get it). None: no live worker has it."""
    found = [
        (facts, decode_per_pixel(hb, name))
        for hb in heartbeats.values()
        if (facts := heartbeat_models(hb).get(name)) is not None
    ]
    if not found:
        return None
    native = min((f[0][1] for f in found), key=lambda s: s[0] * s[1])
    return max(f[0][0] for f in found), native, max(f[1] for f in found)


def estimate_for(facts: ModelFactsT, width: int, height: int) -> int:
    """The job's estimate: the seed's rule grown with the image size, plus the decode term the
    workers report (native/memory.py)."""
    model_bytes, (nw, nh), decode = facts
    return estimate_bytes(model_bytes, int(width), int(height), nw * nh, decode_per_pixel=decode)


def spec_size(spec: Mapping[str, Any]) -> tuple[int, int]:
    """(width, height) of a JobSpec as a dict (the `spec` field of a job record, parsed)."""
    params = spec.get("params") or {}
    return _int(params.get("width"), 256) or 256, _int(params.get("height"), 256) or 256


def parse_heartbeat(raw: bytes | str | None) -> dict[str, Any] | None:
    """A heartbeat value, or None when absent or unreadable (counted as dead: a worker that
    writes garbage must not get jobs)."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


# -- the snapshot --------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """The farm at one instant, for one scheduler cycle (or `sdfarm status`).

    `heartbeats`: live devices' heartbeat dicts by key; `devices`: a DeviceState for every known
    device (dead ones with alive=False), with jobs already sent accounted; `running`:
    {device: {job id: dispatch id}}; `jobs`: the RUNNING_JOB_FIELDS of those jobs; `heads`:
    the first ids of each pending list by priority, when the snapshot was asked for them, and
    `head_fields` the PENDING_JOB_FIELDS of the first few of them.
    """

    heartbeats: dict[str, dict[str, Any]] = field(default_factory=dict)
    devices: list[DeviceState] = field(default_factory=list)
    running: dict[str, dict[str, str]] = field(default_factory=dict)
    jobs: dict[str, dict[str, str]] = field(default_factory=dict)
    heads: dict[int, list[str]] = field(default_factory=dict)
    head_fields: dict[str, list[str]] = field(default_factory=dict)

    def model_facts(self, name: str) -> ModelFactsT | None:
        return model_facts(self.heartbeats, name)

    def job_estimate(self, spec: Mapping[str, Any]) -> int | None:
        """Estimate of a job (JobSpec fields as a dict) at its own size; None: unknown model."""
        facts = self.model_facts(str(spec.get("model", "")))
        if facts is None:
            return None
        return estimate_for(facts, *spec_size(spec))

    def models(self) -> list[str]:
        names: set[str] = set()
        for hb in self.heartbeats.values():
            names.update(heartbeat_models(hb))
        return sorted(names)

    def running_by_submitter(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for job in self.jobs.values():
            s = job.get("submitter", "")
            counts[s] = counts.get(s, 0) + 1
        return counts


def build_devices(
    heartbeats: Mapping[str, Mapping[str, Any]],
    known: Iterable[str],
    running: Mapping[str, Mapping[str, str]],
    jobs: Mapping[str, Mapping[str, str]],
    backlog_limit: int = DEFAULT_BACKLOG,
) -> list[DeviceState]:
    """Every known device as a DeviceState, sorted by key; a live device's queued count is
    its `running:{device}` length, and models of jobs sent there that its heartbeat does not
    list are counted as loading (`account` with sent=0)."""
    slow = host_slow_figures(heartbeats)
    out = []
    for key in sorted(set(known) | set(heartbeats)):
        entries = running.get(key, {})
        hb = heartbeats.get(key)
        if hb is None:
            out.append(dead_state(key, len(entries), backlog_limit))
            continue
        host = str(hb.get("host") or key.split("/", 1)[0])
        state = device_state(
            key, hb, queued=len(entries), backlog_limit=backlog_limit, host_slow=slow.get(host)
        )
        for job_id in sorted(entries):
            job = jobs.get(job_id) or {}
            if job.get("model") and job.get("state") in ("placed", "running"):
                state = account(state, job["model"], _int(job.get("estimate")), sent=0)
        out.append(state)
    return out


SNAPSHOT_LUA = """
-- KEYS: devices set, wake, pending lists (0 or more)
-- ARGV: clear wake (0/1), heartbeat key prefix, running key prefix, job key prefix, heads to
--       read per pending list, how many of them to read the fields of, n, then n fields to
--       read of running jobs, then the fields to read of pending jobs
local known = redis.call('SMEMBERS', KEYS[1])
if ARGV[1] == '1' then redis.call('DEL', KEYS[2]) end
local n = tonumber(ARGV[7])
local fields, pfields = {}, {}
for i = 8, 7 + n do fields[#fields + 1] = ARGV[i] end
for i = 8 + n, #ARGV do pfields[#pfields + 1] = ARGV[i] end
local devices = {}
for i, d in ipairs(known) do
  local hb = redis.call('GET', ARGV[2] .. d)
  local running = redis.call('HGETALL', ARGV[3] .. d)
  local jobs = {}
  for j = 1, #running, 2 do
    jobs[#jobs + 1] = redis.call('HMGET', ARGV[4] .. running[j], unpack(fields))
  end
  devices[i] = {d, hb, running, jobs}
end
local heads, facts = {}, {}
local scan, nfacts = tonumber(ARGV[5]), tonumber(ARGV[6])
for i = 3, #KEYS do
  local ids = redis.call('LRANGE', KEYS[i], 0, scan - 1)
  local got = {}
  for j = 1, math.min(nfacts, #ids) do
    got[j] = redis.call('HMGET', ARGV[4] .. ids[j], unpack(pfields))
  end
  heads[#heads + 1] = ids
  facts[#facts + 1] = got
end
return {devices, heads, facts}
"""
"""The whole farm in one round trip (heartbeats, running entries and their jobs, the heads of
the pending lists and the fields of the first few: a job submitted to an idle farm is placed
without a second read), and optionally the `wake` nudges cleared in the same atomic step, so a
nudge that lands after the read is never lost. It names heartbeat, running and job keys it
builds from prefixes: fine on one Redis (the farm's), not on a Redis Cluster."""


class Registry:
    """Reads the farm's state from Redis (`redis.Redis` client, decode_responses off)."""

    def __init__(self, client: Any, backlog_limit: int = DEFAULT_BACKLOG) -> None:
        self.r = client
        self.backlog_limit = backlog_limit
        self._script = client.register_script(SNAPSHOT_LUA)

    def snapshot(self, heads: int = 0, clear_wake: bool = False, facts: int = 4) -> Snapshot:
        """The farm now; with `heads` > 0 also the first `heads` ids of every pending list
        (`Snapshot.heads`, by priority) and the PENDING_JOB_FIELDS of the first `facts` of
        each (`Snapshot.head_fields`); `clear_wake` empties the wake list atomically."""
        pending = [protocol.pending_key(p) for p in protocol.PRIORITIES] if heads > 0 else []
        raw_devices, raw_heads, raw_facts = self._script(
            keys=[protocol.DEVICES_KEY, protocol.WAKE_KEY, *pending],
            args=[
                "1" if clear_wake else "0",
                protocol.heartbeat_key(""),
                protocol.running_key(""),
                protocol.job_key(""),
                heads,
                facts,
                len(RUNNING_JOB_FIELDS),
                *RUNNING_JOB_FIELDS,
                *PENDING_JOB_FIELDS,
            ],
        )
        known, heartbeats, running, jobs = [], {}, {}, {}
        for raw_key, raw_hb, raw_running, raw_jobs in raw_devices:
            k = protocol.decode(raw_key)
            known.append(k)
            hb = parse_heartbeat(raw_hb)
            if hb is not None:
                heartbeats[k] = hb
            ids = [protocol.decode(x) for x in raw_running[0::2]]
            running[k] = dict(
                zip(ids, (protocol.decode(x) for x in raw_running[1::2]), strict=True)
            )
            for j, values in zip(ids, raw_jobs, strict=True):
                if values[0] is not None:
                    jobs[j] = {
                        f: protocol.decode(v)
                        for f, v in zip(RUNNING_JOB_FIELDS, values, strict=True)
                    }
        devices = build_devices(heartbeats, known, running, jobs, self.backlog_limit)
        by_priority = {
            p: [protocol.decode(i) for i in ids]
            for p, ids in zip(protocol.PRIORITIES if pending else (), raw_heads, strict=True)
        }
        head_fields = {
            protocol.decode(i): [protocol.decode(v) for v in values]
            for ids, got in zip(raw_heads, raw_facts, strict=True)
            for i, values in zip(ids, got, strict=False)
        }
        return Snapshot(
            heartbeats=heartbeats,
            devices=devices,
            running=running,
            jobs=jobs,
            heads=by_priority,
            head_fields=head_fields,
        )
