"""A job's events as server-sent events (`GET /v1/jobs/{id}/events`), read through the async
store (`sdfarm.store.aio`): each stream is an async generator on the server's event loop that
awaits between reads, so a thousand open streams hold no thread and do not slow other requests.

Each read is one command, for the newest event; the whole list is read only when that is an
event the stream has not sent, and the job's state only when the job has no events list or
every SSE_STATE_S (a job's record and its events live and expire together). A stream with
news reads every SSE_POLL_S; one that sees nothing new reads less and less often, up to every
SSE_IDLE_POLL_S (each with a little jitter, so streams opened together do not read together).

The events list is capped and trimmed from the front, so the stream keeps its place by the
last event it sent rather than by an index; a keepalive comment goes out when nothing happens
for a while, so proxies keep the connection open.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from sdfarm.store import FINAL_STATES
from sdfarm.store.aio import AsyncStore

SSE_POLL_S = 0.1
SSE_IDLE_POLL_S = 0.5
SSE_BACKOFF = 1.5
SSE_JITTER = 0.2
SSE_KEEPALIVE_S = 15.0
SSE_STATE_S = 5.0
EVENT_FINAL = frozenset(FINAL_STATES)
BINARY = frozenset({"image"})
"""Fields that carry data, not text (a preview's base64 image): never scrubbed, since base64
can hold what looks like a path ("+/ab/c") and scrubbing would corrupt it."""


async def stream(
    store: AsyncStore,
    job_id: str,
    *,
    clean: Callable[[str], str] = lambda text: text,
    poll_s: float = SSE_POLL_S,
    idle_poll_s: float = SSE_IDLE_POLL_S,
    keepalive_s: float = SSE_KEEPALIVE_S,
    state_s: float = SSE_STATE_S,
) -> AsyncIterator[bytes]:
    """The job's events as SSE (`event: <kind>`, `data: <json>`), from the first one; ends
    after done, failed or cancelled, once the job's record is gone (an event named after its
    state, or `expired`), or when Redis cannot be read (`error`). `clean` is applied to every
    text field of an event but BINARY ones (the gateway scrubs paths from errors with it).
    When the list was trimmed past the last event sent, what is newer than it follows."""
    last: bytes | None = None
    last_t = 0.0
    idle = checked = time.monotonic()
    delay = poll_s
    while True:
        try:
            newest = await store.newest_event(job_id)
            raw = await store.raw_events(job_id) if newest is not None and newest != last else []
            state = None  # not read this time
            if newest is None or time.monotonic() - checked > state_s:
                state, checked = await store.state(job_id), time.monotonic()
        except Exception as exc:  # noqa: BLE001 - Redis went away: say so, then end
            doc = {"event": "error", "error": clean(f"farm unavailable: {exc}")}
            yield f"event: error\ndata: {json.dumps(doc)}\n\n".encode()
            return
        if raw:
            start = 0
            if last is not None:
                try:
                    start = len(raw) - raw[::-1].index(last)
                except ValueError:  # trimmed past it: what is newer than it
                    start = next((k for k, x in enumerate(raw) if _event_t(x) > last_t), len(raw))
            for item in raw[start:]:
                last, last_t = item, _event_t(item)
                try:
                    ev = json.loads(item)
                except ValueError:
                    continue
                if not isinstance(ev, dict):
                    continue
                ev = {
                    k: clean(v) if isinstance(v, str) and k not in BINARY else v
                    for k, v in ev.items()
                }
                kind = str(ev.get("event", "message"))
                yield f"event: {kind}\ndata: {json.dumps(ev)}\n\n".encode()
                idle = time.monotonic()
                if kind in EVENT_FINAL:
                    return
            delay = poll_s
        else:
            delay = min(idle_poll_s, delay * SSE_BACKOFF)
        if state is not None and (not state or (state in EVENT_FINAL and newest is None)):
            yield f"event: {state or 'expired'}\ndata: {json.dumps({'state': state})}\n\n".encode()
            return
        if time.monotonic() - idle > keepalive_s:
            idle = time.monotonic()
            yield b": keepalive\n\n"
        await asyncio.sleep(delay * random.uniform(1 - SSE_JITTER, 1 + SSE_JITTER))


def _event_t(raw: bytes) -> float:
    try:
        doc: Any = json.loads(raw)
        return float(doc.get("t", 0.0))
    except (ValueError, AttributeError, TypeError):
        return 0.0
