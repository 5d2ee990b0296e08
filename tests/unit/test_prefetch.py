"""SDFARM_PREFETCH: the messages a worker reserves per engine slot, checked at start."""

from __future__ import annotations

import pytest

from sdfarm.worker.app import DEFAULT_PREFETCH, make_app, prefetch


@pytest.mark.parametrize(
    ("text", "want"), [(None, DEFAULT_PREFETCH), ("1", 1), (" 2 ", 2), ("8", 8)]
)
def test_prefetch_reads_the_environment(text: str | None, want: int) -> None:
    env = {} if text is None else {"SDFARM_PREFETCH": text}
    assert prefetch(env) == want


@pytest.mark.parametrize("text", ["0", "9", "-1", "two", "1.5"])
def test_a_bad_prefetch_names_the_setting(text: str) -> None:
    with pytest.raises(ValueError, match="SDFARM_PREFETCH must be a count from 1 to 8"):
        prefetch({"SDFARM_PREFETCH": text})


def test_the_app_reserves_what_was_asked() -> None:
    assert make_app("redis://localhost:1/0", 2).conf.worker_prefetch_multiplier == 2
    assert make_app("redis://localhost:1/0", 1).conf.worker_prefetch_multiplier == 1
