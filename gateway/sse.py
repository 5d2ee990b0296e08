"""A job's events as server-sent events (`GET /v1/jobs/{id}/events`), read through the store.

The events list is capped and trimmed from the front, so the stream keeps its place by the
last event it sent rather than by an index; a keepalive comment goes out when nothing happens
for a while, so proxies keep the connection open.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

from sdfarm.store import FINAL_STATES, Store

SSE_POLL_S = 0.1
SSE_KEEPALIVE_S = 15.0
EVENT_FINAL = frozenset(FINAL_STATES)


def stream(store: Store, job_id: str) -> Iterator[bytes]:
    """The job's events as SSE (`event: <kind>`, `data: <json>`), from the first one; ends
    after done, failed or cancelled. Reads the events list every SSE_POLL_S (at most
    EVENTS_CAP short strings); when the list was trimmed past the last event sent, what is
    newer than it follows."""
    last: bytes | None = None
    last_t = 0.0
    idle = time.monotonic()
    while True:
        raw = store.raw_events(job_id)
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
            kind = str(ev.get("event", "message"))
            yield f"event: {kind}\ndata: {json.dumps(ev)}\n\n".encode()
            idle = time.monotonic()
            if kind in EVENT_FINAL:
                return
        state = store.state(job_id)
        if not state or (state in EVENT_FINAL and not store.events_exist(job_id)):
            yield f"event: {state or 'expired'}\ndata: {json.dumps({'state': state})}\n\n".encode()
            return
        if time.monotonic() - idle > SSE_KEEPALIVE_S:
            idle = time.monotonic()
            yield b": keepalive\n\n"
        time.sleep(SSE_POLL_S)


def _event_t(raw: bytes) -> float:
    try:
        return float(json.loads(raw).get("t", 0.0))
    except (ValueError, AttributeError, TypeError):
        return 0.0
