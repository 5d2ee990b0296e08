"""The farm's counters and histograms, kept in Redis at the moment things happen.

Why in Redis and not in each process's prometheus_client registry: jobs run in a worker's
Celery pool process, which is replaced after a cancel or a crash and may be one of many per
host; the scheduler's leader moves between processes; clients submit from anywhere. A counter
in any one process would restart at zero or miss what the others saw (prometheus_client's
multiprocess mode covers one host's processes only, and keeps files per dead process). So
every transition script that changes a job's state counts it in the same atomic step
(`HINCRBY` in `store/lua`): a counter can never disagree with the job's state, a job counted
`done` has ended done exactly once, and nothing is counted twice when a write is retried
(a retried transition finds the job moved on and changes nothing).

Two hashes (named in `keys.py`), each O(kinds x models x devices), never O(jobs):

- `metrics:jobs`: field `{kind}|{model}|{device}` -> count, kind one of JOB_KINDS. `device`
  is the device key (`host/device`) the job was placed on, "" when it never was (submitted,
  cancelled while queued, refused at placement).
- `metrics:seconds`: field `{histogram}|{model}|{device}|{le}` -> observations whose value
  fell in the bucket with upper bound `le` (not cumulative; "+Inf" for the last) and
  `{histogram}|{model}|{device}|sum` -> the sum of the values. HISTOGRAMS says when each is
  observed. Every duration a script observes is read on the Redis clock (`now()`) against the
  job's `created`, or measured by the worker on its monotonic clock (load, generate).

A model name new to a hash that already holds METRICS_SERIES_CAP series is counted as
OTHER_MODEL. `read_farm_metrics` reads both hashes in one round trip; the parse functions are
pure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sdfarm.store.keys import METRICS_JOBS_KEY, METRICS_SECONDS_KEY, METRICS_SERIES_CAP
from sdfarm.store.records import decode

JOB_KINDS = ("submitted", "done", "failed", "cancelled", "requeued")
"""What `metrics:jobs` counts: submit; each final state (whoever ended the job: the worker,
a cancel while queued, a refusal at placement, a deadline, a poison); a lost run put back."""

HISTOGRAMS = {
    "queue_wait": "from submit to a worker's claim (claim)",
    "load": "a model load a job waited for, warm-up included (finish, jobs that loaded)",
    "generate": "the runtime's generate call (finish, jobs whose call returned)",
    "end_to_end": "from submit to the end, whatever the end (finish, done/failed/cancelled)",
}
"""The histograms of `metrics:seconds`, each in seconds, by model and device."""

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
           3600.0)  # fmt: skip
"""Upper bounds in seconds, one list for every histogram: a tiny model on a CPU takes well
under a second, a large one a minute or more; a queue wait can reach an hour."""

OTHER_MODEL = "_other"
SEP = "|"


def bucket_label(bound: float) -> str:
    """How prometheus_client writes a bucket bound ("0.05", "1.0", "+Inf")."""
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def lua_constants() -> str:
    """Lua locals the scripts' `count` and `observe` helpers use (put before the prelude), so
    the bounds and the cap are written once, here and in keys.py."""
    bounds = ", ".join(repr(float(b)) for b in BUCKETS)
    labels = ", ".join(f"'{bucket_label(b)}'" for b in BUCKETS)
    return (
        f"local METRICS_BOUNDS = {{{bounds}}}\n"
        f"local METRICS_LABELS = {{{labels}}}\n"
        f"local METRICS_CAP = {METRICS_SERIES_CAP}\n"
        f"local METRICS_OTHER = '{OTHER_MODEL}'\n"
    )


@dataclass
class Histogram:
    """One histogram series as prometheus_client wants it: cumulative buckets and the sum."""

    buckets: list[tuple[str, float]] = field(default_factory=list)
    total: float = 0.0

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0


@dataclass
class FarmMetrics:
    """The farm's counters {(kind, model, device): n} and histograms
    {(name, model, device): Histogram}."""

    jobs: dict[tuple[str, str, str], int] = field(default_factory=dict)
    seconds: dict[tuple[str, str, str], Histogram] = field(default_factory=dict)


def parse_jobs(raw: Mapping[Any, Any]) -> dict[tuple[str, str, str], int]:
    """`metrics:jobs` as {(kind, model, device): count}. The device key never holds a bar and
    the kind never does, so a model name with one (a client's typo) still parses."""
    out: dict[tuple[str, str, str], int] = {}
    for k, v in raw.items():
        parts = decode(k).split(SEP)
        if len(parts) < 3 or parts[0] not in JOB_KINDS:
            continue
        out[(parts[0], SEP.join(parts[1:-1]), parts[-1])] = int(decode(v) or 0)
    return out


def parse_seconds(raw: Mapping[Any, Any]) -> dict[tuple[str, str, str], Histogram]:
    """`metrics:seconds` as {(name, model, device): Histogram} with cumulative buckets over
    every bound in BUCKETS and +Inf (bounds nothing fell in count as zero)."""
    counts: dict[tuple[str, str, str], dict[str, float]] = {}
    sums: dict[tuple[str, str, str], float] = {}
    for k, v in raw.items():
        parts = decode(k).split(SEP)
        if len(parts) < 4 or parts[0] not in HISTOGRAMS:
            continue
        series = (parts[0], SEP.join(parts[1:-2]), parts[-2])
        value = float(decode(v) or 0)
        if parts[-1] == "sum":
            sums[series] = value
        else:
            counts.setdefault(series, {})[parts[-1]] = value
    out: dict[tuple[str, str, str], Histogram] = {}
    for series in counts.keys() | sums.keys():
        per = counts.get(series, {})
        running, buckets = 0.0, []
        for bound in (*BUCKETS, math.inf):
            label = bucket_label(bound)
            running += per.get(label, 0.0)
            buckets.append((label, running))
        out[series] = Histogram(buckets, sums.get(series, 0.0))
    return out


def read_farm_metrics(client: Any) -> FarmMetrics:
    """Both hashes in one round trip: O(series), whatever the number of jobs."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(METRICS_JOBS_KEY)
    pipe.hgetall(METRICS_SECONDS_KEY)
    jobs, seconds = pipe.execute()
    return FarmMetrics(parse_jobs(jobs), parse_seconds(seconds))
