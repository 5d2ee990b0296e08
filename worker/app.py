"""The worker's Celery app: the farm's transport (sdfarm.store.transport) with the generate
task registered, and how many task messages it reserves ahead (`SDFARM_PREFETCH`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from sdfarm.store import transport

PREFETCH_ENV = "SDFARM_PREFETCH"
DEFAULT_PREFETCH = 1
MAX_PREFETCH = 8


def prefetch(env: Mapping[str, str] | None = None) -> int:
    """Messages the main process reserves per engine slot (`SDFARM_PREFETCH`, 1 to 8).

    With 1 a slot's next message is fetched from Redis only after its job is acknowledged:
    Celery's ack and the fetch sit between two generations (2.8 ms median of 3.7 ms between
    native calls on the H200, docs/gpu.md). With 2 the next message already waits in the
    main process when a job ends. What a reserved message costs: a job of higher priority
    that arrives later waits behind it, and a whole worker that dies leaves it to the
    scheduler's recovery (it is placed, unclaimed, and re-placed when the worker's
    incarnation changes), exactly like the messages it had not yet fetched."""
    env = os.environ if env is None else env
    text = (env.get(PREFETCH_ENV) or str(DEFAULT_PREFETCH)).strip()
    try:
        n = int(text)
    except ValueError:
        raise ValueError(
            f"{PREFETCH_ENV} must be a count from 1 to {MAX_PREFETCH}, got {text!r}"
        ) from None
    if not 1 <= n <= MAX_PREFETCH:
        raise ValueError(f"{PREFETCH_ENV} must be a count from 1 to {MAX_PREFETCH}, got {n}")
    return n


def make_app(redis_url: str, prefetch_count: int | None = None) -> Any:
    """A Celery app on `redis_url` that runs TASK_NAME messages with `run_job`."""
    from sdfarm.worker.tasks import run_job

    count = prefetch() if prefetch_count is None else prefetch_count
    return transport.make_app(redis_url, task=run_job, prefetch=count)
