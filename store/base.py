"""What the Store's parts share: the fence's return code, the errors and readings they
return, and `StoreBase`, the client and scripts every part works through."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sdfarm.store import keys, scripts
from sdfarm.store.records import (
    decode,
)

NOT_LEADER = -1
"""What a fenced transition returns when the caller's token no longer holds the lease."""


class QuotaExceededError(Exception):
    """A submit refused because the job's owner already has `quota` live jobs (`live`)."""

    def __init__(self, owner: str, live: int, quota: int) -> None:
        super().__init__(
            f"too many jobs: {live} of this token's jobs are queued or running, at most {quota} "
            "at once; wait for one to end"
        )
        self.owner = owner
        self.live = live
        self.quota = quota


def refusing_writes_reason(info: Mapping[str, Any]) -> str | None:
    """Why a Redis whose INFO memory is `info` refuses writes, in words, else None."""
    used, limit = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
    policy = info.get("maxmemory_policy", "")
    if isinstance(policy, bytes):
        policy = policy.decode()
    if limit and used >= limit and policy == "noeviction":
        return (
            f"the farm's Redis is full: used memory {used} bytes of maxmemory {limit} "
            f"(policy {policy}), so it refuses every write"
        )
    return None


@dataclass
class FarmReading:
    """The farm at one instant, as `snapshot` reads it: the known devices, the live ones'
    heartbeats, {device: {job id: dispatch id}} of what was sent to each, the
    RUNNING_JOB_FIELDS of those jobs, the first ids of each pending list by priority, and
    the PENDING_JOB_FIELDS of the first few of them; `now` is the Redis clock then."""

    known: list[str] = field(default_factory=list)
    heartbeats: dict[str, dict[str, Any]] = field(default_factory=dict)
    running: dict[str, dict[str, str]] = field(default_factory=dict)
    jobs: dict[str, dict[str, str]] = field(default_factory=dict)
    heads: dict[int, list[str]] = field(default_factory=dict)
    head_fields: dict[str, list[str]] = field(default_factory=dict)
    now: float = 0.0


@dataclass(frozen=True)
class Placement:
    """One job sent to a device (`Store.place_many`): where, under which dispatch id, with
    its estimate, tier, the engines the worker evicts first and its Celery message
    `(queue list, body)`."""

    job_id: str
    priority: int
    device: str
    dispatch: str
    estimate: int
    tier: str
    evict: tuple[str, ...]
    message: tuple[str, str]
    tiling: Mapping[str, Any] | None = None
    """The job's VAE tiling plan on that device (the JSON of sdfarm.native.tiling.TilingPlan),
    kept in the record for its worker; None: the worker's engine plans by itself."""


def float_or_none(raw: Any) -> float | None:
    try:
        return float(decode(raw))
    except ValueError:
        return None


def seconds_arg(value: float | None) -> str:
    """A duration for a script: "" for none (the script then observes nothing)."""
    return "" if value is None else repr(max(0.0, float(value)))


class StoreBase:
    """The state every part of `Store` uses: the redis-py client (decode_responses off), the
    Lua scripts registered on it, and the scheduler's caches of heartbeat catalogs."""

    def __init__(self, client: Any) -> None:
        self.r = client
        self._lua = scripts.register(client)
        self._catalogs: dict[str, dict[str, Any]] = {}
        self._parsed: dict[str, tuple[bytes, dict[str, Any]]] = {}

    def jobs_fields(self, job_ids: Sequence[str], names: Sequence[str]) -> list[list[str]]:
        """The fields `names` of each job (one round trip)."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(keys.job_key(job_id), list(names))
        return [[decode(v) for v in values] for values in pipe.execute()]
