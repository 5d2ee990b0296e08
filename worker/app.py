"""The worker's Celery app: the farm's transport (sdfarm.store.transport) with the generate
task registered."""

from __future__ import annotations

from typing import Any

from sdfarm.store import transport


def make_app(redis_url: str) -> Any:
    """A Celery app on `redis_url` that runs TASK_NAME messages with `run_job`."""
    from sdfarm.worker.tasks import run_job

    return transport.make_app(redis_url, task=run_job)
