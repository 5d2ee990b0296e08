"""The uploader: one thread per worker process that turns finished generations into results.

On a fast GPU a 512x512 image takes 0.3 s, so a 20 ms PNG encode or a Redis round trip on the
job's path would cost the device several percent (facts/runtime.md). The job thread hands
its images here and returns at once; Celery acknowledges and the next job starts generating
while this thread encodes and writes. Jobs that end without images (failed, cancelled) go
through the same queue, so a job's final state is written by one thread in order.

The images go to the worker's result store (sdfarm.store.results): Redis writes them in the
finish step itself; a file or S3 store gets them first (`put`), then the finish step records
the end and, in the job record's `results` field, where they are. A job that turned out not
to be ours any more gets its images deleted again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from sdfarm.native.gate import GATE
from sdfarm.native.png import png_bytes
from sdfarm.store.results import REDIS_RESULT_MAX, RedisResults, ResultRefused, ResultStore, where
from sdfarm.store.retry import BUDGET_S, TRANSIENT, retry_transient

log = logging.getLogger("sdfarm.worker")

MAX_RESULT_BYTES = REDIS_RESULT_MAX
"""The most PNG bytes one job's result may hold in Redis."""
UNWRITTEN_RETRY_S = 5.0
"""How often the end of a job that Redis refused is tried again."""
UNWRITTEN_CAP = 1000
KEPT_WHOLE = "its result is kept and tried again: Redis was away"
"""What the heartbeat says of a whole result held while Redis was away."""


@dataclass
class Finished:
    """One job's end as the job thread saw it. `meta["timings"]` gets encode_s here; `images`
    are PIL images (PNG-encoded here with `png_params` in a text chunk each). `meta` None
    writes no result hash (a cancelled job has nothing to show)."""

    job_id: str
    dispatch: str
    state: str  # done / failed / cancelled
    meta: dict[str, Any] | None = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    png_params: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""
    job_fields: dict[str, str] = field(default_factory=dict)
    extra: list[bytes] = field(default_factory=list)
    """Encoded results stored after the images' PNGs (a video's animated WebP)."""


@dataclass
class Later:
    """A job's end whose Finished is built on the uploader thread (`build`): the job thread
    hands its native call's output over and starts the next job at once. A build that fails
    fails the job, with the error."""

    job_id: str
    dispatch: str
    build: Callable[[], Finished]

    def finished(self) -> Finished:
        try:
            return self.build()
        except Exception as exc:  # noqa: BLE001 - a bug fails this job, not the uploader
            log.exception("the result of job %s not built", self.job_id)
            error = f"internal error in the worker: {type(exc).__name__}: {exc}"
            return Finished(self.job_id, self.dispatch, "failed", error=error)


class Uploader:
    """A queue and the thread that drains it; `flush()` waits until everything handed over
    so far is written."""

    def __init__(
        self,
        store: Any,
        device_key: str,
        max_result_bytes: int = MAX_RESULT_BYTES,
        results: ResultStore | None = None,
        retry_s: float = BUDGET_S,
    ) -> None:
        self._store = store
        self._retry_s = retry_s
        self._device_key = device_key
        self.results = results or RedisResults(store, max_bytes=max_result_bytes)
        self._queue: queue.Queue[Finished | Later | None] = queue.Queue()
        self.unwritten: dict[str, tuple[Finished, str]] = {}
        """Jobs whose end is not written yet, tried again every UNWRITTEN_RETRY_S (the
        heartbeat lists them): with why, those Redis refused even as a failure; with "",
        whole results (images and all) kept while Redis stayed away past the retry budget
        (a Sentinel failover can take longer: a finished image is not given up for that)."""
        self._pending = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sdfarm-uploader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, item: Finished | Later) -> None:
        with self._cond:
            self._pending += 1
        self._queue.put(item)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted item is written (or given up); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=UNWRITTEN_RETRY_S if self.unwritten else None)
            except queue.Empty:
                self._retry_unwritten()
                continue
            if item is None:
                return
            GATE.wait()  # not while the job thread starts its next native call
            if isinstance(item, Later):
                item = item.finished()
            try:
                self.write(item)
            except TRANSIENT as exc:  # Redis still away: keep the whole result, try again
                self._keep_whole(item, exc)
            except redis.RedisError as exc:  # refused even as a failure: keep trying
                self._keep_unwritten(item, exc)
            except Exception:  # noqa: BLE001 - one bad result must not stop the uploader
                log.exception("could not write the result of job %s", item.job_id)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def write(self, item: Finished) -> bool:
        """Encode, put the images in the result store (Redis: check its caps), then end the
        job in one atomic step (Store.finish). False when the job was no longer ours."""
        meta = item.meta
        timings: dict[str, Any] = {} if meta is None else meta.setdefault("timings", {})
        pngs: list[bytes] = []
        state, error = item.state, item.error
        stored: list[str] = []
        if item.images:
            t = time.monotonic()
            pngs = [
                png_bytes(img, item.png_params[i] if i < len(item.png_params) else meta or {})
                for i, img in enumerate(item.images)
            ] + list(item.extra)
            timings["encode_s"] = round(time.monotonic() - t, 4)
            try:
                stored = retry_transient(
                    lambda: self.results.put(item.job_id, pngs, item.dispatch), self._retry_s
                )
            except ResultRefused as exc:
                state, error, pngs = "failed", str(exc), []
            except redis.ResponseError as exc:  # Redis full: fail in the smallest write there is
                state, pngs = "failed", []
                error = f"the result could not be stored: Redis refused the write ({exc})"
            except redis.RedisError:
                raise
            except Exception as exc:  # noqa: BLE001 - the store refused: the job fails, saying so
                state, pngs = "failed", []
                error = f"the result could not be stored in {self.results.url}: {exc}"
                log.warning("job %s: %s", item.job_id, error)
        if error and meta is not None:
            meta["error"] = error
        fields = dict(item.job_fields)
        if stored:
            fields["results"] = where(self.results.url, stored)
        inline = pngs if self.results.inline else []
        try:
            ok = self._finish(item, state, error, meta, inline, len(stored), fields)
        except redis.ResponseError as exc:
            # Redis refused the write (full, read-only): the job fails with the reason, in the
            # smallest write there is, instead of staying `running` for ever.
            error = f"the result could not be stored: Redis refused the write ({exc})"
            if meta is not None:
                meta["error"] = error
            log.warning("job %s: %s", item.job_id, error)
            self._unstore(item.job_id, stored)
            ok = self._finish(item, "failed", error, meta, [], 0, dict(item.job_fields))
            stored = []
        if not ok:
            log.warning(
                "job %s is no longer ours; its end (%s) was not written", item.job_id, state
            )
            self._unstore(item.job_id, stored)
        return bool(ok)

    def _unstore(self, job_id: str, stored: list[str]) -> None:
        """Images put for a job whose end was not written with them: deleted (best effort)."""
        if not stored:
            return
        try:
            self.results.delete(job_id, stored)
        except Exception:  # noqa: BLE001 - an orphan image is no reason to stop the uploader
            log.exception("job %s: could not delete its images from %s", job_id, self.results.url)

    def _finish(
        self,
        item: Finished,
        state: str,
        error: str,
        meta: Any,
        pngs: list[bytes],
        count: int = 0,
        fields: dict[str, str] | None = None,
    ) -> bool:
        timings = (meta or {}).get("timings") or {}
        return retry_transient(
            lambda: self._store.finish(
                item.job_id,
                item.dispatch,
                self._device_key,
                state,
                error=error,
                meta=meta,
                records=item.records,
                pngs=pngs,
                count=count,
                job_fields=item.job_fields if fields is None else fields,
                load_s=_positive(timings.get("load_s")),
                generate_s=_positive(timings.get("generate_s")),
            ),
            self._retry_s,
        )

    def _keep_whole(self, item: Finished, exc: Exception) -> None:
        """Remember a job whose result could not be written because Redis stayed away (a
        restart, a failover) past the retry budget: all of it, tried again as it is."""
        log.error("job %s: Redis away (%s); its result is kept and tried again", item.job_id, exc)
        self.unwritten[item.job_id] = (item, "")
        while len(self.unwritten) > UNWRITTEN_CAP:
            self.unwritten.pop(next(iter(self.unwritten)))

    def _keep_unwritten(self, item: Finished, exc: Exception) -> None:
        """Remember a job whose end Redis refused even as a failure (Redis full); the
        uploader tries again until Redis takes it or the job is no longer ours."""
        error = f"the result could not be stored: Redis refused the write ({exc})"
        log.error("job %s: %s; will try again", item.job_id, error)
        item.images, item.state, item.error = [], "failed", error
        if item.meta is not None:
            item.meta["error"] = error
        self.unwritten[item.job_id] = (item, error)
        while len(self.unwritten) > UNWRITTEN_CAP:
            self.unwritten.pop(next(iter(self.unwritten)))

    def _retry_unwritten(self) -> None:
        for job_id, (item, error) in list(self.unwritten.items()):
            try:
                if error:
                    self._finish(item, "failed", error, item.meta, [], 0)
                else:
                    self.write(item)  # a whole result: as if it had just come
            except TRANSIENT:
                return  # still away: the next round
            except redis.RedisError as exc:
                if error:
                    return  # still refused: the next round
                self._keep_unwritten(item, exc)  # back, but refusing it: end it as a failure
                continue
            del self.unwritten[job_id]
            log.info("job %s: its %s was written after all", job_id,
                     "failure" if error else "result")  # fmt: skip


def _positive(value: Any) -> float | None:
    """A timing worth observing: a load_s of 0 means the engine was warm (no load)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if seconds > 0 else None
