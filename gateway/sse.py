"""A job's events as server-sent events (`GET /v1/jobs/{id}/events`), through `sse-starlette`
(`EventSourceResponse`: framing, keepalive comments, the client's disconnect) over the async
store (`sdfarm.store.aio`): each stream is an async generator on the server's event loop, so a
thousand open streams hold no thread and do not slow other requests.

A stream does not poll: it subscribes to the job's events channel (`AsyncStore.listen`, one
pub/sub connection shared by every stream and waiter of the loop) and reads only when a notice
says an event was appended, or every `state_s` (jittered) when nothing happened (a job's keys expire
without an event, and a notice can be lost to a dropped connection). Each read is one command,
for the newest event; the whole list is read only when that is an event the stream has not
sent, and the job's state only when the job has no events list or every `state_s`.

The events list is capped and trimmed from the front, so the stream keeps its place by the
last event it sent rather than by an index; a keepalive comment goes out every
SSE_KEEPALIVE_S (sse-starlette's ping), so proxies keep the connection open.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent

from sdfarm.store import FINAL_STATES
from sdfarm.store.aio import AsyncStore

SSE_KEEPALIVE_S = 15.0
SSE_STATE_S = 10.0
SSE_JITTER = 0.2
"""Each quiet wait is state_s times a factor in [1 - SSE_JITTER, 1 + SSE_JITTER], so streams
opened together do not all read in the same instant."""
SEP = "\n"
EVENT_FINAL = frozenset(FINAL_STATES)
BINARY = frozenset({"image"})
"""Fields that carry data, not text (a preview's base64 image): never scrubbed, since base64
can hold what looks like a path ("+/ab/c") and scrubbing would corrupt it."""


def response(
    store: AsyncStore,
    job_id: str,
    *,
    clean: Callable[[str], str],
    keepalive_s: float = SSE_KEEPALIVE_S,
    state_s: float = SSE_STATE_S,
) -> Any:
    """The streaming response of the job's events (`stream`), and a keepalive comment
    every `keepalive_s` (sse-starlette's ping, which also ends the stream when the client
    goes away)."""
    return EventSourceResponse(
        stream(store, job_id, clean=clean, state_s=state_s),
        headers={"Cache-Control": "no-cache"},
        ping=keepalive_s,
        sep=SEP,
        ping_message_factory=lambda: ServerSentEvent(comment="keepalive", sep=SEP),
    )


def _sse(kind: str, doc: dict[str, Any]) -> dict[str, str]:
    return {"event": kind, "data": json.dumps(doc)}


async def stream(
    store: AsyncStore,
    job_id: str,
    *,
    clean: Callable[[str], str] = lambda text: text,
    state_s: float = SSE_STATE_S,
) -> AsyncIterator[dict[str, str]]:
    """The job's events as SSE fields (`event`: its kind, `data`: its JSON), from the first
    one; ends after done, failed or cancelled, once the job's record is gone (an event named
    after its state, or `expired`), or when Redis cannot be read (`error`). `clean` is applied
    to every text field of an event but BINARY ones (the gateway scrubs paths from errors with
    it). When the list was trimmed past the last event sent, what is newer than it follows."""
    last: bytes | None = None
    last_t = 0.0
    checked = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        try:
            notice = await stack.enter_async_context(store.listen(job_id))
        except Exception as exc:  # noqa: BLE001 - Redis went away: say so, then end
            yield _sse("error", {"event": "error", "error": clean(f"farm unavailable: {exc}")})
            return
        while True:
            try:
                newest = await store.newest_event(job_id)
                news = newest is not None and newest != last
                raw = await store.raw_events(job_id) if news else []
                state = None  # not read this time
                if newest is None or time.monotonic() - checked >= state_s * (1 - SSE_JITTER):
                    state, checked = await store.state(job_id), time.monotonic()
            except Exception as exc:  # noqa: BLE001 - Redis went away: say so, then end
                yield _sse("error", {"event": "error", "error": clean(f"farm unavailable: {exc}")})
                return
            for item in _after(raw, last, last_t):
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
                yield _sse(kind, ev)
                if kind in EVENT_FINAL:
                    return
            if state is not None and (not state or (state in EVENT_FINAL and newest is None)):
                yield _sse(state or "expired", {"state": state})
                return
            due = state_s * random.uniform(1 - SSE_JITTER, 1 + SSE_JITTER)
            await notice.wait(due - (time.monotonic() - checked))


def _after(raw: list[bytes], last: bytes | None, last_t: float) -> list[bytes]:
    """The events of `raw` newer than `last` (all of them when nothing was sent yet; what is
    newer by time when the list was trimmed past it)."""
    if not raw or last is None:
        return raw
    try:
        return raw[len(raw) - raw[::-1].index(last) :]
    except ValueError:  # trimmed past it: what is newer than it
        return raw[next((k for k, x in enumerate(raw) if _event_t(x) > last_t), len(raw)) :]


def _event_t(raw: bytes) -> float:
    try:
        doc: Any = json.loads(raw)
        return float(doc.get("t", 0.0))
    except (ValueError, AttributeError, TypeError):
        return 0.0
