"""`Store`: the one owner of the farm's Redis. Every key is named in `keys.py`, every record is
shaped in `records.py`, every state change is a Lua script in `lua/`; this class is how the
client, the scheduler, the worker and the gateway read and change them.

A job's life, one named transition each (every one also appends an event):

1. submit (client): queue the job unless `pending:count` is at the queue limit.
2. place (the leader scheduler): a queued job goes to a device with a new dispatch id, and
   its Celery message onto that device's queue, atomically; or fail: no device could ever
   hold it. Every scheduler write is fenced on the leader token.
3. claim (worker): a placed job of this dispatch starts running; a message whose dispatch is
   stale claims nothing, which is what keeps a job from running twice. Then loaded (after a
   model load), progress (each step; both say whether a cancel is asked for), preview (the
   latest preview image, when the job asks for them) and finish
   (result, final state, done token), only while the job is still this dispatch's.
4. wait (client): block on the done token, then read the record and the result together.
5. requeue (scheduler): a job whose worker died (heartbeat expired, or a new worker process)
   goes back to the front of its list with a new dispatch id; after two lost runs it fails as
   poison. forget: a stale running entry is removed.
6. cancel (client): a queued job ends at once; a placed or running one gets a request its
   worker acts on (master-596 has no cancel call: the worker ends its own process).
7. webhooks (the leader scheduler): every ending above queues the job's webhook in the same
   script; take_webhooks (fenced, with a lease: at least once) and settle_webhook deliver it.
"""

from __future__ import annotations

from typing import Any

from sdfarm.store import keys
from sdfarm.store.base import (
    NOT_LEADER,
    FarmReading,
    Placement,
    QuotaExceededError,
    refusing_writes_reason,
)
from sdfarm.store.client_ops import ClientOps
from sdfarm.store.leader_ops import LeaderOps
from sdfarm.store.worker_ops import WorkerOps

__all__ = [
    "NOT_LEADER",
    "FarmReading",
    "Placement",
    "QuotaExceededError",
    "Store",
    "refusing_writes_reason",
]


class Store(ClientOps, LeaderOps, WorkerOps):
    """The farm's Redis (a redis-py client with decode_responses off). Thread-safe as redis-py
    is: the scripts are registered once per Store, on its client's connection pool. Its
    transitions live in three parts by who calls them (client_ops, leader_ops, worker_ops),
    over the state of base.StoreBase."""

    @classmethod
    def connect(cls, url: str, **options: Any) -> Store:
        """A Store of `url` (`redis://` or `redis+sentinel://`, see store/connect.py)."""
        from sdfarm.store.connect import sync_client

        return cls(sync_client(url, **options))

    def close(self) -> None:
        self.r.close()

    def ping(self) -> bool:
        return bool(self.r.ping())

    # -- tests and operators ---------------------------------------------------------------------

    def ttls(self, job_id: str) -> dict[str, int]:
        """{key: TTL in seconds} of every key job `job_id` has now (-1: none set)."""
        names = keys.job_keys(job_id)
        pipe = self.r.pipeline(transaction=False)
        for name in names:
            pipe.ttl(name)
        return {n: int(t) for n, t in zip(names, pipe.execute(), strict=True) if int(t) != -2}
