"""`Job`, a handle on one queued job, and `Result`, a finished job's images.

Waiting blocks on the job's done token in Redis (`Store.wait`), so a finished job is seen
within a round trip, with no polling; the wake-up reads the record and the result together.
An event loop awaits instead (`result_async`, over an AsyncStore): a notice on the job's
events channel wakes it, and no thread waits.
A Redis that restarts or fails over meanwhile is waited for (`Farm.retry`).
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sdfarm.client.errors import FarmError, JobCancelled, JobFailed
from sdfarm.native.preview import Preview
from sdfarm.store import FINAL_STATES, JobResult
from sdfarm.store.aio import wait_slice
from sdfarm.store.records import loads
from sdfarm.store.results import read_pngs
from sdfarm.store.retry import aretry_transient
from sdfarm.store.store import refusing_writes_reason

if TYPE_CHECKING:
    from sdfarm.client.farm import Farm
    from sdfarm.store.aio import AsyncStore

WAIT_SLICE_S = 30.0
"""Longest single blocking wait: a wait forever is a loop of these, so a Redis that went away
is noticed (socket timeout) instead of hanging the caller."""
DEADLINE_GRACE_S = 30.0
"""How long past a job's deadline a waiter still waits for the farm to record its end (the
scheduler fails an overdue job within a cycle); then the waiter gives up and says why."""


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

    @property
    def video_index(self) -> int | None:
        """Where a video job's file is among the stored results (after its frames), else
        None."""
        meta = self.metadata
        index = meta.get("video_index", meta.get("webp_index"))
        if meta.get("kind") != "video" or not isinstance(index, int):
            return None
        return index if 0 <= index < len(self.pngs) else None

    @property
    def video_format(self) -> str | None:
        """A video job's file format (webp or mp4; webp for jobs from before the choice)."""
        return None if self.video_index is None else str(self.metadata.get("format") or "webp")

    @property
    def video(self) -> bytes | None:
        """A video job's file (an animated WebP or an MP4: `video_format`), else None."""
        index = self.video_index
        return None if index is None else self.pngs[index]

    @property
    def webp(self) -> bytes | None:
        """A video job's animated WebP, when it asked for one, else None."""
        return self.video if self.video_format == "webp" else None

    @property
    def mp4(self) -> bytes | None:
        """A video job's MP4, when it asked for one, else None."""
        return self.video if self.video_format == "mp4" else None

    @property
    def frames(self) -> list[bytes]:
        """A video job's frames (PNG bytes, in order); a generation's images."""
        index = self.video_index
        return list(self.pngs) if index is None else list(self.pngs[:index])

    def save_video(self, folder: str | os.PathLike[str], frames: bool = True) -> list[Path]:
        """A video job's frames as `folder/frame-0000.png`, ... (unless not `frames`) and its
        file as `folder/video.webp` (or `video.mp4`)."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for i, png in enumerate(self.frames if frames else []):
            (target := out / f"frame-{i:04d}.png").write_bytes(png)
            written.append(target)
        if self.video is not None:
            (target := out / f"video.{self.video_format}").write_bytes(self.video)
            written.append(target)
        return written

    def save(self, path: str | os.PathLike[str]) -> list[Path]:
        """Write the first image to `path`, further ones to `name-1.png`, `name-2.png`, ...
        (a video's: `save_video`)."""
        if self.video is not None:
            return self.save_video(Path(path).with_suffix(""))
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        written = []
        for i, png in enumerate(self.pngs):
            target = out if i == 0 else out.with_name(f"{out.stem}-{i}{out.suffix}")
            target.write_bytes(png)
            written.append(target)
        return written


def _no_end(leader: str | None) -> str:
    """Why no end was recorded, when Redis takes writes: the lease says whether a scheduler
    runs at all."""
    if leader is None:
        return "no scheduler recorded it (is one running?)"
    return "the scheduler did not record it"


class Job:
    """A handle on one job; cheap to make from an id (`farm.job(id)`)."""

    def __init__(self, farm: Farm, job_id: str) -> None:
        self.farm = farm
        self.id = job_id

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def record(self) -> dict[str, str]:
        """The job record (sdfarm.store.records) as it is now."""
        return self.farm.store.record(self.id)

    def state(self) -> str:
        """queued, placed, running, done, failed or cancelled ("" once the record expired)."""
        return self.farm.store.state(self.id)

    def done(self) -> bool:
        return self.state() in FINAL_STATES

    def wait(self, timeout: float | None = None) -> str:
        """Block until the job is final; its state. TimeoutError after `timeout` seconds."""
        return self._wait(timeout)[0]

    def _wait(self, timeout: float | None) -> tuple[str, JobResult | None]:
        """The final state, and the record and result when the wake-up read them (the round
        trip after the done token brings everything `result` needs)."""
        store = self.farm.store
        deadline = None if timeout is None else time.monotonic() + timeout
        token_seen = False
        while True:
            state, placed, job_deadline, now = self.farm.retry(lambda: store.watch(self.id))
            if state in FINAL_STATES:
                return state, None
            if token_seen:  # a token with the state not yet final: never spin hot
                time.sleep(0.001)
            left = self._slice(state, placed, job_deadline, now, deadline, timeout)
            if left is None:
                why = self.farm.retry(self.farm.store.refusing_writes) or _no_end(
                    self.farm.retry(self.farm.store.lease_holder)
                )
                raise self._overdue(state, job_deadline or 0.0, why)
            if self._wait_for_token(left):
                token_seen = True
                ended = self.farm.retry(lambda: store.ended(self.id))
                if ended.state in FINAL_STATES:
                    return ended.state, ended

    def _slice(
        self,
        state: str,
        placed: float | None,
        job_deadline: float | None,
        now: float,
        deadline: float | None,
        timeout: float | None,
    ) -> float | None:
        """How long the next wait of a job that is not final may block; None when the job is
        overdue (no end recorded well past its deadline). FarmError for a job that is gone,
        TimeoutError once `timeout` has passed. Shared by the blocking and the async wait."""
        if not state:
            raise FarmError(f"no job {self.id} (unknown, or expired)")
        left = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"job {self.id} still {state} after {timeout} s")
        if placed is not None and job_deadline is not None:
            overdue = now - placed - job_deadline - self.farm.deadline_grace_s
            if overdue >= 0:
                return None
            left = min(left, -overdue + 0.05)
        return min(left, WAIT_SLICE_S)

    def _overdue(self, state: str, job_deadline: float, why: str) -> JobFailed:
        """The farm recorded no end well past the job's deadline: give up, saying why."""
        return JobFailed(
            self.id,
            f"the job is still {state} {self.farm.deadline_grace_s:g} s past its deadline of "
            f"{job_deadline:g} s (deadline_s), and no end was recorded: {why}",
        )

    def _wait_for_token(self, seconds: float) -> bool:
        return self.farm.retry(lambda: self.farm.store.wait(self.id, seconds))

    def result(self, timeout: float | None = None) -> Result:
        """The images; JobFailed / JobCancelled / TimeoutError otherwise."""
        state, ended = self._wait(timeout)
        if ended is None and state != "cancelled":
            ended = self.farm.retry(lambda: self.farm.store.ended(self.id))
        return self._outcome(state, ended)

    async def result_async(self, store: AsyncStore, timeout: float | None = None) -> Result:
        """`result` for an event loop, over `store` (an AsyncStore of the running loop): the
        same answers and exceptions, but the wait awaits a notice on the job's events channel
        (shared pub/sub connection) instead of blocking a thread on the done token."""
        state = await self._wait_async(store, timeout)
        ended = None
        if state != "cancelled":
            ended = await aretry_transient(lambda: store.ended(self.id), self.farm.retry_s)
        return self._outcome(state, ended)

    async def _wait_async(self, store: AsyncStore, timeout: float | None) -> str:
        """The final state: each notice (or bounded slice) is followed by one `watch` read,
        so a missed notice costs at most a slice, never the answer."""
        deadline = None if timeout is None else time.monotonic() + timeout
        budget = self.farm.retry_s
        async with store.listen(self.id) as notice:
            while True:
                state, placed, job_deadline, now = await aretry_transient(
                    lambda: store.watch(self.id), budget
                )
                if state in FINAL_STATES:
                    return state
                left = self._slice(state, placed, job_deadline, now, deadline, timeout)
                if left is None:
                    info = await aretry_transient(store.memory, budget)
                    why = refusing_writes_reason(info) or _no_end(
                        await aretry_transient(store.lease_holder, budget)
                    )
                    raise self._overdue(state, job_deadline or 0.0, why)
                await notice.wait(min(left, wait_slice()))

    def _outcome(self, state: str, ended: JobResult | None) -> Result:
        """The Result of a final job, or the exception that says why there is none."""
        if state == "cancelled":
            raise JobCancelled(self.id)
        assert ended is not None
        rec = ended.record
        if state == "failed":
            est = rec.get("estimate")
            raise JobFailed(
                self.id,
                rec.get("error") or ended.meta.get("error") or "failed (no error recorded)",
                ended.records,
                loads(rec.get("figures"), []),
                int(est) if est and est.isdigit() else None,
            )
        pngs = self.farm.retry(lambda: read_pngs(rec, ended.pngs, self.farm.store))
        if not pngs:
            raise FarmError(f"job {self.id} is done but its result is gone (expired?)")
        return Result(self.id, pngs, ended.meta, ended.records)

    def progress(self) -> dict[str, Any] | None:
        """The latest {"step", "steps", "s_per_step"} while it runs, else None."""
        return self.farm.store.progress(self.id)

    def preview(self) -> Preview | None:
        """The latest preview of a running job that asked for them (`preview_every`): its
        step and a small WebP image (`.data`, `.image`); None before the first and after the
        end (the result supersedes it). Each preview is also a `preview` event."""
        doc = self.farm.store.preview(self.id)
        try:
            return Preview.from_event(doc) if isinstance(doc, dict) else None
        except (KeyError, TypeError, ValueError):
            return None

    def cancel(self) -> bool:
        """Cancel: a queued job at once, a placed or running one by request (the worker stops
        it). False when the job had already ended."""
        return self.farm.store.cancel(self.id) != 0

    def events(self) -> list[dict[str, Any]]:
        return self.farm.store.events(self.id)

    def delete(self, timeout: float | None = 30.0) -> bool:
        """Delete the job: its record, events and images, from whichever store holds them.
        A live job is cancelled first and waited for (TimeoutError past `timeout`). False
        when there was no such job."""
        return self.farm.delete(self.id, timeout)
