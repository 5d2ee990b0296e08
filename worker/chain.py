"""Back-to-back jobs in one Celery task: after a job, the slot takes the device's next task
message itself, instead of returning to Celery for its ack and its next delivery.

Why: between two generations on one engine Celery's round (the child's result to the main
process, the ack, the next fetch, the message back to the child) cost 2.8-4.5 ms on the H200
(docs/gpu.md), 2.5-4% of a 113 ms image, so one engine could not be busy 99% of the time.
Taking the next message here costs one Redis round trip.

Nothing about a job's safety changes: the message is popped just before the job is claimed,
as Celery's delivery comes just before it; a job that kills the process was claimed by it,
so the scheduler re-places it (and counts it) as it does any running job of a dead slot;
the jobs still in the lists are untouched. Celery's priority order is kept (the lists are
read in the order its consumer reads them).

A chain ends, handing the slot back to Celery, when the lists are empty, after CHAIN_MAX_JOBS
jobs or CHAIN_MAX_S seconds (Celery's own bookkeeping gets its turn), or as soon as the worker
begins to stop: the main process touches its stop file on SIGTERM (`worker_shutting_down`),
so a stopping worker finishes the job it runs and takes no other. `SDFARM_CHAIN=0` turns
chaining off.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("sdfarm.worker")

CHAIN_ENV = "SDFARM_CHAIN"
CHAIN_MAX_JOBS = 100
CHAIN_MAX_S = 10.0


def chaining(env: Mapping[str, str] | None = None) -> bool:
    """Whether a slot takes the next message itself (`SDFARM_CHAIN`, on unless `0`)."""
    env = os.environ if env is None else env
    return (env.get(CHAIN_ENV) or "1").strip().lower() not in ("0", "off", "false", "no")


class Chain:
    """The jobs one Celery task runs after its own: `next()` gives each one's (job id,
    dispatch) until the chain ends. Every probe is a parameter (`pop`, `stopping`, `clock`)."""

    def __init__(
        self,
        pop: Callable[[], tuple[str, str] | None],
        stopping: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
        max_jobs: int = CHAIN_MAX_JOBS,
        max_s: float = CHAIN_MAX_S,
    ) -> None:
        self.pop = pop
        self.stopping = stopping
        self.clock = clock
        self.max_jobs = max_jobs
        self.deadline = clock() + max_s
        self.taken = 0

    def next(self) -> tuple[str, str] | None:
        """The next job to run in this task, or None: the chain ends."""
        if self.taken >= self.max_jobs or self.clock() >= self.deadline or self.stopping():
            return None
        try:
            found = self.pop()
        except Exception as exc:  # noqa: BLE001 - Celery's consumer takes over on a Redis blip
            log.warning("chain: the next message not taken: %s", exc)
            return None
        if found is not None:
            self.taken += 1
        return found


def stop_requested(ctx: Any) -> Callable[[], bool]:
    """The stop probe of a worker process: its context is stopping, or the worker's stop
    file exists (the main process's SIGTERM)."""
    stop_file = Path(ctx.config.stop_file) if ctx.config.stop_file else None

    def stopping() -> bool:
        return ctx.stopping or (stop_file is not None and stop_file.exists())

    return stopping


def for_context(ctx: Any) -> Chain | None:
    """The chain of this worker process's next task, or None when chaining is off."""
    if not chaining():
        return None
    return Chain(lambda: ctx.store.next_message(ctx.config.device_key), stop_requested(ctx))
