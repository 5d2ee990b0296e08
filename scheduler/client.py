"""The Python client: `Farm(redis_url).submit(...) -> Job`, `farm.map(prompts)` for batches.

A client talks to Redis only (flows 1, 4 and 6 of `sdfarm.worker.protocol`); it never needs the
scheduler to answer it. Parameters are validated here with the engine's own rules before
anything is queued, so a bad request fails in the caller's process, not on a worker minutes
later. Waiting is a BLPOP on `done:{id}` (the token is pushed back for other waiters), so a
finished job is seen within a Redis round trip, with no polling.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.logs import LEVELS
from sdfarm.native.params import GenerationParams, validate
from sdfarm.scheduler.fairness import FarmBusyError
from sdfarm.scheduler.registry import (
    DEFAULT_QUEUE_LIMIT,
    Registry,
    estimate_for,
    heartbeat_models,
    model_facts,
    parse_heartbeat,
)
from sdfarm.worker import protocol

__all__ = [
    "Farm",
    "FarmBusyError",
    "FarmError",
    "Job",
    "JobCancelled",
    "JobFailed",
    "Result",
    "UnknownModelError",
]

MAP_WINDOW = 256
WAIT_SLICE_S = 30.0
"""Longest single BLPOP: a wait forever is a loop of these, so a Redis that went away is
noticed (socket timeout) instead of hanging the caller."""
MODELS_CACHE_S = 1.0

# KEYS: job, pending list, pending count, events, wake, config
# ARGV: id, default queue limit, queued event, events cap, then the record's field/value pairs
_SUBMIT = """
local limit = tonumber(redis.call('HGET', KEYS[6], 'queue_limit') or ARGV[2])
local depth = tonumber(redis.call('GET', KEYS[3]) or '0')
if depth >= limit then return {0, depth, limit} end
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'created', t[1] .. '.' .. string.format('%06d', tonumber(t[2])))
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('INCR', KEYS[3])
redis.call('RPUSH', KEYS[4], ARGV[3])
redis.call('LTRIM', KEYS[4], -tonumber(ARGV[4]), -1)
redis.call('LPUSH', KEYS[5], '1')
redis.call('LTRIM', KEYS[5], 0, 99)
return {1, depth + 1, limit}
"""

# KEYS: job, pending count, events, done, cancel, pending list. ARGV: id, cancelled event,
# cap, ttl. Returns 1 cancelled while queued, 2 cancel requested (placed/running), 0 final.
_CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'queued' then
  local n = redis.call('LREM', KEYS[6], 0, ARGV[1])
  if n > 0 and redis.call('DECRBY', KEYS[2], n) < 0 then redis.call('SET', KEYS[2], 0) end
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'state', 'cancelled',
    'ended', t[1] .. '.' .. string.format('%06d', tonumber(t[2])))
  redis.call('RPUSH', KEYS[3], ARGV[2])
  redis.call('LTRIM', KEYS[3], -tonumber(ARGV[3]), -1)
  redis.call('RPUSH', KEYS[4], 'cancelled')
  for _, k in ipairs({KEYS[1], KEYS[3], KEYS[4]}) do redis.call('EXPIRE', k, ARGV[4]) end
  return 1
end
if state == 'placed' or state == 'running' then
  redis.call('SET', KEYS[5], '1', 'EX', ARGV[4])
  return 2
end
return 0
"""


class FarmError(Exception):
    """Base of the client's own errors (FarmBusyError comes from the fairness rules)."""


class UnknownModelError(FarmError, LookupError):
    """No worker of the farm has the model; `available` lists those it has."""

    def __init__(self, model: str, available: list[str]) -> None:
        super().__init__(
            f"unknown model {model!r}: the farm has {', '.join(available) or 'no models'}"
        )
        self.model = model
        self.available = available


class JobFailed(FarmError):
    """A job ended failed: `error` as the worker or scheduler wrote it, the log `records`
    (load and generation), and `figures`/`estimate` when placement refused it."""

    def __init__(
        self,
        job_id: str,
        error: str,
        records: list[Any] | None = None,
        figures: list[dict[str, Any]] | None = None,
        estimate: int | None = None,
    ) -> None:
        super().__init__(f"job {job_id} failed: {error}")
        self.job_id = job_id
        self.error = error
        self.records = records or []
        self.figures = figures or []
        self.estimate = estimate


class JobCancelled(FarmError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id} was cancelled")
        self.job_id = job_id


@dataclass
class Result:
    """A finished job's images (PNG bytes, parameters in a text chunk), metadata and logs."""

    job_id: str
    pngs: list[bytes]
    metadata: dict[str, Any] = field(default_factory=dict)
    records: list[Any] = field(default_factory=list)

    @property
    def png(self) -> bytes:
        """The first image."""
        return self.pngs[0]

    @property
    def image(self) -> Any:
        """The first image as a PIL image."""
        from PIL import Image

        img = Image.open(io.BytesIO(self.png))
        img.load()
        return img

    def save(self, path: str | os.PathLike[str]) -> list[Path]:
        """Write the first image to `path`, further ones to `name-1.png`, `name-2.png`, ..."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        written = []
        for i, png in enumerate(self.pngs):
            target = out if i == 0 else out.with_name(f"{out.stem}-{i}{out.suffix}")
            target.write_bytes(png)
            written.append(target)
        return written


def _json(raw: Any, default: Any) -> Any:
    if raw in (None, b"", ""):
        return default
    try:
        return json.loads(raw)
    except (ValueError, TypeError):
        return default


class Job:
    """A handle on one job; cheap to make from an id (`farm.job(id)`)."""

    def __init__(self, farm: Farm, job_id: str) -> None:
        self.farm = farm
        self.id = job_id

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    @property
    def _r(self) -> Any:
        return self.farm.r

    def record(self) -> dict[str, str]:
        raw = self._r.hgetall(protocol.job_key(self.id))
        return {protocol.decode(k): protocol.decode(v) for k, v in raw.items()}

    def state(self) -> str:
        """queued, placed, running, done, failed or cancelled ("" once the record expired)."""
        return protocol.decode(self._r.hget(protocol.job_key(self.id), "state"))

    def done(self) -> bool:
        return self.state() in protocol.FINAL_STATES

    def wait(self, timeout: float | None = None) -> str:
        """Block until the job is final; its state. TimeoutError after `timeout` seconds."""
        return self._wait(timeout)[0]

    def _wait(self, timeout: float | None) -> tuple[str, tuple[Any, Any] | None]:
        """The final state, and the raw job and result hashes when the wake-up read them
        (the round trip after the done token brings everything `result` needs)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = protocol.done_key(self.id)
        token_seen = False
        while True:
            state = self.state()
            if state in protocol.FINAL_STATES:
                return state, None
            if not state:
                raise FarmError(f"no job {self.id} (unknown, or expired)")
            if token_seen:  # a token with the state not yet final: never spin hot
                time.sleep(0.001)
            left = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {self.id} still {state} after {timeout} s")
            got = self._r.blpop([done], timeout=max(0.001, min(left, WAIT_SLICE_S)))
            if got:
                token_seen = True
                pipe = self._r.pipeline(transaction=False)
                pipe.rpush(done, got[1])  # leave it for other waiters
                pipe.hgetall(protocol.job_key(self.id))
                pipe.hgetall(protocol.result_key(self.id))
                _, raw_rec, raw = pipe.execute()
                state = protocol.decode(raw_rec.get(b"state"))
                if state in protocol.FINAL_STATES:
                    return state, (raw_rec, raw)

    def result(self, timeout: float | None = None) -> Result:
        """The images; JobFailed / JobCancelled / TimeoutError otherwise."""
        state, read = self._wait(timeout)
        if state == "cancelled":
            raise JobCancelled(self.id)
        if read is None:
            pipe = self._r.pipeline(transaction=False)
            pipe.hgetall(protocol.job_key(self.id))
            pipe.hgetall(protocol.result_key(self.id))
            read = pipe.execute()
        raw_rec, raw = read
        rec = {protocol.decode(k): protocol.decode(v) for k, v in raw_rec.items()}
        res = {protocol.decode(k): v for k, v in raw.items()}
        records = _json(res.get("records"), None)
        if records is None:
            records = _json(rec.get("records"), [])
        if state == "failed":
            meta = _json(res.get("meta"), {})
            est = rec.get("estimate")
            raise JobFailed(
                self.id,
                rec.get("error") or meta.get("error") or "failed (no error recorded)",
                records,
                _json(rec.get("figures"), []),
                int(est) if est and est.isdigit() else None,
            )
        count = int(protocol.decode(res.get("count")) or 0) or len(
            [k for k in res if k.startswith("png:")]
        )
        pngs = [res[f"png:{i}"] for i in range(count) if f"png:{i}" in res]
        if not pngs:
            raise FarmError(f"job {self.id} is done but its result is gone (expired?)")
        return Result(self.id, pngs, _json(res.get("meta"), {}), records)

    def progress(self) -> dict[str, Any] | None:
        """The latest {"step", "steps", "s_per_step"} while it runs, else None."""
        return _json(self._r.get(protocol.progress_key(self.id)), None)

    def cancel(self) -> bool:
        """Cancel: a queued job at once, a placed or running one by request (the worker stops
        it). False when the job had already ended."""
        return self.farm._cancel(self.id) != 0

    def events(self) -> list[dict[str, Any]]:
        raw = self._r.lrange(protocol.events_key(self.id), 0, -1)
        return [e for e in (_json(x, None) for x in raw) if isinstance(e, dict)]


class Farm:
    """A connection to a farm's Redis. Thread-safe (redis-py pools connections)."""

    def __init__(self, redis_url: str | None = None, *, submitter: str | None = None) -> None:
        import redis

        url = redis_url or os.environ.get("SDFARM_REDIS_URL")
        if not url:
            raise FarmError("no farm: give Farm(redis_url) or set SDFARM_REDIS_URL")
        self.url = url
        self.r = redis.Redis.from_url(url, socket_timeout=WAIT_SLICE_S + 30)
        self.submitter = submitter or os.environ.get("USER") or "anonymous"
        self._submit = self.r.register_script(_SUBMIT)
        self._cancel_script = self.r.register_script(_CANCEL)
        self._hb_cache: tuple[float, dict[str, dict[str, Any]]] = (-1e9, {})

    def close(self) -> None:
        self.r.close()

    def __enter__(self) -> Farm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- heartbeats -------------------------------------------------------------------------

    def _heartbeats(self, fresh: bool = False) -> dict[str, dict[str, Any]]:
        """Live heartbeats, cached for a second: a big batch must not read every heartbeat
        once per job."""
        at, cached = self._hb_cache
        if not fresh and time.monotonic() - at < MODELS_CACHE_S:
            return cached
        keys = sorted(protocol.decode(k) for k in self.r.smembers(protocol.DEVICES_KEY))
        values = self.r.mget([protocol.heartbeat_key(k) for k in keys]) if keys else []
        hbs = {}
        for k, raw in zip(keys, values, strict=True):
            hb = parse_heartbeat(raw)
            if hb is not None:
                hbs[k] = hb
        self._hb_cache = (time.monotonic(), hbs)
        return hbs

    def models(self) -> list[dict[str, Any]]:
        """Every model some live worker can load: name, bytes, native size, the devices that
        have it and those that hold it loaded now."""
        out: dict[str, dict[str, Any]] = {}
        hbs = self._heartbeats(fresh=True)
        for key, hb in sorted(hbs.items()):
            loaded = {str(m.get("name")) for m in hb.get("loaded") or [] if isinstance(m, dict)}
            for name, (nbytes, native) in heartbeat_models(hb).items():
                m = out.setdefault(
                    name,
                    {"name": name, "bytes": nbytes, "native_size": list(native), "devices": [],
                     "loaded_on": []},
                )  # fmt: skip
                m["bytes"] = max(m["bytes"], nbytes)
                m["devices"].append(key)
                if name in loaded:
                    m["loaded_on"].append(key)
        return [out[n] for n in sorted(out)]

    # -- submitting ---------------------------------------------------------------------------

    def submit(
        self,
        model: str,
        prompt: str,
        *,
        negative_prompt: str = "",
        width: int = 256,
        height: int = 256,
        steps: int = 4,
        seed: int = -1,
        cfg_scale: float = 1.0,
        sampler: str = "default",
        scheduler: str = "default",
        batch_count: int = 1,
        clip_skip: int = -1,
        priority: int = 5,
        submitter: str | None = None,
        log_level: str = "none",
        log_prompts: bool = False,
    ) -> Job:
        """Queue one job. InvalidParameterError before anything is queued; UnknownModelError
        when workers are up and none has `model`; FarmBusyError at the queue limit."""
        params = validate(
            GenerationParams(
                prompt=prompt,
                negative_prompt=negative_prompt,
                width=width,
                height=height,
                steps=steps,
                seed=seed,
                cfg_scale=cfg_scale,
                sampler=sampler,
                scheduler=scheduler,
                batch_count=batch_count,
                clip_skip=clip_skip,
            )
        )
        spec = protocol.JobSpec(
            model=model,
            params=params.as_dict(),
            priority=priority,
            submitter=submitter or self.submitter,
            log_level=log_level,
            log_prompts=bool(log_prompts),
        )
        return self.submit_spec(spec)

    def submit_spec(self, spec: protocol.JobSpec) -> Job:
        """Queue a JobSpec as it is (params already validated; extra keys such as test hooks
        pass through to the worker). Checks model, priority and log level."""
        if not isinstance(spec.priority, int) or spec.priority not in protocol.PRIORITIES:
            raise InvalidParameterError(
                "priority", f"{spec.priority!r} is outside 0 (interactive) .. 9 (batch)"
            )
        if spec.log_level not in LEVELS:
            raise InvalidParameterError(
                "log_level", f"{spec.log_level!r}: choose one of {', '.join(LEVELS)}"
            )
        if not isinstance(spec.model, str) or not spec.model:
            raise InvalidParameterError("model", "give a model name")
        estimate = self._estimate(spec)
        job_id = protocol.new_job_id()
        record = protocol.new_job_record(job_id, spec, estimate)
        flat: list[str] = []
        for k, v in record.items():
            flat += [k, v]
        ok, depth, limit = self._submit(
            keys=[
                protocol.job_key(job_id),
                protocol.pending_key(spec.priority),
                protocol.PENDING_COUNT_KEY,
                protocol.events_key(job_id),
                protocol.WAKE_KEY,
                protocol.CONFIG_KEY,
            ],
            args=[
                job_id,
                DEFAULT_QUEUE_LIMIT,
                protocol.event("queued", priority=spec.priority, submitter=spec.submitter),
                protocol.EVENTS_CAP,
                *flat,
            ],
        )
        if not ok:
            raise FarmBusyError(int(depth), int(limit))
        return Job(self, job_id)

    def _estimate(self, spec: protocol.JobSpec) -> int:
        """The job's estimate from the heartbeats (0 while no worker is up); UnknownModelError
        when workers are up and none lists the model (after a fresh look)."""
        hbs = self._heartbeats()
        facts = model_facts(hbs, spec.model)
        if facts is None and hbs:
            hbs = self._heartbeats(fresh=True)
            facts = model_facts(hbs, spec.model)
        if facts is None:
            if hbs:
                names = sorted({n for hb in hbs.values() for n in heartbeat_models(hb)})
                raise UnknownModelError(spec.model, names)
            return 0
        return estimate_for(facts, spec.params.get("width", 256), spec.params.get("height", 256))

    def job(self, job_id: str) -> Job:
        return Job(self, job_id)

    def cancel(self, job_id: str) -> bool:
        return self.job(job_id).cancel()

    def _cancel(self, job_id: str) -> int:
        priority = protocol.decode(self.r.hget(protocol.job_key(job_id), "priority"))
        if not priority.isdigit():
            return 0  # no such job (or expired)
        return int(
            self._cancel_script(
                keys=[
                    protocol.job_key(job_id),
                    protocol.PENDING_COUNT_KEY,
                    protocol.events_key(job_id),
                    protocol.done_key(job_id),
                    protocol.cancel_key(job_id),
                    protocol.pending_key(int(priority)),
                ],
                args=[
                    job_id,
                    protocol.event("cancelled", by="client"),
                    protocol.EVENTS_CAP,
                    protocol.RESULT_TTL,
                ],
            )
        )

    def map(
        self,
        prompts: Iterable[str | Mapping[str, Any]],
        model: str,
        *,
        window: int = MAP_WINDOW,
        **common: Any,
    ) -> Iterator[Result]:
        """Results in the order of `prompts` (a prompt, or a dict of per-item parameters with
        "prompt"), with at most `window` jobs of this call queued or running at once, so a
        million prompts never fill the farm's queue and other submitters keep their share.
        Raises the first JobFailed in order (like Executor.map); closing the iterator early
        cancels what it had in flight. A busy farm makes it wait for its own jobs first."""
        if window < 1:
            raise ValueError("window must be at least 1")
        items = iter(prompts)
        flying: deque[Job] = deque()
        held: str | Mapping[str, Any] | None = None
        exhausted = False
        try:
            while True:
                while not exhausted and len(flying) < window:
                    item = held if held is not None else next(items, None)
                    held = None
                    if item is None:
                        exhausted = True
                        break
                    kwargs = dict(common)
                    if isinstance(item, Mapping):
                        kwargs.update(item)
                        prompt = kwargs.pop("prompt")
                    else:
                        prompt = item
                    try:
                        flying.append(self.submit(model, prompt, **kwargs))
                    except FarmBusyError:
                        if not flying:
                            raise
                        held = item
                        break
                if not flying:
                    return
                yield flying.popleft().result()
        finally:
            for job in flying:
                with contextlib.suppress(Exception):  # best effort while unwinding
                    job.cancel()

    # -- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Devices (heartbeat, figures, what runs there), queue depth by priority, running
        jobs, the leader and the config: one JSON-ready document for `sdfarm status`."""
        snap = Registry(self.r).snapshot()
        pipe = self.r.pipeline(transaction=False)
        for p in protocol.PRIORITIES:
            pipe.llen(protocol.pending_key(p))
        pipe.get(protocol.PENDING_COUNT_KEY)
        pipe.get(protocol.LEADER_KEY)
        pipe.hgetall(protocol.CONFIG_KEY)
        *depths, count, leader, config = pipe.execute()
        devices = []
        for state in snap.devices:
            hb = snap.heartbeats.get(state.key, {})
            devices.append(
                {
                    **hb,
                    "key": state.key,
                    "host": state.host,
                    "device": state.device,
                    "alive": state.alive,
                    "figure": state.compute_figure if state.alive else None,
                    "slow_figure": state.slow_figure if state.alive else None,
                    "capacity": state.capacity if state.alive else None,
                    "queued": len(snap.running.get(state.key, {})),
                    "jobs": sorted(snap.running.get(state.key, {})),
                }
            )
        running = [
            {"id": j, **{k: snap.jobs[j].get(k, "") for k in ("state", "device", "model",
                                                              "submitter", "priority")}}
            for j in sorted(snap.jobs)
        ]  # fmt: skip
        return {
            "leader": protocol.decode(leader) or None,
            "config": {protocol.decode(k): protocol.decode(v) for k, v in config.items()},
            "devices": devices,
            "queues": {p: int(n) for p, n in zip(protocol.PRIORITIES, depths, strict=True)},
            "pending": int(protocol.decode(count) or 0),
            "running": running,
        }
