"""The client's errors: what a caller of `Farm` and `Job` catches."""

from __future__ import annotations

from typing import Any

from sdfarm.scheduler.fairness import FarmBusyError
from sdfarm.store.store import QuotaExceededError

__all__ = [
    "FarmBusyError",
    "FarmError",
    "FarmFullError",
    "JobCancelled",
    "JobFailed",
    "QuotaExceededError",
    "UnknownModelError",
]


class FarmError(Exception):
    """Base of the client's own errors (FarmBusyError comes from the fairness rules)."""


class FarmFullError(FarmError):
    """The farm's Redis refuses writes (full); the message says how full."""


class UnknownModelError(FarmError, LookupError):
    """No worker of the farm has the model; `available` lists those it has, `bad` is why a
    worker that has its folder cannot load it (its heartbeat's bad_models), if one does."""

    def __init__(self, model: str, available: list[str], bad: str | None = None) -> None:
        why = f"; a worker has it but cannot load it: {bad}" if bad else ""
        super().__init__(
            f"unknown model {model!r}: the farm has {', '.join(available) or 'no models'}{why}"
        )
        self.model = model
        self.available = available
        self.bad = bad


class JobFailed(FarmError):
    """A job ended failed: `error` as the worker or scheduler wrote it, the log `records`
    (load and generation), and `figures`/`estimate` when a memory rule refused it."""

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
