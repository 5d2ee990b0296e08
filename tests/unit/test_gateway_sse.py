"""The async event stream (sdfarm.gateway.sse) over a fake async store whose `listen` hands out
a real Notice that the fake sets when it appends events (what the Redis channel does): every
event once and in order, a trimmed list followed by what is newer, the end on a final event,
an expired job, a Redis error; reads happen on notices (not on a timer), a quiet stream reads
only every state_s; the response's framing and keepalives (sse-starlette); many streams
sharing one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.routing import Route

from sdfarm.gateway.sse import response, stream
from sdfarm.store.notices import Notice


def ev(kind: str, t: float, **fields: Any) -> bytes:
    return json.dumps({"event": kind, "t": t, **fields}).encode()


class FakeStore:
    """An events list, a state, and the notice a published event sets."""

    def __init__(self, events: list[bytes], state: str = "queued") -> None:
        self.events = list(events)
        self.job_state = state
        self.reads = 0
        self.state_reads = 0
        self.list_reads = 0
        self.fail = False
        self.listen_fails = False
        self.notice = Notice()
        self.listening = 0

    @contextlib.asynccontextmanager
    async def listen(self, job_id: str) -> AsyncIterator[Notice]:
        if self.listen_fails:
            raise ConnectionError("Error 111 connecting to /run/redis/redis.sock")
        self.listening += 1
        try:
            yield self.notice
        finally:
            self.listening -= 1

    def publish(self, *events: bytes, state: str | None = None) -> None:
        """Append (and publish) events, as a script's log() does."""
        self.events += events
        if state is not None:
            self.job_state = state
        self.notice.set()

    async def newest_event(self, job_id: str) -> bytes | None:
        self.reads += 1
        if self.fail:
            raise ConnectionError("Error 111 connecting to /run/redis/redis.sock")
        return self.events[-1] if self.events else None

    async def state(self, job_id: str) -> str:
        self.state_reads += 1
        return self.job_state

    async def raw_events(self, job_id: str) -> list[bytes]:
        self.list_reads += 1
        return list(self.events)


Script = Callable[[FakeStore], Awaitable[None]]


def collect(store: FakeStore, script: Script | None = None, **options: Any) -> list[dict[str, str]]:
    """What the stream yields while `script` changes the store."""

    async def run() -> list[dict[str, str]]:
        task = asyncio.create_task(script(store)) if script else None
        out = [item async for item in stream(store, "j", **options)]  # type: ignore[arg-type]
        if task:
            await task
        return out

    return asyncio.run(asyncio.wait_for(run(), 10))


def kinds(items: list[dict[str, str]]) -> list[str]:
    return [item["event"] for item in items]


def test_events_in_order_until_the_final_one_read_on_notices_only() -> None:
    store = FakeStore([ev("queued", 1)])

    async def script(s: FakeStore) -> None:
        await asyncio.sleep(0.05)
        s.publish(ev("placed", 2), ev("running", 3))
        await asyncio.sleep(0.05)
        s.publish(ev("step", 4, step=1), ev("done", 5), state="done")

    items = collect(store, script, state_s=3600)
    assert kinds(items) == ["queued", "placed", "running", "step", "done"]
    assert json.loads(items[3]["data"])["step"] == 1
    # One read at the start and one per notice: no polling in between.
    assert store.reads == 3 and store.list_reads == 3 and store.state_reads == 0
    assert store.listening == 0  # unsubscribed at the end


def test_a_trimmed_list_continues_after_the_last_event_sent() -> None:
    store = FakeStore([ev("queued", 1), ev("step", 2)])

    async def script(s: FakeStore) -> None:
        await asyncio.sleep(0.05)  # trimmed past "step" (t=2): only newer ones follow
        s.events = [ev("step", 1.5), ev("step", 3)]
        s.publish(ev("failed", 4, error="in /srv/x"), state="failed")

    items = collect(store, script, clean=lambda text: text.replace("/srv/x", "<path>"))
    assert kinds(items) == ["queued", "step", "step", "failed"]
    assert '"t": 3' in items[2]["data"]
    assert "<path>" in items[3]["data"] and "/srv" not in items[3]["data"]


def test_an_expired_job_and_a_redis_error_end_the_stream() -> None:
    assert kinds(collect(FakeStore([], state=""))) == ["expired"]
    assert kinds(collect(FakeStore([], state="done"))) == ["done"]

    async def breaks(s: FakeStore) -> None:
        await asyncio.sleep(0.05)
        s.fail = True
        s.publish(ev("placed", 2))

    clean = {"clean": lambda text: text.replace("/run/redis/redis.sock", "<path>")}
    items = collect(FakeStore([ev("queued", 1)]), breaks, **clean)
    assert kinds(items) == ["queued", "error"] and "redis.sock" not in items[-1]["data"]
    unsubscribable = FakeStore([ev("queued", 1)])
    unsubscribable.listen_fails = True
    items = collect(unsubscribable, **clean)
    assert kinds(items) == ["error"] and "<path>" in items[0]["data"]


def test_a_quiet_stream_reads_only_every_state_s() -> None:
    store = FakeStore([ev("queued", 1)])

    async def expire(s: FakeStore) -> None:
        await asyncio.sleep(0.5)  # the job's keys expire together, and publish nothing
        s.events, s.job_state = [], ""

    assert kinds(collect(store, expire, state_s=0.1)) == ["queued", "expired"]
    assert 4 <= store.reads <= 8  # about 0.5 / 0.1, not a poll loop
    assert store.state_reads <= store.reads


def test_the_response_frames_events_and_sends_keepalives() -> None:
    store = FakeStore([ev("queued", 1)])

    async def endpoint(request: Any) -> Any:
        return response(store, "j", clean=str, keepalive_s=0.05, state_s=0.1)  # type: ignore[arg-type]

    async def run() -> httpx.Response:
        async def expire() -> None:
            await asyncio.sleep(0.4)
            store.events, store.job_state = [], ""

        task = asyncio.create_task(expire())
        app = Starlette(routes=[Route("/events", endpoint)])
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            r = await c.get("/events")
        await task
        return r

    r = asyncio.run(asyncio.wait_for(run(), 10))
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.startswith(f"event: queued\ndata: {ev('queued', 1).decode()}\n\n")
    # sse-starlette's ping runs beside the stream, so a keepalive comment (no event) can race
    # the end on a slow machine; no event may follow the last one
    body = r.text
    while body.endswith(": keepalive\n\n"):
        body = body.removesuffix(": keepalive\n\n")
    assert body.endswith('event: expired\ndata: {"state": ""}\n\n')
    assert r.text.count(": keepalive\n\n") >= 2


def test_many_streams_share_one_loop() -> None:
    async def run() -> int:
        stores = [FakeStore([ev("queued", 1)]) for _ in range(2000)]

        async def one(s: FakeStore) -> int:
            n = 0
            async for _ in stream(s, "j"):  # type: ignore[arg-type]
                n += 1
                s.publish(ev("cancelled", 2), state="cancelled")
            return n

        return sum(await asyncio.gather(*(one(s) for s in stores)))

    assert asyncio.run(asyncio.wait_for(run(), 30)) == 4000


def test_a_preview_image_is_never_scrubbed_and_a_removed_preview_keeps_the_place() -> None:
    """Base64 can hold what looks like a path ("+/ab/c"): the image field passes as it is,
    while text fields are still cleaned. The store removes a preview event when the next one
    comes (lua/preview.lua): a stream whose last event vanished goes on after it."""
    image = "AAAA+/tmp/x/yy=="
    store = FakeStore([ev("queued", 1), ev("preview", 2, seq=1, image=image, note="/tmp/a")])

    async def script(s: FakeStore) -> None:
        await asyncio.sleep(0.05)  # the next preview replaces the first one
        s.events = [ev("queued", 1)]
        s.publish(ev("step", 3), ev("preview", 4, seq=2, image=image))
        await asyncio.sleep(0.05)
        s.publish(ev("done", 5), state="done")

    items = collect(store, script, clean=lambda text: text.replace("/tmp", "<path>"))
    assert kinds(items) == ["queued", "preview", "step", "preview", "done"]
    first = json.loads(items[1]["data"])
    assert first["image"] == image and first["note"] == "<path>/a"
    assert json.loads(items[3]["data"])["seq"] == 2
