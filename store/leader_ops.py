"""The leader scheduler's transitions of `Store`: the farm's snapshot, place, fail, requeue,
forget, the lease, and webhooks' take and settle. Every write is fenced on the token."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sdfarm.store import keys
from sdfarm.store.base import (
    FarmReading,
    Placement,
    StoreBase,
)
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
    RESULT_TTL,
    WAKE_KEY,
    WEBHOOKS_KEY,
)
from sdfarm.store.records import (
    CATALOG_REF,
    PENDING_JOB_FIELDS,
    RUNNING_JOB_FIELDS,
    decode,
    decode_hash,
    event,
    loads,
    new_dispatch_id,
    parse_heartbeat,
)


class LeaderOps(StoreBase):
    """Read the farm; place and recover jobs; hold the lease; deliver webhooks."""

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
