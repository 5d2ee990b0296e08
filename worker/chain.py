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
jobs or CHAIN_MAX_S seconds (Celery's own bookkeeping gets its turn: the first message's ack;
each end costs a Celery round, 3-20 ms between two images on the H200, so a chain is long),
or as soon as the worker begins to stop: the main process touches its stop file on SIGTERM
(`worker_shutting_down`), so a stopping worker finishes the job it runs and takes no other.
`SDFARM_CHAIN=0` turns chaining off.

Lookahead (`SDFARM_LOOKAHEAD`, on unless `0`; a worker with one engine slot): just before a
job's native call the slot takes the next message on its lookahead thread, claims its job
ahead (store/lua/claim_ahead.lua: running under this process, marked `ahead`) and prepares it
(its parameters checked, its inputs read, its engine taken when it is the one already loaded,
the engine's own checks done: `Engine.prepare`), while the runtime generates without the GIL.
Between two images there is then no Redis round trip at all. A job claimed ahead begins when
its run does: the slot writes its local start mark first (sdfarm.worker.startmark), then the
lookahead thread writes the start to Redis (store/lua/start.lua), off the path. So an abort
is charged to the job that was running: a process that dies before the next job began
leaves it `ahead`, which the scheduler re-places without counting an attempt, and the
slot's next process, reading the start mark, places it again (not begun) or charges it
(begun, its start not yet in Redis): `Store.restore_held`. The message taken ahead is
recorded as the slot's held message, which that next process puts back; a stopping worker
places the job again and puts the message back itself. With N > 1 slots nothing is taken
ahead: another slot may be idle, and a message held behind a long job would wait for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sdfarm.native.gate import GATE

log = logging.getLogger("sdfarm.worker")

CHAIN_ENV = "SDFARM_CHAIN"
LOOKAHEAD_ENV = "SDFARM_LOOKAHEAD"
CHAIN_MAX_JOBS = 1000
CHAIN_MAX_S = 60.0
AHEAD_POLL_S = 0.002
AHEAD_POLL_MAX_S = 0.1

Link = tuple[Any, Any]
"""What `Chain.next()` gives: (the message taken, the job prepared ahead or None)."""


def _switch(env: Mapping[str, str] | None, name: str) -> bool:
    env = os.environ if env is None else env
    return (env.get(name) or "1").strip().lower() not in ("0", "off", "false", "no")


def chaining(env: Mapping[str, str] | None = None) -> bool:
    """Whether a slot takes the next message itself (`SDFARM_CHAIN`, on unless `0`)."""
    return _switch(env, CHAIN_ENV)


def looking_ahead(env: Mapping[str, str] | None = None) -> bool:
    """Whether a chaining slot takes and prepares the next job during the current one's
    native call (`SDFARM_LOOKAHEAD`, on unless `0`)."""
    return _switch(env, LOOKAHEAD_ENV)


class Chain:
    """The jobs one Celery task runs after its own: `next()` gives each one's message (and
    the job prepared ahead, when `ahead()` was called) until the chain ends. Every probe is a
    parameter: `pop` takes a message, `stopping`, `clock`; with `prepare` the chain looks
    ahead, running `pop` then `prepare(message)` through `run_ahead` (the process's lookahead
    thread), and a message it took for a worker that began to stop goes back through
    `push_back`, its prepared job through `discard`. When the chain ends, `forget` says that
    the last message taken ran (nothing is held for a successor to put back)."""

    def __init__(
        self,
        pop: Callable[[], Any],
        stopping: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
        max_jobs: int = CHAIN_MAX_JOBS,
        max_s: float = CHAIN_MAX_S,
        prepare: Callable[[Any], Any] | None = None,
        push_back: Callable[[Any], None] | None = None,
        discard: Callable[[Any], None] | None = None,
        run_ahead: Callable[[Callable[[], Any]], Future[Any]] | None = None,
        forget: Callable[[], None] | None = None,
    ) -> None:
        self.pop = pop
        self.stopping = stopping
        self.clock = clock
        self.max_jobs = max_jobs
        self.deadline = clock() + max_s
        self.taken = 0
        self.prepare = prepare
        self.push_back = push_back
        self.discard = discard
        self.run_ahead = run_ahead or _lookahead_thread().submit
        self.forget = forget
        self._ahead: Future[Any] | None = None
        self._current_ended = threading.Event()

    def _may_take(self) -> bool:
        return self.taken < self.max_jobs and self.clock() < self.deadline and not self.stopping()

    def _take(self) -> Any:
        try:
            found = self.pop()
        except Exception as exc:  # noqa: BLE001 - Celery's consumer takes over on a Redis blip
            log.warning("chain: the next message not taken: %s", exc)
            return None
        if found is not None:
            self.taken += 1
        return found

    def ahead(self) -> None:
        """The current job's native call is about to start: take and prepare the next job
        meanwhile (nothing when the chain does not look ahead or is ending)."""
        if self.prepare is None or self._ahead is not None or not self._may_take():
            return
        self._current_ended.clear()
        self._ahead = self.run_ahead(self._take_and_prepare)

    def _take_and_prepare(self) -> Link | None:
        """On the lookahead thread: take the next message as soon as there is one, until the
        current job ends. The scheduler sends a device's next job only once the job before
        the current one has written its result (its backlog bound), that is some time into
        the current job: the queue is looked at again after AHEAD_POLL_S, then at growing
        intervals up to AHEAD_POLL_MAX_S (a long job costs a few Redis reads per second)."""
        GATE.wait()  # not while the job thread starts the current job's native call
        wait = AHEAD_POLL_S
        while (message := self._take()) is None:
            if self._current_ended.wait(wait) or self.stopping():
                return None
            wait = min(wait * 1.5, AHEAD_POLL_MAX_S)
        try:
            return message, self.prepare(message) if self.prepare else None
        except Exception:  # noqa: BLE001 - the job is prepared again when it starts
            log.exception("chain: the next job not prepared ahead")
            return message, None

    def next(self) -> Link | None:
        """The next job to run in this task, or None: the chain ends."""
        link = self._next()
        if link is None and self.taken and self.forget is not None:
            try:
                self.forget()
            except Exception as exc:  # noqa: BLE001 - a stale message put back is dropped
                log.warning("chain: the held message not forgotten: %s", exc)
        return link

    def _next(self) -> Link | None:
        if self._ahead is not None:
            self._current_ended.set()  # the lookahead stops looking; what it took comes here
            got, self._ahead = self._ahead.result(), None
            if got is not None and self.stopping():
                self._give_back(got)
                return None
            if got is not None:
                return got
        if not self._may_take():
            return None
        message = self._take()
        return None if message is None else (message, None)

    def _give_back(self, link: Link) -> None:
        """A stopping worker runs no other job: the message taken ahead goes back."""
        message, ready = link
        self.taken -= 1
        if ready is not None and self.discard is not None:
            self.discard(ready)  # first: its job is placed again before its message is back
        try:
            if self.push_back is not None:
                self.push_back(message)
        except Exception as exc:  # noqa: BLE001 - restored by the next process of this slot
            log.warning("chain: the message taken ahead not put back: %s", exc)


_executor: tuple[int, ThreadPoolExecutor] | None = None


def _lookahead_thread() -> ThreadPoolExecutor:
    """This process's lookahead thread (a forked child starts its own): one thread for the
    process's life, since a thread start per job cost about 0.3 ms on the path of every job."""
    global _executor
    if _executor is None or _executor[0] != os.getpid():
        _executor = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="sdfarm-ahead"))
    return _executor[1]


def stop_requested(ctx: Any) -> Callable[[], bool]:
    """The stop probe of a worker process: its context is stopping, or the worker's stop
    file exists (the main process's SIGTERM)."""
    stop_file = Path(ctx.config.stop_file) if ctx.config.stop_file else None

    def stopping() -> bool:
        return ctx.stopping or (stop_file is not None and stop_file.exists())

    return stopping


def for_context(
    ctx: Any,
    prepare: Callable[[Any], Any] | None = None,
    discard: Callable[[Any], None] | None = None,
) -> Chain | None:
    """The chain of this worker process's next task, or None when chaining is off. It looks
    ahead with `prepare` (and `discard`) when lookahead is on and the process is its
    device's only engine slot."""
    if not chaining():
        return None
    device, taker = ctx.config.device_key, str(ctx.slot)
    alone = ctx.board is None
    return Chain(
        lambda: ctx.store.next_message(device, taker),
        stop_requested(ctx),
        prepare=prepare if looking_ahead() and alone else None,
        push_back=lambda message: ctx.store.push_back(device, message, taker),
        discard=discard,
        forget=lambda: ctx.store.forget_held(device, taker),
    )
