"""The uploader: one thread per worker process that turns finished generations into results.

On a fast GPU a 512x512 image takes 0.3 s, so a 20 ms PNG encode or a Redis round trip on the
job's path would cost the device several percent (facts/runtime.md). The job thread hands
its images here and returns at once; Celery acknowledges and the next job starts generating
while this thread encodes and writes. Jobs that end without images (failed, cancelled) go
through the same queue, so a job's final state is written by one thread in order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sdfarm.native.devices import format_bytes
from sdfarm.native.png import png_bytes

log = logging.getLogger("sdfarm.worker")

RETRIES = 5
MAX_RESULT_BYTES = 64 * 1024 * 1024
"""The most PNG bytes one job's result may hold in Redis."""


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


class Uploader:
    """A queue and the thread that drains it; `flush()` waits until everything handed over
    so far is written."""

    def __init__(
        self, store: Any, device_key: str, max_result_bytes: int = MAX_RESULT_BYTES
    ) -> None:
        self._store = store
        self._device_key = device_key
        self._max = max_result_bytes
        self._queue: queue.Queue[Finished | None] = queue.Queue()
        self._pending = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sdfarm-uploader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, item: Finished) -> None:
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
            item = self._queue.get()
            if item is None:
                return
            try:
                self.write(item)
            except Exception:  # noqa: BLE001 - one bad result must not stop the uploader
                log.exception("could not write the result of job %s", item.job_id)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def write(self, item: Finished) -> bool:
        """Encode, check the size cap, then write the images and end the job in one atomic
        step (Store.finish). False when the job was no longer ours."""
        meta = item.meta
        timings: dict[str, Any] = {} if meta is None else meta.setdefault("timings", {})
        pngs: list[bytes] = []
        state, error = item.state, item.error
        if item.images:
            t = time.monotonic()
            pngs = [
                png_bytes(img, item.png_params[i] if i < len(item.png_params) else meta or {})
                for i, img in enumerate(item.images)
            ]
            timings["encode_s"] = round(time.monotonic() - t, 4)
            total = sum(len(p) for p in pngs)
            if total > self._max:
                state = "failed"
                error = (
                    f"result too large: {len(pngs)} PNG image(s) of {format_bytes(total)} "
                    f"({total} bytes) exceed the result cap of {format_bytes(self._max)} "
                    "(MAX_RESULT_BYTES); ask for fewer or smaller images"
                )
                pngs = []
        if error and meta is not None:
            meta["error"] = error
        ok = self._retry(
            self._store.finish,
            item.job_id,
            item.dispatch,
            self._device_key,
            state,
            error=error,
            meta=meta,
            records=item.records,
            pngs=pngs,
            job_fields=item.job_fields,
        )
        if not ok:
            log.warning(
                "job %s is no longer ours; its end (%s) was not written", item.job_id, state
            )
        return bool(ok)

    def _retry(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Ride out a Redis restart or a dropped connection (about 15 s in all)."""
        import redis

        delay = 0.5
        for attempt in range(RETRIES):
            try:
                return fn(*args, **kwargs)
            except (redis.ConnectionError, redis.TimeoutError):
                if attempt == RETRIES - 1:
                    raise
                time.sleep(delay)
                delay *= 2
        return None
