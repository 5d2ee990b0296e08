"""The status document behind `GET /v1/status` (and the page at `GET /`): devices grouped by
host with a memory split (free, held by our engines, other), loaded models, queue depth by
priority, running jobs with their progress and latest preview (a data URL, for jobs that
asked for previews), and the newest finished jobs as thumbnails.

Everything is read through the store on each call (one `Farm.status()` plus a few batched
reads). With tokens, a normal token sees only its own jobs in it (`viewer`); the queues and the
device figures stay visible to every token. The only gateway-side state is the short list of
job ids this gateway process submitted (`RecentJobs`), merged with the farm's list of recently
finished jobs (`Store.recent`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sdfarm.client.farm import Farm
from sdfarm.gateway.auth import OPEN, Caller
from sdfarm.native.preview import Preview

RECENT_SHOWN = 8
RECENT_KEPT = 32  # ids remembered: enough that 8 are done while a batch is still queued

__all__ = ["RECENT_SHOWN", "RecentJobs", "memory_split", "status_doc"]


class RecentJobs:
    """The ids of the jobs this gateway submitted, newest first, capped."""

    def __init__(self, cap: int = RECENT_KEPT) -> None:
        self._ids: deque[str] = deque(maxlen=cap)
        self._mu = threading.Lock()

    def add(self, job_id: str) -> None:
        with self._mu:
            self._ids.appendleft(job_id)

    def ids(self) -> list[str]:
        with self._mu:
            return list(self._ids)


def _int(value: Any) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


def memory_split(hb: dict[str, Any]) -> dict[str, int]:
    """{total, free, ours, other} in bytes for one device's heartbeat: `ours` is the sum of the
    loaded engines' estimates, `other` what is used beyond them (never negative). A device
    whose free figure is over its total (no budget reported) counts as all free."""
    total = _int(hb.get("total"))
    free = min(_int(hb.get("free")), total)
    ours = sum(_int(m.get("estimate")) for m in hb.get("loaded") or [] if isinstance(m, dict))
    return {"total": total, "free": free, "ours": ours, "other": max(0, total - free - ours)}


def _device(d: dict[str, Any]) -> dict[str, Any]:
    loaded = [
        {
            "name": str(m.get("name", "")),
            "estimate": _int(m.get("estimate")),
            "busy": bool(m.get("busy")),
            "pinned": bool(m.get("pinned")),
            "idle_s": m.get("idle_s"),
        }
        for m in d.get("loaded") or []
        if isinstance(m, dict)
    ]
    return {
        "key": d.get("key"),
        "host": d.get("host"),
        "device": d.get("device"),
        "type": d.get("type") or "",
        "description": d.get("description") or "",
        "alive": bool(d.get("alive")),
        "state": d.get("state") or ("" if d.get("alive") else "offline"),
        "figure": d.get("figure"),
        "capacity": d.get("capacity"),
        "mem_available": d.get("mem_available"),
        "memory": memory_split(d),
        "loaded": loaded,
        "loading": d.get("loading"),
        "current_job": d.get("current_job"),
        "jobs": d.get("jobs") or [],
    }


def _preview(doc: Any) -> dict[str, Any] | None:
    """A running job's latest preview event as the page shows it: step and a data URL."""
    try:
        p = Preview.from_event(doc) if isinstance(doc, dict) else None
    except (KeyError, TypeError, ValueError):
        return None
    if p is None:
        return None
    return {"seq": p.seq, "step": p.step, "steps": p.steps, "width": p.width,
            "height": p.height, "url": p.data_url()}  # fmt: skip


def status_doc(
    farm: Farm,
    local_recent: list[str],
    image_url: Callable[[str, int], str],
    *,
    shown: int = RECENT_SHOWN,
    viewer: Caller = OPEN,
) -> dict[str, Any]:
    """The JSON document of `GET /v1/status`. A `viewer` that does not see everything (a
    normal token) gets the devices, queues and figures, but of the jobs only its own: the
    running ones, the latest images, and the job ids on each device."""
    st = farm.status()
    store = farm.store
    running = st["running"]
    ids = [job["id"] for job in running]
    owners: dict[str, str] = {}
    if not viewer.sees_all and ids:
        owners = {j: o for j, (o,) in zip(ids, store.jobs_fields(ids, ("owner",)), strict=True)}
        running = [job for job in running if viewer.may_see(owners[job["id"]])]

    def mine(job_id: Any) -> bool:
        return viewer.sees_all or viewer.may_see(owners.get(str(job_id), ""))

    devices = []
    for d in st["devices"]:
        doc = _device(d)
        if not viewer.sees_all:
            doc["jobs"] = [j for j in doc["jobs"] if mine(j)]
            doc["current_job"] = doc["current_job"] if mine(doc["current_job"]) else None
        devices.append(doc)
    hosts: dict[str, list[str]] = {}
    for d in devices:
        hosts.setdefault(str(d["host"]), []).append(str(d["key"]))

    progress = store.progress_of([job["id"] for job in running])
    previews = store.previews_of([job["id"] for job in running])
    runs = [
        {
            **job,
            "progress": prog if isinstance(prog, dict) else None,
            "preview": _preview(pre),
        }
        for job, prog, pre in zip(running, progress, previews, strict=True)
    ]

    ids = list(dict.fromkeys([*local_recent, *store.recent(RECENT_KEPT)]))
    recent: list[dict[str, Any]] = []
    names = ("state", "model", "ended", "spec", "owner")
    fields = store.jobs_fields(ids, names) if ids else []
    for job_id, (state, model, ended, spec, owner) in zip(ids, fields, strict=True):
        if state != "done" or not viewer.may_see(owner):
            continue
        try:
            params = json.loads(spec or "{}").get("params", {})
        except ValueError:
            params = {}
        recent.append(
            {
                "id": job_id,
                "model": model,
                "prompt": str(params.get("prompt", ""))[:200],
                "ended": float(ended or 0.0),
                "url": image_url(job_id, 0),
            }
        )
    recent.sort(key=lambda x: x["ended"], reverse=True)
    return {
        "time": time.time(),
        "leader": st["leader"],
        "hosts": [{"host": h, "devices": keys} for h, keys in sorted(hosts.items())],
        "devices": devices,
        "queues": st["queues"],
        "pending": st["pending"],
        "running": runs,
        "recent": recent[:shown],
    }
