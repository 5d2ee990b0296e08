"""Result stores: where a finished job's images go, chosen by URL (`--results`,
`$SDFARM_RESULTS`).

- `redis` (`RedisResults`): the job's `result:{id}` hash, beside its record; it lives
  RESULT_TTL, with the record.
- `file:///shared/dir` (`FileResults`, results_file.py): `dir/{id}/{run}-{i}.png` in a folder every
  worker and reader sees; it stays until the job is deleted (`sdfarm delete`, `Farm.delete`,
  the gateway's DELETE) or swept (`sdfarm results sweep`).
- `s3://bucket/prefix` (`S3Results`, results_s3.py): objects `prefix/{id}/{run}-{i}.png` of any
  S3-compatible store; they stay until the job is deleted or the bucket's lifecycle rule
  expires them.

Redis is the default because it needs nothing else, and its cost is Redis memory: a result
there holds at most `REDIS_RESULT_MAX` bytes and all results together `REDIS_TOTAL_MAX`
(counted in Redis across workers); past either the job fails saying so, instead of filling
Redis until it refuses every write. Images of a file or S3 store never touch Redis: the job
record's `results` field says where they went (`{"store": URL, "keys": [...]}`), so a reader
uses the job's own store, whatever its own setting. The worker writes the images off the
generation path (the uploader thread), before the job's end is recorded: a job that is
`done` has its images in place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from functools import cache
from typing import Any, Protocol
from urllib.parse import urlsplit

from sdfarm.store.records import decode

RESULTS_ENV = "SDFARM_RESULTS"
REDIS_URL = "redis"
REDIS_RESULT_MAX = int(os.environ.get("SDFARM_RESULT_MAX_BYTES") or 64 * 1024 * 1024)
"""The most PNG bytes one job's result may hold in Redis ($SDFARM_RESULT_MAX_BYTES)."""
REDIS_TOTAL_MAX = int(os.environ.get("SDFARM_RESULTS_REDIS_MAX_BYTES") or 1024 * 1024 * 1024)
"""The most PNG bytes all results together may hold in Redis
($SDFARM_RESULTS_REDIS_MAX_BYTES); the rest of Redis stays for records and queues."""
SIGNED_URL_S = 3600
"""How long a presigned URL of an S3 store is good for."""


class ResultRefused(Exception):
    """The store would not take a result (a cap); the job fails with this text."""


class ResultStore(Protocol):
    """Where images go. `url` names the store without secrets (it is written into job
    records); `inline` stores travel in the job's finish step (Redis), the others are
    written by `put` before it."""

    url: str
    inline: bool

    def put(self, job_id: str, pngs: Sequence[bytes], run: str = "") -> list[str]:
        """Store a job's images; their keys, in order. `run` names this run of the job (its
        dispatch id): a late run of a requeued job never writes over the images of the run
        that ended it, nor deletes them. ResultRefused past a cap."""

    def get(self, job_id: str, key: str) -> bytes | None:
        """One image's bytes, None when it is gone."""

    def delete(self, job_id: str, keys: Sequence[str]) -> None:
        """Remove a job's images (what `put` returned); nothing when already gone."""

    def signed_url(self, key: str, expires_s: int = SIGNED_URL_S) -> str | None:
        """A URL anyone may fetch the image from for `expires_s`, or None (the gateway then
        serves the bytes itself, behind its own signed URL)."""


class RedisResults:
    """Images in the job's `result:{id}` hash, written by the finish script with the end;
    `put` only reserves room under the per-result and total caps."""

    url = REDIS_URL
    inline = True

    def __init__(
        self, store: Any, max_bytes: int = REDIS_RESULT_MAX, total_max: int = REDIS_TOTAL_MAX
    ) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self.total_max = total_max

    def put(self, job_id: str, pngs: Sequence[bytes], run: str = "") -> list[str]:
        from sdfarm.native.devices import format_bytes

        size = sum(len(p) for p in pngs)
        if size > self.max_bytes:
            raise ResultRefused(
                f"result too large: {len(pngs)} PNG image(s) of {format_bytes(size)} ({size} "
                f"bytes) exceed the result cap of {format_bytes(self.max_bytes)} "
                "(SDFARM_RESULT_MAX_BYTES); ask for fewer or smaller images, or give the "
                "workers a file or S3 result store (--results)"
            )
        ok, held = self.store.reserve_result(job_id, size, self.total_max)
        if ok == 0:
            raise ResultRefused(
                f"the Redis result store is full: finished results hold {format_bytes(held)} "
                f"and this one's {format_bytes(size)} would pass its cap of "
                f"{format_bytes(self.total_max)} (SDFARM_RESULTS_REDIS_MAX_BYTES); results "
                "leave Redis when they expire or are deleted, or give the workers a file or "
                "S3 result store (--results)"
            )
        return [f"png:{i}" for i in range(len(pngs))]

    def get(self, job_id: str, key: str) -> bytes | None:
        return self.store.r.hget(_result_key(job_id), key)

    def delete(self, job_id: str, keys: Sequence[str]) -> None:
        """A written result goes with the job's keys (Store.delete_keys); this gives back a
        reservation whose images were never written."""
        self.store.release_result(job_id)

    def signed_url(self, key: str, expires_s: int = SIGNED_URL_S) -> str | None:
        return None


def _result_key(job_id: str) -> str:
    from sdfarm.store import keys

    return keys.result_key(job_id)


def check_url(url: str) -> str:
    """`url` if it names a store this build knows, else ValueError saying which do."""
    parts = urlsplit(url)
    if url == REDIS_URL:
        return url
    if parts.scheme == "file" and parts.path.startswith("/") and not parts.netloc:
        return url
    if parts.scheme == "s3" and parts.netloc:
        return url
    raise ValueError(
        f"unknown result store {url!r}: give `redis`, `file:///an/absolute/folder` or "
        "`s3://bucket/prefix`"
    )


def new_external(url: str) -> Any:
    """A new file or S3 store for `url` (uncached: a worker's check before its pool forks
    must not leave a client behind for the children to share)."""
    parts = urlsplit(check_url(url))
    if parts.scheme == "file":
        from sdfarm.store.results_file import FileResults

        return FileResults(parts.path)
    from sdfarm.store.results_s3 import S3Results

    return S3Results(parts.netloc, parts.path.strip("/"))


_external = cache(new_external)


def open_results(url: str | None, store: Any) -> ResultStore:
    """The store `url` names (`redis` when empty); `store`: the farm's Store (the Redis
    store's). One object per URL per process: S3 clients are dear to make."""
    url = url or REDIS_URL
    if url == REDIS_URL:
        return RedisResults(store)
    return _external(url)


def where(store_url: str, keys: Sequence[str]) -> str:
    """The job record's `results` field: which store holds the images, under which keys."""
    return json.dumps({"store": store_url, "keys": list(keys)})


def located(record: dict[str, str], store: Any) -> tuple[ResultStore, list[str]]:
    """The store a finished job's images are in (the one its record names: Redis for a
    record without), and their keys."""
    doc: dict[str, Any] = {}
    try:
        doc = json.loads(decode(record.get("results")) or "{}")
    except ValueError:
        doc = {}
    keys = [str(k) for k in doc.get("keys") or []]
    return open_results(str(doc.get("store") or REDIS_URL), store), keys


def read_pngs(record: dict[str, str], inline: list[bytes], store: Any) -> list[bytes]:
    """A finished job's images: those the result hash carried (Redis), else read from the
    store the record names. An image gone from its store ends the list there."""
    results, keys = located(record, store)
    if results.inline:
        return inline
    out = []
    for key in keys:
        data = results.get(record.get("id", ""), key)
        if data is None:
            break
        out.append(data)
    return out


def image_of(record: dict[str, str], index: int, store: Any) -> tuple[bytes | None, str | None]:
    """(bytes, None) of image `index` of a job, or (None, a presigned URL) when its store
    hands those out; (None, None) when there is no such image."""
    results, keys = located(record, store)
    job_id = record.get("id", "")
    if results.inline:
        return results.get(job_id, f"png:{index}"), None
    if not 0 <= index < len(keys):
        return None, None
    url = results.signed_url(keys[index])
    return (None, url) if url else (results.get(job_id, keys[index]), None)


def delete_job(store: Any, job_id: str) -> int:
    """Delete an ended job: its images from the store its record names first (a store that
    fails leaves the record, so the delete can be tried again), then every Redis key of it.
    1 deleted, 0 no such job, -1 the job is live (nothing deleted)."""
    record = store.record(job_id)
    if not record:
        return 0
    from sdfarm.store.records import FINAL_STATES

    if record.get("state") not in FINAL_STATES:
        return -1
    results, keys = located(record, store)
    if not results.inline and keys:
        results.delete(job_id, keys)
    return store.delete_keys(job_id)
