"""A Store that holds the leader lease, for the tests that drive the store's fenced
transitions themselves (placing, failing, taking webhooks) as the scheduler would."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sdfarm.store import Store, transport

TOKEN = "leader-token"
HELD = (transport.queue_name("nowhere/none"), "{}")
"""A Celery message no worker reads: a placed job stays placed until the test acts."""


@contextlib.contextmanager
def leader_store(redis_url: str) -> Iterator[Store]:
    store = Store.connect(redis_url)
    assert store.take_lease(TOKEN, 60_000)
    try:
        yield store
    finally:
        store.close()
