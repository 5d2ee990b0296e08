"""One active scheduler: a Redis lease on the `leader` key.

Two schedulers placing at once would send one job twice and break the backlog bound, so only
the holder of the lease dispatches. The lease is a key set only if absent, with a TTL
(`Store.take_lease`); the holder renews it with a compare-and-pexpire (a holder whose lease
lapsed and was taken by another must not extend the new holder's), and releases it with a
compare-and-delete on a clean stop so a standby takes over within its retry interval instead
of waiting out the TTL.

The holder also keeps a local deadline: renewal time + ttl - margin by its own monotonic
clock. Past it, `held` is false even before Redis says so, and every dispatch write is
fenced in Lua on the token as well (dispatch.py), so a leader that stalls (GC, SIGSTOP, a
partition) cannot write after its lease went to a standby.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from typing import Any

from sdfarm.store import Store

DEFAULT_TTL_MS = 3000
STANDBY_RETRY_S = 0.5


def new_token() -> str:
    """host:pid:random, so `sdfarm status` shows where the leader runs."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class LeaderLock:
    """The lease. `acquire()` once per standby retry, `renew_if_due()` every cycle while held,
    `release()` on stop."""

    def __init__(
        self,
        store: Store,
        token: str | None = None,
        ttl_ms: int = DEFAULT_TTL_MS,
        clock: Any = time.monotonic,
    ) -> None:
        if ttl_ms < 300:
            raise ValueError(f"leader ttl {ttl_ms} ms is too short to renew reliably")
        self.store = store
        self.token = token or new_token()
        self.ttl_ms = ttl_ms
        self.clock = clock
        self._deadline = 0.0
        self._renewed = 0.0
        self.fresh = False

    @property
    def margin_s(self) -> float:
        """Stop a bit before the lease ends by our clock: Redis's clock may run a little fast."""
        return min(0.5, self.ttl_ms / 1000 / 5)

    @property
    def held(self) -> bool:
        return self.clock() < self._deadline

    def _granted(self, started: float) -> None:
        self._renewed = started
        self._deadline = started + self.ttl_ms / 1000 - self.margin_s

    def acquire(self) -> bool:
        """Take the lease if nobody holds it (or we do already). `fresh` tells which: True
        when the key was free (whoever held it before may have died mid-cycle), False when
        the lease was still ours and only our local deadline had passed."""
        started = self.clock()
        self.fresh = self.store.take_lease(self.token, self.ttl_ms)
        if self.fresh or self.store.renew_lease(self.token, self.ttl_ms):
            self._granted(started)
            return True
        self._deadline = 0.0
        return False

    def renew_if_due(self) -> bool:
        """Extend the lease when a third of the TTL has passed since the last renewal; False
        (and `held` false) the moment it cannot, so the caller stops dispatching at once."""
        if not self.held:
            return False
        started = self.clock()
        if started - self._renewed < self.ttl_ms / 3000:
            return True
        try:
            ok = self.store.renew_lease(self.token, self.ttl_ms)
        except Exception:
            self._deadline = 0.0
            raise
        if ok:
            self._granted(started)
            return True
        self._deadline = 0.0
        return False

    def release(self) -> bool:
        """Give the lease up (only if it is still ours)."""
        self._deadline = 0.0
        return self.store.release_lease(self.token)

    def holder(self) -> str | None:
        """The token of whoever holds the lease now."""
        return self.store.lease_holder()
