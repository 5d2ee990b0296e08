"""The integration tests' shared fixture: `store`, a Store on an emptied redis-server that
holds the leader lease (helpers.leader)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sdfarm.store import Store

from helpers.leader import leader_store


@pytest.fixture
def store(redis_url: str) -> Iterator[Store]:
    with leader_store(redis_url) as s:
        yield s
