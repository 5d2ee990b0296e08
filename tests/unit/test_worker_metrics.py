"""The worker's device series, from a heartbeat document (pure)."""

from __future__ import annotations

from typing import Any

from sdfarm.worker.metrics import device_families


def test_a_worker_without_a_heartbeat_says_it_is_down() -> None:
    got = {f.name: f.samples for f in device_families("h/CPU", None)}
    assert list(got) == ["sdfarm_device_up"] and got["sdfarm_device_up"][0].value == 0
    hb: dict[str, Any] = {"capacity": 10, "state": "busy", "loaded": [{"name": "m", "estimate": 5}]}
    got = {f.name: f.samples for f in device_families("h/CPU", hb)}
    assert [s.value for s in got["sdfarm_device_state"]] == [0, 0, 1]
    assert got["sdfarm_model_loaded_bytes"][0].labels == {"device": "h/CPU", "model": "m"}
