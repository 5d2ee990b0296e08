"""The async event stream (sdfarm.gateway.sse) over a fake async store: every event once and in
order, a trimmed list followed by what is newer, the end on a final event, an expired job, a
Redis error, keepalives, idle back-off, and many streams sharing one event loop."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from sdfarm.gateway.sse import stream


def ev(kind: str, t: float, **fields: Any) -> bytes:
    return json.dumps({"event": kind, "t": t, **fields}).encode()


class FakeStore:
    """An events list and a state that a script changes as the stream reads."""

    def __init__(self, events: list[bytes], state: str = "queued") -> None:
        self.events = list(events)
        self.job_state = state
        self.reads = 0
        self.state_reads = 0
        self.list_reads = 0
        self.on_read: Any = None
        self.fail = False

    async def newest_event(self, job_id: str) -> bytes | None:
        self.reads += 1
        if self.on_read is not None:
            self.on_read(self)
        if self.fail:
            raise ConnectionError("Error 111 connecting to /run/redis/redis.sock")
        return self.events[-1] if self.events else None

    async def state(self, job_id: str) -> str:
        self.state_reads += 1
        return self.job_state

    async def raw_events(self, job_id: str) -> list[bytes]:
        self.list_reads += 1
        return list(self.events)


def collect(store: FakeStore, **options: Any) -> list[str]:
    async def run() -> list[str]:
        out = []
        async for chunk in stream(store, "j", poll_s=0.001, idle_poll_s=0.004, **options):
            out.append(chunk.decode())
        return out

    return asyncio.run(asyncio.wait_for(run(), 10))


def kinds(chunks: list[str]) -> list[str]:
    return [c.split("\n", 1)[0].removeprefix("event: ") for c in chunks]


def test_events_in_order_until_the_final_one() -> None:
    store = FakeStore([ev("queued", 1)])

    def script(s: FakeStore) -> None:
        if s.reads == 3:
            s.events += [ev("placed", 2), ev("running", 3)]
        elif s.reads == 6:
            s.events += [ev("step", 4, step=1), ev("done", 5)]
            s.job_state = "done"

    store.on_read = script
    assert kinds(collect(store)) == ["queued", "placed", "running", "step", "done"]
    assert store.list_reads == 3  # the list is read only when its newest event is news


def test_a_trimmed_list_continues_after_the_last_event_sent() -> None:
    store = FakeStore([ev("queued", 1), ev("step", 2)])

    def script(s: FakeStore) -> None:
        if s.reads == 3:  # trimmed past "step" (t=2): only newer ones follow
            s.events = [ev("step", 1.5), ev("step", 3), ev("failed", 4, error="in /srv/x")]

    store.on_read = script
    chunks = collect(store, clean=lambda text: text.replace("/srv/x", "<path>"))
    assert kinds(chunks) == ["queued", "step", "step", "failed"]
    assert '"t": 3' in chunks[2] and "<path>" in chunks[3] and "/srv" not in chunks[3]


def test_an_expired_job_and_a_redis_error_end_the_stream() -> None:
    assert kinds(collect(FakeStore([], state=""))) == ["expired"]
    assert kinds(collect(FakeStore([], state="done"))) == ["done"]
    broken = FakeStore([ev("queued", 1)])
    broken.on_read = lambda s: setattr(s, "fail", s.reads > 2)
    chunks = collect(broken, clean=lambda text: text.replace("/run/redis/redis.sock", "<path>"))
    assert kinds(chunks) == ["queued", "error"] and "redis.sock" not in chunks[-1]


def test_keepalives_and_idle_backoff() -> None:
    store = FakeStore([ev("queued", 1)])
    t0 = time.monotonic()
    store.on_read = lambda s: setattr(
        s, "job_state", "" if time.monotonic() - t0 > 0.2 else "queued"
    )
    chunks = collect(store, keepalive_s=0.05, state_s=0.02)
    assert chunks[0].startswith("event: queued") and chunks[-1].startswith("event: expired")
    assert chunks.count(": keepalive\n\n") >= 2
    assert store.reads < 0.2 / 0.001 / 2  # backed off from poll_s towards idle_poll_s
    assert store.state_reads < store.reads / 2  # the state only now and then


def test_the_state_is_read_only_once_the_events_are_gone() -> None:
    store = FakeStore([ev("queued", 1)])

    def expire(s: FakeStore) -> None:
        if s.reads > 30:  # the job's keys expire together
            s.events, s.job_state = [], ""

    store.on_read = expire
    assert kinds(collect(store, state_s=3600)) == ["queued", "expired"]
    assert store.state_reads == 1


def test_many_streams_share_one_loop() -> None:
    async def run() -> int:
        stores = [FakeStore([ev("queued", 1)]) for _ in range(2000)]

        async def one(s: FakeStore) -> int:
            n = 0
            async for _ in stream(s, "j", poll_s=0.001, idle_poll_s=0.01):
                n += 1
                s.job_state = "cancelled"
                s.events.append(ev("cancelled", 2))
            return n

        return sum(await asyncio.gather(*(one(s) for s in stores)))

    assert asyncio.run(asyncio.wait_for(run(), 30)) == 4000


def test_a_preview_image_is_never_scrubbed_and_a_removed_preview_keeps_the_place() -> None:
    """Base64 can hold what looks like a path ("+/ab/c"): the image field passes as it is,
    while text fields are still cleaned. The store removes a preview event when the next one
    comes (lua/preview.lua): a stream whose last event vanished goes on after it."""
    image = "AAAA+/tmp/x/yy=="
    store = FakeStore([ev("queued", 1), ev("preview", 2, seq=1, image=image, note="/tmp/a")])

    def script(s: FakeStore) -> None:
        if s.reads == 3:  # the next preview replaces the first one
            s.events = [ev("queued", 1), ev("step", 3), ev("preview", 4, seq=2, image=image)]
        elif s.reads == 6:
            s.events += [ev("done", 5)]
            s.job_state = "done"

    store.on_read = script
    chunks = collect(store, clean=lambda text: text.replace("/tmp", "<path>"))
    assert kinds(chunks) == ["queued", "preview", "step", "preview", "done"]
    first = json.loads(chunks[1].split("data: ", 1)[1])
    assert first["image"] == image and first["note"] == "<path>/a"
    assert json.loads(chunks[3].split("data: ", 1)[1])["seq"] == 2
