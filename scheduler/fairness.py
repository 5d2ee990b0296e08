"""Which queued job is dispatched next: priorities, fair share between submitters, queue limit.

Pure, like `placement.py`: the scheduler passes the pending jobs and how many jobs each
submitter has running (or was just sent), and gets the order back. Placement then decides
where the chosen job goes; fairness only decides when.

Rules (SPEC "scheduler: placement across hosts": priorities, fair share, queue limit):

- Lowest priority number first (0 = interactive ... 9 = batch): a person waiting for one
  image is never behind a pipeline's ten thousand.
- Within one priority, the submitter with the fewest running + recently dispatched jobs goes
  first, so a big batch from A does not starve B's single job: B waits for at most one of A's
  jobs per device, not for A's whole batch. Ties between submitters: the one whose oldest
  pending job is oldest.
- FIFO within a submitter: its jobs leave in the order it queued them.

Age is (enqueued_at, seq): `seq` is the queue's own counter and breaks ties between jobs
enqueued in the same clock tick (and keeps the order total, so a standby scheduler that takes
over computes the same order).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

PRIORITY_INTERACTIVE = 0
PRIORITY_BATCH = 9


@dataclass(frozen=True)
class Pending:
    """A job waiting in the central queue."""

    job_id: str
    priority: int
    submitter: str
    enqueued_at: float
    seq: int

    def __post_init__(self) -> None:
        if not PRIORITY_INTERACTIVE <= self.priority <= PRIORITY_BATCH:
            raise ValueError(
                f"job {self.job_id}: priority {self.priority} outside "
                f"{PRIORITY_INTERACTIVE} (interactive) .. {PRIORITY_BATCH} (batch)"
            )

    @property
    def age_key(self) -> tuple[float, int, str]:
        """Oldest first; the job id only makes the order total if a caller reuses a seq."""
        return (self.enqueued_at, self.seq, self.job_id)


class FarmBusyError(Exception):
    """The central queue is at its limit: the submitter should retry later.

    The args are (depth, limit) rather than the message, so the error survives pickling and
    JSON round trips through the client and the gateway (which maps it to HTTP 429/503).
    """

    def __init__(self, depth: int, limit: int) -> None:
        super().__init__(depth, limit)
        self.depth = depth
        self.limit = limit

    def __str__(self) -> str:
        jobs = "job" if self.depth == 1 else "jobs"
        return f"farm busy: {self.depth} {jobs} queued (limit {self.limit}); retry later"


def check_queue_limit(depth: int, limit: int) -> None:
    """Refuse a new job when `depth` jobs are already queued and `limit` is reached.

    Bounding the queue keeps a runaway batch from filling Redis and turns overload into an
    immediate, clear error instead of jobs that silently wait for hours.
    A limit below 1 is a configuration error (there is no "unlimited" spelled as 0).
    """
    if limit < 1:
        raise ValueError(f"queue limit must be at least 1, got {limit}")
    if depth >= limit:
        raise FarmBusyError(depth, limit)


def _by_submitter(jobs: Sequence[Pending]) -> dict[str, deque[Pending]]:
    """Each submitter's jobs, oldest first."""
    queues: dict[str, deque[Pending]] = {}
    for job in sorted(jobs, key=lambda j: j.age_key):
        queues.setdefault(job.submitter, deque()).append(job)
    return queues


def _pick(queues: Mapping[str, deque[Pending]], counts: Mapping[str, int]) -> str:
    """The submitter whose turn it is: fewest running jobs, then oldest head job."""
    return min(queues, key=lambda s: (counts.get(s, 0), queues[s][0].age_key))


def iter_order(
    pending: Sequence[Pending], running_by_submitter: Mapping[str, int]
) -> Iterator[Pending]:
    """`order`, lazily: the dispatcher stops as soon as every device is full, so a queue of
    thousands costs only the picks it actually makes (plus one sort per priority)."""
    counts = dict(running_by_submitter)
    by_priority: dict[int, list[Pending]] = {}
    for job in pending:
        by_priority.setdefault(job.priority, []).append(job)
    for priority in sorted(by_priority):
        queues = _by_submitter(by_priority[priority])
        while queues:
            submitter = _pick(queues, counts)
            yield queues[submitter].popleft()
            counts[submitter] = counts.get(submitter, 0) + 1
            if not queues[submitter]:
                del queues[submitter]


def order(pending: Sequence[Pending], running_by_submitter: Mapping[str, int]) -> list[Pending]:
    """The full dispatch order (queue positions for `sdfarm status` and the client).

    It simulates dispatching one job at a time: each dispatched job counts as running for its
    submitter, across priorities, so a submitter's interactive jobs also use up its share at
    batch priority. The first element is always `next_job(...)`.
    """
    return list(iter_order(pending, running_by_submitter))


def next_job(pending: Sequence[Pending], running_by_submitter: Mapping[str, int]) -> Pending | None:
    """The job to dispatch next, or None when nothing is pending.

    `running_by_submitter` counts each submitter's running jobs plus those dispatched since
    the last heartbeat (a missing submitter has none).
    """
    if not pending:
        return None
    best = min(j.priority for j in pending)
    queues = _by_submitter([j for j in pending if j.priority == best])
    return queues[_pick(queues, running_by_submitter)][0]
