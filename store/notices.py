"""`Notices`: one Redis pub/sub connection that wakes every async watcher of a loop.

Every event a script appends to a job's events list is also published on the job's channel
(`keys.events_channel`). A watcher (a gateway request waiting for its job, an event stream)
enters `listen(job_id)` and awaits its `Notice`; whatever the number of watchers, they share
ONE connection: a channel is subscribed while at least one watcher listens to it, and one
reader task hands each message to that channel's watchers. So 500 waiting requests hold no
thread and no connection each (a blocking BLMOVE per waiter would hold a pooled connection for
its whole wait: 500 waiters, 500 connections).

Pub/sub delivers at most once: a message published while the connection was down is lost.
So `listen` returns only once Redis confirmed the subscription (the watcher reads the job's
state after that, and anything later wakes it), every watcher is woken when the connection
fails (it reads again, and rides out the outage as its reads do), and a watcher never waits
longer than a bounded slice (`aio.WAIT_SLICE_S`) before it reads again anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from sdfarm.store import keys

SUBSCRIBE_WAIT_S = 5.0
"""How long `listen` waits for Redis to confirm a subscription; past it the watcher goes on
(its bounded slice covers a notice it might miss)."""
RECONNECT_S = 0.5
"""Pause before the reader reads again after its connection failed."""


class Notice:
    """A watcher's wake-up: set by a message on its job's channel (or a lost connection)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout: float) -> bool:
        """True when something happened since the last wait returned True; False after
        `timeout` seconds of nothing. The watcher reads what it needs after it returns."""
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                await self._event.wait()
        except TimeoutError:
            return False
        self._event.clear()
        return True


class Notices:
    """The pub/sub side of one AsyncStore: one connection, one reader task, refcounted
    subscriptions. Belongs to the event loop of its client."""

    def __init__(self, client: Any) -> None:
        self._pubsub = client.pubsub()
        self._watchers: dict[bytes, set[Notice]] = {}
        self._confirms: dict[bytes, deque[asyncio.Future[None]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._sending = asyncio.Lock()
        """One SUBSCRIBE / UNSUBSCRIBE at a time: redis-py's PubSub opens its connection on the
        first command, and two first commands at once would each open one (one orphaned)."""

    def watched(self) -> int:
        """Channels subscribed now (one per job someone waits for or streams)."""
        return len(self._watchers)

    @contextlib.asynccontextmanager
    async def listen(self, job_id: str) -> AsyncIterator[Notice]:
        """A Notice woken by every event of the job, from the moment this returns."""
        channel = keys.events_channel(job_id).encode()
        notice = Notice()
        watchers = self._watchers.setdefault(channel, set())
        watchers.add(notice)
        try:
            confirms = self._confirms.setdefault(channel, deque())
            if len(watchers) == 1:
                confirms.append(asyncio.get_running_loop().create_future())
                async with self._sending:
                    await self._pubsub.subscribe(channel)
                self._start_reader()
            if confirms:  # wait until Redis has it (ours, or the first watcher's)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(SUBSCRIBE_WAIT_S):
                        await asyncio.shield(confirms[-1])
            yield notice
        finally:
            watchers.discard(notice)
            if not watchers:
                self._watchers.pop(channel, None)
                self._confirms.pop(channel, None)
                with contextlib.suppress(Exception):  # a dead connection forgets it anyway
                    async with self._sending:
                        await self._pubsub.unsubscribe(channel)

    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        """Hand every message to its channel's watchers, for as long as the store lives."""
        while True:
            try:
                msg = await self._pubsub.get_message(timeout=None)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - connection lost: everyone reads again
                self._wake_all()
                await asyncio.sleep(RECONNECT_S)
                continue
            if msg is None:
                continue
            channel, kind = msg.get("channel"), msg.get("type")
            if kind == "message":
                for notice in self._watchers.get(channel, ()):
                    notice.set()
            elif kind == "subscribe":
                confirms = self._confirms.get(channel)
                if confirms:
                    done = confirms.popleft()
                    if not done.done():
                        done.set_result(None)
                    if not confirms:
                        confirms.append(_resolved())

    def _wake_all(self) -> None:
        for watchers in self._watchers.values():
            for notice in watchers:
                notice.set()
        for confirms in self._confirms.values():
            for waiting in confirms:
                if not waiting.done():
                    waiting.set_result(None)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()


def _resolved() -> asyncio.Future[None]:
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done
