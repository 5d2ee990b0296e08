"""Heartbeats -> placement's DeviceState: the pure conversions the scheduler relies on.

The heartbeats here have the shape a worker writes (sdfarm.store.records.HEARTBEAT_FIELDS),
figures included: the worker computes them (tests/integration/test_worker.py covers how)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sdfarm.native.devices import Device
from sdfarm.native.estimate import (
    CUDA_CONTEXT_BYTES,
    CUDNN_DECODE_BYTES_PER_PIXEL,
    ModelFacts,
    decode_attention_bytes,
    decode_bytes_per_pixel,
)
from sdfarm.native.memory import IM2COL_DECODE_BYTES_PER_PIXEL as IM2COL
from sdfarm.native.memory import SEED_OVERHEAD
from sdfarm.scheduler.placement import GiB, LoadedModel
from sdfarm.scheduler.registry import (
    Catalogs,
    account,
    account_sent,
    build_devices,
    device_state,
    device_type,
    facts_index,
    farm_models,
    heartbeat_models,
    loaded_models,
    model_facts,
)
from sdfarm.store.records import parse_heartbeat

MiB = 1024 * 1024


def hb(
    host: str = "h1",
    device: str = "CUDA0",
    typ: str = "gpu",
    compute: float = 20,
    slow: float = 84,
    capacity: float = 24,
    **extra,
) -> dict:
    return {
        "host": host,
        "device": device,
        "type": typ,
        "compute_figure": int(compute * GiB),
        "slow_figure": int(slow * GiB),
        "capacity": int(capacity * GiB),
        **extra,
    }


def model(nbytes: int, native: tuple[int, int] = (512, 512), decode: int = 0) -> dict:
    return {"bytes": nbytes, "native_size": list(native), "decode_per_pixel": decode}


def test_accel_counts_as_gpu_and_unknown_types_as_cpu() -> None:
    assert device_type({"type": "accel"}) == "gpu"
    assert device_type({"type": "weird"}) == "cpu"
    assert device_type({}) == "cpu"


def test_device_state_takes_the_workers_figures() -> None:
    loaded = [{"name": "a", "estimate": 4 * GiB, "busy": False, "idle_since": 5.0}]
    state = device_state("h1/CUDA0", hb(loaded=loaded), queued=1)
    assert state.key == "h1/CUDA0"
    assert state.type == "gpu"
    assert (state.compute_figure, state.slow_figure, state.capacity) == (
        20 * GiB,
        84 * GiB,
        24 * GiB,
    )
    assert state.loaded == (LoadedModel("a", 4 * GiB, idle_since=5.0),)
    assert (state.queued, state.backlog_limit, state.alive, state.accepting) == (1, 2, True, True)


def test_a_heartbeat_without_figures_gets_nothing() -> None:
    """A document that is not our worker's (no figures) offers no memory: no job goes there."""
    state = device_state("h9/CPU", {"host": "h9", "device": "CPU", "type": "cpu"})
    assert (state.compute_figure, state.slow_figure, state.capacity) == (0, 0, 0)
    assert state.loaded == ()


def test_slow_and_capacity_never_below_the_compute_figure() -> None:
    state = device_state("h2/CPU", hb("h2", "CPU", "cpu", compute=8, slow=2, capacity=1))
    assert state.slow_figure == state.capacity == state.compute_figure == 8 * GiB


def test_draining_worker_is_not_accepting() -> None:
    assert not device_state("h2/CPU", hb(accepting=False)).accepting


def test_loaded_models_reads_the_workers_list() -> None:
    doc = {
        "loaded": [
            {"name": "b", "estimate": 2, "busy": True},
            {"name": "a", "estimate": 1, "pinned": True, "idle_since": 7},
            {"estimate": 9},  # no name: ignored
            "garbage",
        ]
    }
    assert loaded_models(doc) == (
        LoadedModel("a", 1, pinned=True, idle_since=7.0),
        LoadedModel("b", 2, busy=True),
    )


# -- model facts and estimates -----------------------------------------------------------------


def test_model_facts_takes_the_cautious_facts_and_none_when_missing() -> None:
    hbs = {
        "h1/CUDA0": hb(models={"m": model(100, (512, 512))}),
        "h2/CPU": hb("h2", "CPU", "cpu", models={"m": model(300, (1024, 1024))}),
    }
    assert model_facts(hbs, "m") == ModelFacts(300, (512, 512), 0)
    assert model_facts(hbs, "other") is None
    assert farm_models(hbs) == ["m"]


def test_the_facts_index_agrees_with_model_facts_reading_each_catalog_once() -> None:
    """Heartbeats sharing one `models` document (as the store hands them out) are parsed
    once; the index gives what `model_facts` gives per name, equal native areas included."""
    shared = {"m": model(100, (512, 768)), "n": model(7)}
    hbs = {
        "h1/CUDA0": hb(models=shared),
        "h2/CUDA0": hb("h2", models={"m": model(50, (768, 512)), "bad": "x"}),
        "h3/CUDA0": hb("h3", models=shared),
        "h4/CPU": hb("h4", "CPU", "cpu"),
    }
    catalogs = Catalogs()
    index = facts_index(hbs, catalogs)
    assert index == {name: model_facts(hbs, name) for name in ("m", "n")}
    assert index["m"].native_size == (512, 768)  # the first of equal areas, as model_facts
    assert len(catalogs._parsed) == 3  # shared, h2's, and h4's missing document
    assert catalogs.models(hbs["h3/CUDA0"]) is catalogs.models(hbs["h1/CUDA0"])
    assert sorted(facts_index(hbs)) == farm_models(hbs)


@pytest.mark.parametrize("seed", range(50))
def test_account_sent_is_account_job_after_job(seed: int) -> None:
    import random

    rng = random.Random(seed)
    loaded = [
        {"name": n, "estimate": rng.randint(0, 4) * GiB, "busy": rng.random() < 0.3}
        for n in rng.sample("abcde", rng.randint(0, 3))
    ]
    state = device_state("h1/CUDA0", hb(compute=rng.choice([0, 3, 20]), loaded=loaded))
    sent = [(rng.choice("abcdefg"), rng.randint(-1, 6) * GiB) for _ in range(rng.randint(0, 4))]
    want = state
    for model, estimate in sent:
        want = account(want, model, estimate, sent=0)
    assert account_sent(state, sent) == want


def test_build_devices_reuses_a_device_whose_heartbeat_and_jobs_are_unchanged() -> None:
    beat = hb(loaded=[{"name": "a", "estimate": GiB}])
    running = {"h1/CUDA0": {"j1": "d1"}}
    jobs = {"j1": {"state": "placed", "model": "m", "estimate": str(GiB)}}
    cache: dict = {}
    first = build_devices({"h1/CUDA0": beat}, [], running, jobs, cache=cache)
    again = build_devices({"h1/CUDA0": beat}, [], running, jobs, cache=cache)
    assert again[0] is first[0]
    assert first == build_devices({"h1/CUDA0": beat}, [], running, jobs)  # same as uncached
    moved = {"j1": {"state": "running", "model": "m", "estimate": str(GiB)}}
    assert build_devices({"h1/CUDA0": beat}, [], running, moved, cache=cache)[0] is not first[0]
    fresh = dict(beat)
    rebuilt = build_devices({"h1/CUDA0": fresh}, [], running, moved, cache=cache)[0]
    assert rebuilt == first[0] and rebuilt is not first[0]  # a new heartbeat object: rebuilt
    build_devices({}, [], {}, {}, cache=cache)
    assert cache == {}  # gone devices leave the cache


def test_a_job_claimed_ahead_leaves_room_in_its_devices_backlog() -> None:
    """A job the worker claimed ahead (sdfarm.worker.chain) is its next run, no longer in its
    queue: the backlog bound counts the running job and what waits, so the device gets its
    next message before that job begins. Its model and estimate stay accounted."""
    beat = hb(loaded=[{"name": "m", "estimate": GiB}])
    running = {"h1/CUDA0": {"j1": "d1", "j2": "d2"}}
    run = {"state": "running", "model": "m", "estimate": str(GiB)}
    plain = {"j1": run, "j2": {**run}}
    ahead = {"j1": run, "j2": {**run, "ahead": "1796180000.1"}}
    cache: dict = {}
    full = build_devices({"h1/CUDA0": beat}, [], running, plain, cache=cache)[0]
    assert (full.queued, full.has_room) == (2, False)
    room = build_devices({"h1/CUDA0": beat}, [], running, ahead, cache=cache)[0]
    assert (room.queued, room.has_room) == (1, True)
    assert room.loaded == full.loaded  # the same engines and sent jobs accounted


def test_malformed_model_entries_are_left_out() -> None:
    doc = {"models": {"ok": model(1), "no-size": {"bytes": 1}, "junk": "x"}}
    assert heartbeat_models(doc) == {"ok": ModelFacts(1, (512, 512), 0)}


def test_estimate_grows_above_the_native_size_only() -> None:
    facts = ModelFacts(4 * GiB, (512, 512))
    base = 4 * GiB + GiB + SEED_OVERHEAD
    assert facts.estimate(512, 512) == facts.resident() == base
    assert facts.estimate(256, 256) == base
    assert facts.estimate(1024, 512) > base


def test_a_cuda_workers_decode_term_reaches_the_estimate() -> None:
    """The engine adds IM2COL_DECODE_BYTES_PER_PIXEL for a full VAE decoded on CUDA; a
    worker reports it per model, and the scheduler's estimate takes the largest."""
    hbs = {
        "h1/CUDA0": hb(models={"m": model(2 * GiB, decode=IM2COL)}),
        "h2/CPU": hb("h2", "CPU", "cpu", models={"m": model(2 * GiB)}),
    }
    facts = model_facts(hbs, "m")
    assert facts == ModelFacts(2 * GiB, (512, 512), IM2COL)
    plain = ModelFacts(2 * GiB, (512, 512)).estimate(1024, 1024)
    assert facts.estimate(1024, 1024) == plain + 1024 * 1024 * IM2COL
    only_cpu = {k: v for k, v in hbs.items() if k != "h1/CUDA0"}
    assert model_facts(only_cpu, "m") == ModelFacts(2 * GiB, (512, 512), 0)


@pytest.mark.parametrize(
    ("device", "decoder", "cudnn", "expected"),
    [
        (Device(0, "CUDA0", "H200", "gpu", 1, 1), "vae", False, IM2COL),
        (Device(0, "CUDA0", "H200", "gpu", 1, 1), "vae", True, CUDNN_DECODE_BYTES_PER_PIXEL),
        (Device(0, "CUDA0", "H200", "gpu", 1, 1), "taesd", False, 0),
        (Device(0, "CUDA0", "H200", "gpu", 1, 1), "taesd", True, 0),
        (Device(0, "Vulkan0", "H200", "gpu", 1, 1), "vae", False, 0),
        (Device(0, "CPU", "Xeon", "cpu", 1, 1), "vae", True, 0),
    ],
)
def test_decode_term_per_device_and_decoder(
    device, decoder, cudnn, expected, monkeypatch, tmp_path
) -> None:
    """A CUDA decode through im2col counts its 10 KiB a pixel; through cuDNN (when the worker
    finds one) its staging copies; elsewhere nothing beyond the seed's estimate."""
    monkeypatch.delenv("SDFARM_VAE_CONV_DIRECT", raising=False)
    lib = tmp_path / "libcudnn.so.9"
    lib.write_bytes(b"")
    monkeypatch.setenv("SDFARM_CUDNN", str(lib) if cudnn else "0")
    assert decode_bytes_per_pixel(decoder, device) == expected
    assert 0 < CUDNN_DECODE_BYTES_PER_PIXEL < IM2COL / 3


def test_parse_heartbeat_rejects_garbage() -> None:
    assert parse_heartbeat(None) is None
    assert parse_heartbeat(b"not json") is None
    assert parse_heartbeat(b"[1, 2]") is None
    assert parse_heartbeat(json.dumps({"a": 1}).encode()) == {"a": 1}


# -- accounting for jobs already sent ----------------------------------------------------------


def test_account_adds_the_model_and_takes_its_estimate() -> None:
    state = device_state("h1/CUDA0", hb())
    after = account(state, "m", 5 * GiB)
    assert after.queued == 1
    assert after.compute_figure == 15 * GiB
    assert after.slow_figure == 79 * GiB
    assert after.loaded == (LoadedModel("m", 5 * GiB, busy=True),)
    again = account(after, "m", 5 * GiB)  # a second job of the same model: no second load
    assert (again.queued, again.compute_figure) == (2, 15 * GiB)


def test_account_gives_back_evicted_engines() -> None:
    loaded = [{"name": "old", "estimate": 6 * GiB}]
    state = device_state("h1/CUDA0", hb(compute=2, slow=66, capacity=8, loaded=loaded))
    after = account(state, "new", 7 * GiB, evict=("old",))
    assert after.compute_figure == 1 * GiB
    assert [m.name for m in after.loaded] == ["new"]


def test_build_devices_counts_running_jobs_and_marks_dead_devices() -> None:
    hbs = {"h1/CUDA0": hb()}
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


@pytest.mark.parametrize(
    "device",
    [
        Device(0, "CPU", "Xeon", "cpu", 1, 1),
        Device(0, "CUDA0", "H200", "gpu", 1, 1),
        Device(1, "Vulkan1", "H200", "gpu", 1, 1),
    ],
)
@pytest.mark.parametrize("vae", ["vae", "taesd"])
def test_the_workers_facts_give_the_scheduler_the_engines_estimate(device, vae, monkeypatch):
    """What a worker puts in its heartbeat (ModelFacts.as_json) and the scheduler reads back
    gives, at every size, the estimate an engine on that device makes from the same model:
    the decode term and the native size survive the trip."""
    from types import SimpleNamespace

    from sdfarm.native.estimate import model_facts as engine_facts

    monkeypatch.delenv("SDFARM_VAE_CONV_DIRECT", raising=False)
    model = SimpleNamespace(
        total_bytes=3 * GiB,
        native_size=(1024, 1024),
        files={"diffusion_model": 1, vae: 1},
        decoders=(vae,),
    )
    beat = hb(models={"m": engine_facts(model, device).as_json()})
    scheduler = model_facts({"h1/CUDA0": beat}, "m")
    engine = engine_facts(model, device)
    for w, h in ((256, 256), (1024, 1024), (2048, 1024), (4096, 4096)):
        assert scheduler.estimate(w, h) == engine.estimate(w, h), (w, h)
    decodes = device.name.startswith("CUDA") and vae == "vae"
    assert (engine.decode_per_pixel > 0) == decodes
    # A CUDA engine's process holds its context beside the model (CUDA_CONTEXT_BYTES):
    # it survives the trip and counts at every size, resident included.
    cuda = device.name.startswith("CUDA")
    assert scheduler.context == engine.context == (CUDA_CONTEXT_BYTES if cuda else 0)
    bare = replace(engine, context=0)
    assert engine.resident() - bare.resident() == engine.context
    assert engine.estimate(512, 512, tiled=True) - bare.estimate(512, 512, tiled=True) == (
        engine.context
    )


@pytest.mark.parametrize(
    "device",
    [Device(0, "CUDA0", "H200", "gpu", 1, 1), Device(0, "CPU", "Xeon", "cpu", 1, 1)],
)
def test_a_taesd_engine_key_is_estimated_as_the_worker_loads_it(device, monkeypatch):
    """A model with a full VAE and a TAESD: its plain key is the VAE engine's (the im2col
    decode term on CUDA), `+decoder:taesd` the TAESD engine's (no decode term), the same
    figure the worker's engine makes for each; a key asking for a TAESD the model lacks
    has no facts (the scheduler then fails the job with the reason)."""
    from types import SimpleNamespace

    from sdfarm.native.enginekey import unknown_error
    from sdfarm.native.estimate import model_facts as engine_facts

    monkeypatch.delenv("SDFARM_VAE_CONV_DIRECT", raising=False)
    both = SimpleNamespace(
        total_bytes=3 * GiB,
        native_size=(512, 512),
        files={"checkpoint": 1, "taesd": 1},
        decoders=("vae", "taesd"),
    )
    vae_only = SimpleNamespace(**{**vars(both), "decoders": ("vae",), "files": {"checkpoint": 1}})
    hbs = {
        "h1/X": hb(models={
            "m": engine_facts(both, device).as_json(),
            "n": engine_facts(vae_only, device).as_json(),
        })
    }  # fmt: skip
    vae, taesd = model_facts(hbs, "m"), model_facts(hbs, "m+decoder:taesd")
    assert vae.decoders == taesd.decoders == ("vae", "taesd")
    for side in (512, 1024):
        assert vae.estimate(side, side) == engine_facts(both, device).estimate(side, side)
        assert taesd.estimate(side, side) == engine_facts(both, device, "taesd").estimate(
            side, side
        )
    # The VAE's attention (1 GiB at 1024x1024) on every device, its im2col on CUDA beside it.
    vae_more = vae.estimate(1024, 1024) - taesd.estimate(1024, 1024)
    assert vae_more >= decode_attention_bytes(1024, 1024)
    assert (vae_more > decode_attention_bytes(1024, 1024)) == device.name.startswith("CUDA")
    assert taesd.decode_per_pixel == 0
    assert model_facts(hbs, "n+decoder:taesd") is None
    assert "TAESD" in unknown_error("n+decoder:taesd", hbs, ["m", "n"])
    # Copies of one model that differ: only the decoders every copy has count.
    hbs["h2/X"] = hb("h2", models={"m": engine_facts(vae_only, device).as_json()})
    assert model_facts(hbs, "m").decoders == ("vae",)
    assert model_facts(hbs, "m+decoder:taesd") is None
