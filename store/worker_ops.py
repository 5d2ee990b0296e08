"""The worker's transitions of `Store`: claim, loaded, progress, previews, finish, the Redis
result store's total, heartbeats and queue lengths."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from sdfarm.store import keys, transport
from sdfarm.store.base import (
    StoreBase,
    seconds_arg,
)
from sdfarm.store.keys import (
    DEVICES_KEY,
    EVENTS_CAP,
    JOB_TTL,
    METRICS_KEYS,
    PENDING_COUNT_KEY,
    RECENT_CAP,
    RECENT_KEY,
    RESULT_TTL,
    WAKE_CAP,
    WAKE_KEY,
    WEBHOOKS_KEY,
)
from sdfarm.store.records import (
    FINAL_STATES,
    Began,
    Claim,
    decode,
    event,
    loads,
    split_heartbeat,
)


class WorkerOps(StoreBase):
    """Claim and finish jobs, publish progress, beat, and count the Redis results held."""

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
        return _claim(spec, created, started, estimate, bool(cancelled), tiling)

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
                    seconds_arg(load_s),
                    seconds_arg(generate_s),
                    len(extra),
                    *extra,
                    *images,
                ],
            )
        )

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

    def next_message(self, device_key: str, taker: str = "0") -> transport.Message | None:
        """The device's next task message taken straight from its lists, or None
        (sdfarm.worker.chain: a worker that just finished a job takes the next one without
        Celery's ack and fetch in between). It is `taker`'s held message until its next
        take (`restore_held`)."""
        return transport.pop_next(self.r, device_key, taker)

    def push_back(self, device_key: str, message: transport.Message, taker: str = "0") -> None:
        """A message `taker` took back at the head of its list, for whoever takes the next."""
        transport.push_back(self.r, device_key, message, taker)

    def forget_held(self, device_key: str, taker: str = "0") -> None:
        """`taker` holds no message any more (its chain ended)."""
        transport.forget_held(self.r, device_key, taker)

    def restore_held(
        self, device_key: str, taker: str = "0", began: Began | None = None
    ) -> tuple[bool, str, int]:
        """Settle what `taker`'s last process left (a new slot process, at start: the one
        before may have died): its message back at the head of its list; the job it claimed
        ahead charged as a run when `began` (its start mark) names it, else placed again;
        every other job still running under it spared an attempt (store/lua/
        restore_held.lua). (message put back, the held job's fate: "charged", "unclaimed"
        or "", jobs spared)."""
        held = transport.held_key(device_key)
        named = decode(self.r.hget(held, f"{taker}:job"))
        dispatch, _, job_key = named.partition(" ")
        mark = began or Began("", "", "")
        charged = (keys.job_key(mark.job_id), mark.dispatch) == (job_key, dispatch)
        put_back, settled, spared = self._lua["restore_held"](
            keys=[held, job_key or held, keys.running_key(device_key)],
            args=[taker, dispatch, "1" if charged else "", mark.job_id, mark.incarnation,
                  keys.job_key("")],
        )  # fmt: skip
        return bool(put_back), decode(settled), int(spared)

    def claim_ahead(
        self, job_id: str, dispatch: str, incarnation: str, worker: str, device_key: str,
        taker: str = "0",
    ) -> Claim | None:  # fmt: skip
        """Claim the job of a message the lookahead took, during the native call before it
        (sdfarm.worker.chain): running, marked `ahead` until `start`, and named as `taker`'s
        held job. None when the message is stale."""
        claimed = time.time()
        got = self._lua["claim_ahead"](
            keys=[keys.job_key(job_id), keys.cancel_key(job_id), transport.held_key(device_key),
                  WAKE_KEY, PENDING_COUNT_KEY],
            args=[dispatch, incarnation, worker, taker, repr(claimed), WAKE_CAP, job_id],
        )  # fmt: skip
        if not got:
            return None
        spec, created, estimate, cancelled, tiling = got
        return _claim(spec, created, claimed, estimate, bool(cancelled), tiling)

    def start(self, job_id: str, dispatch: str, incarnation: str, worker: str) -> bool | None:
        """The run of a job claimed ahead began (its start mark is written): from now its loss
        counts. True when a cancel is asked for, None when the job is not this run's any
        more."""
        got = self._lua["start"](
            keys=[keys.job_key(job_id), keys.events_key(job_id), keys.cancel_key(job_id),
                  *METRICS_KEYS],
            args=[dispatch, repr(time.time()),
                  event("running", incarnation=incarnation, worker=worker), EVENTS_CAP, JOB_TTL],
        )  # fmt: skip
        return None if int(got) < 0 else bool(got)

    def unclaim(self, job_id: str, dispatch: str, device_key: str, taker: str = "0") -> bool:
        """A job claimed ahead that will not run here placed again, as its message is put
        back (a stopping worker); False when it moved on meanwhile."""
        return bool(
            self._lua["unclaim"](
                keys=[keys.job_key(job_id), transport.held_key(device_key)], args=[dispatch, taker]
            )
        )


def _claim(
    spec: Any, created: Any, started: float, estimate: Any, cancelled: bool, tiling: Any
) -> Claim:
    """A Claim from the job record's raw fields."""
    try:
        created_t = float(decode(created)) if created else started
    except ValueError:
        created_t = started
    est = decode(estimate)
    plan = loads(tiling, None)
    return Claim(decode(spec), created_t, started, int(est) if est.isdigit() else 0,
                 cancelled, plan if isinstance(plan, dict) else None)  # fmt: skip
