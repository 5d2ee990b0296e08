"""`sdfarm batch FILE --out DIR`: many prompts in, PNGs on disk, resumable.

Input is text (one prompt a line, blank lines and `#` comments skipped), CSV (a header with
`prompt` and optional per-item fields) or JSONL (one object a line). Every item gets a stable
output name (its `name`, else `{index:05d}-{slug}`), so a re-run maps each item to the same
file and skips those already written: an interrupted batch of thousands resumes where it
stopped, and nothing finished is ever paid for twice. A PNG appears only once complete (sidecar
first, then the PNG renamed into place), so its existence is the resume test.

Parsing and the resume decision are pure functions; `run_batch` talks to the farm through a
client object with `submit(model, prompt, **params, **options)` returning jobs with `.id`,
`.state()`, `.wait(timeout)`, `.result(timeout)` and `.cancel()` (a `Farm`'s `Job`), and, for
video lines, `video(model, prompt, **params, **options)` likewise.

What ends an item and what ends the batch: an item fails only for its own reason (its
parameters are invalid, its model is unknown, its job failed or was cancelled), with the error
text in the summary. A busy farm is waited for (backoff while collecting what is in flight),
a Redis that is briefly away is ridden out (`retry_transient`, in `Farm` and here), and a job
whose record vanished is submitted again. When the batch cannot go on (Redis away past the
retry budget or refusing writes, the output folder refusing a write) it stops at once with
`BatchStopped`: what is in flight is cancelled, every image written is kept, and a re-run
resumes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdfarm.client.batch_input import BatchItem
from sdfarm.client.batch_output import is_done, output_name, write_file, write_result
from sdfarm.client.errors import (
    FarmBusyError,
    FarmError,
    JobCancelled,
    JobFailed,
    UnknownModelError,
)
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.params import OPTION_NAMES, JobOptions, check_options
from sdfarm.store import FINAL_STATES
from sdfarm.store.retry import retry_transient

BATCH_PRIORITY = 9
"""A batch's jobs go last unless the caller says otherwise (JobOptions.priority)."""
BUSY_FIRST_S = 0.2
BUSY_MAX_S = 5.0
"""A busy farm (its queue limit reached) is asked again after 0.2 s, doubling to 5 s."""
POLL_S = 0.5
"""Longest block on one job while others are in flight: a result that ends behind the oldest
job is collected within this."""
LOST_RESUBMITS = 2
"""How often an item whose job vanished from the farm (Redis lost it) is submitted again."""
CANCEL_BUDGET_S = 5.0
"""How long cancelling what is in flight may ride out a Redis that is away, all jobs together."""


class BatchStopped(RuntimeError):
    """The batch could not go on and stopped: `kind` is "output" (the folder refused a write)
    or "farm" (Redis away past the retry budget, or refusing writes); `cause` the error and
    `summary` what was done. What was in flight is cancelled; every image written is kept, so
    running the same batch again resumes."""

    def __init__(self, message: str, kind: str, cause: BaseException, summary: Summary) -> None:
        super().__init__(message)
        self.kind = kind
        self.cause = cause
        self.summary = summary


@dataclass
class Summary:
    total: int = 0
    done: int = 0
    skipped: int = 0
    submitted: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    total_s: float = 0.0
    render_s: float = 0.0
    out: str = ""
    model: str = ""
    busy_waits: int = 0
    """How often the farm was at its queue limit and the batch waited before submitting."""
    stopped: str = ""
    """Why the batch stopped before the end (BatchStopped), else empty."""

    @property
    def failed(self) -> int:
        return len(self.failures)

    @property
    def remaining(self) -> int:
        """Items neither written, skipped nor failed: what a re-run would render."""
        return self.total - self.done - self.skipped - self.failed

    @property
    def images_per_s(self) -> float:
        return round(self.done / self.render_s, 3) if self.render_s > 0 and self.done else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "out": self.out,
            "model": self.model,
            "total": self.total,
            "done": self.done,
            "skipped": self.skipped,
            "failed": self.failed,
            "remaining": self.remaining,
            "submitted": self.submitted,
            "busy_waits": self.busy_waits,
            "stopped": self.stopped or None,
            "failures": self.failures,
            "images_per_s": self.images_per_s,
            "total_s": round(self.total_s, 3),
        }

    def text(self) -> str:
        lines = [
            f"{self.done} done, {self.skipped} skipped, {self.failed} failed of {self.total} "
            f"in {self.total_s:.1f} s ({self.images_per_s:.2f} images/s) -> {self.out}"
        ]
        lines += [f"  failed {f['name']}: {f['error']}" for f in self.failures]
        if self.stopped:
            lines.append(
                f"stopped with {self.remaining} not rendered: {self.stopped}; run the same "
                f"command again to resume"
            )
        return "\n".join(lines)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def batch_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """The job options of every job of a batch: `options` (JobOptions fields) over the batch's
    default priority, checked against the job schema once, before anything is queued.
    InvalidParameterError for an unknown name or a value out of range."""
    merged = {"priority": BATCH_PRIORITY, **(options or {})}
    unknown = sorted(set(merged) - set(OPTION_NAMES))
    if unknown:
        raise InvalidParameterError(
            unknown[0], f"unknown job option; the options are {', '.join(OPTION_NAMES)}"
        )
    check_options(JobOptions(**merged))
    return merged


ITEM_SUBMIT_ERRORS = (InvalidParameterError, UnknownModelError)
"""Errors of `submit` that are the item's own: it fails, the batch goes on."""
ITEM_RESULT_ERRORS = (JobFailed, JobCancelled)
"""Errors of a job's result that are the item's own (its job failed or was cancelled)."""


@dataclass
class _Flying:
    item: BatchItem
    job: Any
    since: float


def run_batch(
    farm: Any,
    items: Iterable[BatchItem],
    out_dir: str | os.PathLike[str],
    model: str,
    common: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    in_flight: int = 8,
    timeout: float | None = None,
    on_progress: Callable[[str, BatchItem, int], None] | None = None,
    *,
    write: Callable[[Path, bytes], None] = write_file,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    total: int | None = None,
    frames: bool = False,
) -> Summary:
    """Render the items not yet in `out_dir`, keeping at most `in_flight` jobs queued on the
    farm (late binding keeps the rest off the devices anyway; the bound keeps a huge batch
    from filling Redis and the queue limit). Every job is `farm.submit(model, prompt,
    **params, **options)`: `common` are the generation parameters of every item (an item's
    own fields win), `options` the job options (JobOptions; priority 9 unless given).

    Results are collected as they finish, not in submission order, so one slow device never
    holds back writing the others. A failed item (its own reason: invalid parameters, an
    unknown model, a failed or cancelled job, or its job not ending within `timeout` seconds
    of being queued when given) is recorded and the batch goes on. A busy farm is waited for;
    a job the farm lost is submitted again. `on_progress(kind, item, n_done)` sees every
    outcome ("done" or "failed").

    BatchStopped when the batch cannot go on: `write(path, bytes)` (the disk; a hook for
    tests) raised OSError, or the farm's Redis stayed away past the retry budget or refuses
    writes. What is in flight is cancelled then; images already written stay. ValueError when
    `in_flight` < 1; InvalidParameterError for invalid `options`, before anything is queued.
    `sleep` and `clock` are the waits' (hooks for tests).

    `items` may be any iterable, a generator over a file included (`iter_items`): it is read
    one item ahead of the submissions, so the client holds the `in_flight` window, never the
    input. `total` (the items a scan counted) makes the summary's counts whole should the
    batch stop early; without it, a sized `items` gives it, else the items read so far.

    A video line (`item.kind` video) is `farm.video(model, prompt, **params, **options)`; its
    video file is written where an image's PNG would be, its frames beside it when
    `frames` (sdfarm.client.batch_output)."""
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise ValueError(f"in_flight must be an integer of at least 1, got {in_flight!r}")
    opts = batch_options(options)
    start = clock()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    common = dict(common or {})
    if total is None and isinstance(items, Sized):
        total = len(items)
    summary = Summary(total=total or 0, out=str(out), model=model)
    source = iter(items)
    exhausted = False
    queue: deque[BatchItem] = deque()  # the next item read, and items whose job was lost
    flying: deque[_Flying] = deque()
    lost: dict[int, int] = {}  # item index -> times its job vanished
    finished = 0
    busy_delay = 0.0
    retry_at = start

    def note(kind: str, item: BatchItem) -> None:
        if on_progress is not None:
            on_progress(kind, item, finished)

    def fail(item: BatchItem, error: str) -> None:
        nonlocal finished
        finished += 1
        summary.failures.append({"name": item.name, "index": item.index, "error": error})
        note("failed", item)

    def stop(kind: str, exc: BaseException, item: BatchItem | None = None) -> BatchStopped:
        if kind == "output":
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            code = errno.errorcode.get(exc.errno or 0) if isinstance(exc, OSError) else None
            what = f" {output_name(item)}" if item is not None else ""
            why = f"cannot write{what} into {out}: {reason}" + (f" ({code})" if code else "")
        else:
            why = f"the farm cannot take the batch: {_error_text(exc)}"
        summary.stopped = why
        return BatchStopped(
            f"{why}; stopped with {summary.done} images written (kept) and "
            f"{len(flying)} jobs in flight (cancelled)",
            kind,
            exc,
            summary,
        )

    def submit(item: BatchItem) -> bool:
        """True when the item left the queue (queued on the farm, or failed); False when the
        farm is busy."""
        nonlocal busy_delay, retry_at
        try:
            submit_job = farm.video if item.kind == "video" else farm.submit
            job = submit_job(model, item.prompt, **item.merged(common), **opts)
        except FarmBusyError:
            busy_delay = min(BUSY_MAX_S, busy_delay * 2) if busy_delay else BUSY_FIRST_S
            retry_at = clock() + busy_delay
            summary.busy_waits += 1
            return False
        except ITEM_SUBMIT_ERRORS as exc:
            fail(item, _error_text(exc))
            return True
        except Exception as exc:  # Redis away past its budget, or full: nothing can be queued
            raise stop("farm", exc) from exc
        busy_delay = 0.0
        summary.submitted += 1
        flying.append(_Flying(item, job, clock()))
        return True

    def collect(entry: _Flying) -> None:
        nonlocal finished, retry_at
        item, job = entry.item, entry.job
        retry_at = min(retry_at, clock())  # a job of ours ended: a busy farm may have room
        try:
            result = job.result(None)
        except ITEM_RESULT_ERRORS as exc:
            fail(item, _error_text(exc))
            return
        except FarmError as exc:  # the record or the result vanished: the farm lost the job
            lost[item.index] = lost.get(item.index, 0) + 1
            if lost[item.index] > LOST_RESUBMITS:
                fail(item, _error_text(exc))
            else:
                queue.appendleft(item)
            return
        except Exception as exc:  # Redis away past its budget
            raise stop("farm", exc) from exc
        try:
            write_result(out, item, job.id, result, write, frames=frames)
        except OSError as exc:
            raise stop("output", exc, item) from exc
        finished += 1
        summary.done += 1
        note("done", item)

    def refill() -> None:
        """Read ahead one item that is not already written (skipped ones are counted)."""
        nonlocal exhausted
        while not queue and not exhausted:
            item = next(source, None)
            if item is None:
                exhausted = True
            else:
                if total is None:
                    summary.total += 1
                if is_done(out, item):
                    summary.skipped += 1
                else:
                    queue.append(item)

    render_start = clock()
    try:
        refill()
        while queue or flying:
            while queue and len(flying) < in_flight and clock() >= retry_at:
                if submit(queue[0]):
                    queue.popleft()
                    refill()
            if not flying:
                if queue:  # busy, with nothing of ours on the farm: wait, then ask again
                    sleep(max(0.0, retry_at - clock()))
                continue
            now = clock()
            if timeout is not None:
                for entry in [e for e in flying if now - e.since >= timeout]:
                    flying.remove(entry)
                    _cancel([entry.job])
                    why = f"job {entry.job.id} did not end within {timeout:g} s"
                    fail(entry.item, f"TimeoutError: {why}")
            if not flying:
                continue
            try:
                ready = [e for e in flying if _is_final(e.job)]
                if not ready:
                    # Block on the oldest (the likeliest to end next), at most until the busy
                    # farm is asked again, a timeout is due, or POLL_S to look at the others.
                    wait_s = POLL_S
                    if queue and len(flying) < in_flight:
                        wait_s = min(wait_s, retry_at - now)
                    if timeout is not None:
                        wait_s = min(wait_s, min(e.since for e in flying) + timeout - now)
                    if _ended_within(flying[0].job, max(wait_s, 0.01)):
                        ready = [flying[0]]
            except Exception as exc:  # Redis away past its budget
                raise stop("farm", exc) from exc
            for entry in ready:
                flying.remove(entry)
                collect(entry)
    except BaseException:
        _cancel([entry.job for entry in flying])  # nobody will read these: free the farm
        raise
    finally:
        now = clock()
        summary.render_s = now - render_start
        summary.total_s = now - start
    return summary


def _cancel(jobs: Iterable[Any], budget_s: float = CANCEL_BUDGET_S) -> None:
    """Cancel `jobs`, best effort: transient Redis errors are retried within one shared
    budget (a batch that stops because Redis is away must not wait a budget per job)."""
    deadline = time.monotonic() + budget_s
    for job in jobs:
        with contextlib.suppress(Exception):
            retry_transient(job.cancel, budget_s=max(0.0, deadline - time.monotonic()))


def _is_final(job: Any) -> bool:
    """Whether `job` ended (or vanished: `result` then says so). Transient Redis errors are
    retried; past the budget the error goes up."""
    state = str(retry_transient(job.state))
    return state in FINAL_STATES or not state


def _ended_within(job: Any, seconds: float) -> bool:
    """Block up to `seconds` for `job` to end; True when it did, or when waiting showed it
    never will (gone, or overdue): `result` then reports it."""
    try:
        job.wait(seconds)
    except TimeoutError:
        return False
    except FarmError:
        return True
    return True
