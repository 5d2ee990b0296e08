"""The client's and the gateway's transitions and reads of `Store`: submit, cancel, wait,
and reading jobs."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from sdfarm.store import keys
from sdfarm.store.base import (
    QuotaExceededError,
    StoreBase,
    float_or_none,
    refusing_writes_reason,
)
from sdfarm.store.keys import (
    CONFIG_KEY,
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
    JobResult,
    JobSpec,
    decode,
    decode_hash,
    event,
    loads,
    new_job_id,
    new_job_record,
)


class ClientOps(StoreBase):
    """Submit, cancel and wait for jobs; read their records, events, progress and previews."""

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
        return decode(state), float_or_none(placed), float_or_none(deadline), sec + usec / 1e6

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
