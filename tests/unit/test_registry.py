"""Heartbeats -> placement's DeviceState: the pure conversions the scheduler relies on."""

from __future__ import annotations

import json

import pytest

from sdfarm.native.devices import Device
from sdfarm.native.engine import decode_bytes_per_pixel
from sdfarm.native.memory import IM2COL_DECODE_BYTES_PER_PIXEL as IM2COL
from sdfarm.native.memory import SEED_OVERHEAD
from sdfarm.scheduler.placement import GiB, LoadedModel
from sdfarm.scheduler.registry import (
    account,
    build_devices,
    device_state,
    device_type,
    estimate_for,
    heartbeat_models,
    host_slow_figures,
    loaded_models,
    model_facts,
    own_figure,
    parse_heartbeat,
    spec_size,
)

MiB = 1024 * 1024


def gpu_hb(free: float, total: float = 80, mem: float = 64, **extra) -> dict:
    return {
        "host": "h1",
        "device": "CUDA0",
        "type": "gpu",
        "free": int(free * GiB),
        "total": int(total * GiB),
        "mem_available": int(mem * GiB),
        **extra,
    }


def cpu_hb(mem: float = 16, **extra) -> dict:
    return {
        "host": "h2",
        "device": "CPU",
        "type": "cpu",
        "free": int(64 * GiB),
        "total": int(64 * GiB),
        "mem_available": int(mem * GiB),
        **extra,
    }


# -- figures derived from raw numbers ----------------------------------------------------------


@pytest.mark.parametrize(
    ("hb", "figure"),
    [
        (gpu_hb(20), 20 * GiB),  # the budget
        (gpu_hb(80, 80), 80 * GiB),  # free == total: no budget, the total counts
        (gpu_hb(90, 80), 80 * GiB),  # free > total: no budget either
        (gpu_hb(0, 80), 0),  # over budget
        (gpu_hb(0, 0), 0),  # reports no memory
        (cpu_hb(mem=12), 12 * GiB),  # host memory: MemAvailable, not the device's free
        ({**cpu_hb(mem=12), "type": "igpu"}, 12 * GiB),  # integrated: host memory too
    ],
)
def test_own_figure_follows_the_seed(hb: dict, figure: int) -> None:
    assert own_figure(hb) == figure


def test_accel_counts_as_gpu_and_unknown_types_as_cpu() -> None:
    assert device_type({"type": "accel"}) == "gpu"
    assert device_type({"type": "weird"}) == "cpu"
    assert device_type({}) == "cpu"


def test_slow_path_sums_the_hosts_gpus_and_memavailable() -> None:
    hbs = {
        "h1/CUDA0": gpu_hb(20, mem=64),
        "h1/CUDA1": {**gpu_hb(10, mem=64), "device": "CUDA1"},
        "h2/CPU": cpu_hb(mem=16),
    }
    assert host_slow_figures(hbs) == {"h1": 94 * GiB, "h2": 16 * GiB}


def test_device_state_derives_figures_without_worker_figures() -> None:
    loaded = [{"name": "a", "estimate": 4 * GiB, "busy": False, "idle_since": 5.0}]
    state = device_state("h1/CUDA0", gpu_hb(20, loaded=loaded), queued=1, host_slow=84 * GiB)
    assert state.key == "h1/CUDA0"
    assert state.type == "gpu"
    assert state.compute_figure == 20 * GiB
    assert state.slow_figure == 84 * GiB
    assert state.capacity == 24 * GiB  # free + what its engines hold
    assert state.loaded == (LoadedModel("a", 4 * GiB, idle_since=5.0),)
    assert (state.queued, state.backlog_limit, state.alive, state.accepting) == (1, 2, True, True)


def test_memory_limit_caps_every_derived_figure() -> None:
    loaded = [{"name": "a", "estimate": 1 * GiB}]
    state = device_state("h2/CPU", cpu_hb(mem=16, memory_limit=3 * GiB, loaded=loaded))
    assert state.compute_figure == 2 * GiB  # the limit minus what is held
    assert state.slow_figure == 2 * GiB
    assert state.capacity == 3 * GiB


def test_figures_the_worker_sent_win() -> None:
    hb = cpu_hb(mem=16, compute_figure=100 * MiB, slow_figure=100 * MiB, capacity=256 * MiB)
    state = device_state("h2/CPU", hb)
    assert (state.compute_figure, state.slow_figure, state.capacity) == (
        100 * MiB,
        100 * MiB,
        256 * MiB,
    )


def test_draining_worker_is_not_accepting() -> None:
    assert not device_state("h2/CPU", cpu_hb(accepting=False)).accepting


def test_loaded_models_reads_lists_and_mappings_and_busy_states() -> None:
    as_list = {
        "loaded": [
            {"name": "b", "estimate": 2, "state": "busy"},
            {"name": "a", "estimate": 1, "pinned": True, "last_used": 7},
            {"estimate": 9},  # no name: ignored
        ]
    }
    assert loaded_models(as_list) == (
        LoadedModel("a", 1, pinned=True, idle_since=7.0),
        LoadedModel("b", 2, busy=True),
    )
    as_map = {"loaded": {"a": {"bytes": 3, "busy": True}}}
    assert loaded_models(as_map) == (LoadedModel("a", 3, busy=True),)


# -- model facts and estimates -----------------------------------------------------------------


def test_model_facts_takes_the_largest_copy_and_none_when_missing() -> None:
    hbs = {
        "h1/CUDA0": gpu_hb(20, models={"m": {"bytes": 100, "native_size": [512, 512]}}),
        "h2/CPU": cpu_hb(models=[{"name": "m", "bytes": 300, "native_size": [1024, 1024]}]),
    }
    assert model_facts(hbs, "m") == (300, (512, 512), 0)
    assert model_facts(hbs, "other") is None
    assert heartbeat_models({"models": {"x": {"bytes": 1}}}) == {"x": (1, (512, 512))}


def test_estimate_grows_above_the_native_size_only() -> None:
    facts = (4 * GiB, (512, 512), 0)
    base = 4 * GiB + GiB + SEED_OVERHEAD
    assert estimate_for(facts, 512, 512) == base
    assert estimate_for(facts, 256, 256) == base
    assert estimate_for(facts, 1024, 512) > base


def test_a_cuda_workers_decode_term_reaches_the_estimate() -> None:
    """The engine adds IM2COL_DECODE_BYTES_PER_PIXEL for a full VAE decoded on CUDA; a
    worker reports it per model, and the scheduler's estimate takes the largest."""
    m = {"bytes": 2 * GiB, "native_size": [512, 512]}
    hbs = {
        "h1/CUDA0": gpu_hb(20, models={"m": {**m, "decode_per_pixel": IM2COL}}),
        "h2/CPU": cpu_hb(models=[{"name": "m", **m, "decode_per_pixel": 0}]),
        "h3/Vulkan0": gpu_hb(20, models={"m": m}),  # an older worker: no term
    }
    facts = model_facts(hbs, "m")
    assert facts == (2 * GiB, (512, 512), IM2COL)
    plain = estimate_for((2 * GiB, (512, 512), 0), 1024, 1024)
    assert estimate_for(facts, 1024, 1024) == plain + 1024 * 1024 * IM2COL
    only_cpu = {k: v for k, v in hbs.items() if k != "h1/CUDA0"}
    assert model_facts(only_cpu, "m") == (2 * GiB, (512, 512), 0)


@pytest.mark.parametrize(
    ("device", "roles", "expected"),
    [
        (Device(0, "CUDA0", "H200", "gpu", 1, 1), {"diffusion_model": 1, "vae": 1}, IM2COL),
        (Device(0, "CUDA0", "H200", "gpu", 1, 1), {"diffusion_model": 1, "taesd": 1}, 0),
        (Device(0, "Vulkan0", "H200", "gpu", 1, 1), {"diffusion_model": 1, "vae": 1}, 0),
        (Device(0, "CPU", "Xeon", "cpu", 1, 1), {"diffusion_model": 1, "vae": 1}, 0),
    ],
)
def test_decode_term_per_device_and_vae(device, roles, expected, monkeypatch) -> None:
    monkeypatch.delenv("SDFARM_VAE_CONV_DIRECT", raising=False)
    assert decode_bytes_per_pixel(roles, device) == expected


def test_spec_size_defaults() -> None:
    assert spec_size({"params": {"width": 64, "height": 128}}) == (64, 128)
    assert spec_size({}) == (256, 256)


def test_parse_heartbeat_rejects_garbage() -> None:
    assert parse_heartbeat(None) is None
    assert parse_heartbeat(b"not json") is None
    assert parse_heartbeat(b"[1, 2]") is None
    assert parse_heartbeat(json.dumps({"a": 1}).encode()) == {"a": 1}


# -- accounting for jobs already sent ----------------------------------------------------------


def test_account_adds_the_model_and_takes_its_estimate() -> None:
    state = device_state("h1/CUDA0", gpu_hb(20), host_slow=84 * GiB)
    after = account(state, "m", 5 * GiB)
    assert after.queued == 1
    assert after.compute_figure == 15 * GiB
    assert after.slow_figure == 79 * GiB
    assert after.loaded == (LoadedModel("m", 5 * GiB, busy=True),)
    again = account(after, "m", 5 * GiB)  # a second job of the same model: no second load
    assert (again.queued, again.compute_figure) == (2, 15 * GiB)


def test_account_gives_back_evicted_engines() -> None:
    loaded = [{"name": "old", "estimate": 6 * GiB}]
    state = device_state("h1/CUDA0", gpu_hb(2, loaded=loaded), host_slow=66 * GiB)
    after = account(state, "new", 7 * GiB, evict=("old",))
    assert after.compute_figure == 1 * GiB
    assert [m.name for m in after.loaded] == ["new"]


def test_build_devices_counts_running_jobs_and_marks_dead_devices() -> None:
    hbs = {"h1/CUDA0": gpu_hb(20)}
    running = {"h1/CUDA0": {"j1": "d1"}, "h3/CPU": {"j2": "d2"}}
    jobs = {
        "j1": {"state": "placed", "model": "m", "estimate": str(5 * GiB)},
        "j2": {"state": "running", "model": "m", "estimate": "1"},
    }
    devices = build_devices(hbs, ["h1/CUDA0", "h3/CPU"], running, jobs, backlog_limit=3)
    live, dead = devices
    assert live.key == "h1/CUDA0" and live.alive and live.queued == 1
    assert live.backlog_limit == 3
    assert live.compute_figure == 15 * GiB  # the placed job's model is counted as loading
    assert [m.name for m in live.loaded] == ["m"]
    assert dead.key == "h3/CPU" and not dead.alive and dead.queued == 1
