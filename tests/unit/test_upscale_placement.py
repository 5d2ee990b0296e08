"""An upscale job through the scheduler's pure parts: the heartbeat's upscaler facts, the queued
job's shape read from its spec, the one estimate, and placement preferring the device that
holds the upscaler loaded."""

from __future__ import annotations

import json

from sdfarm.native.estimate import ModelFacts, UpscalerFacts, job_estimate
from sdfarm.scheduler.dispatch import _pending_job
from sdfarm.scheduler.placement import DeviceState, GiB, JobRequest, LoadedModel, Placed, place
from sdfarm.scheduler.registry import farm_upscalers, model_facts
from sdfarm.store.records import upscaler_key, upscaler_name

CPU = UpscalerFacts(bytes=64 << 20, scale=4, tile_per_pixel=1024)
CUDA = UpscalerFacts(bytes=64 << 20, scale=4, tile_per_pixel=2048)


def hb(**upscalers: UpscalerFacts) -> dict:
    return {
        "models": {"esrgan": {"bytes": 1, "native_size": [512, 512]}},  # a model of that name
        "upscalers": {n: f.as_json() for n, f in upscalers.items()} | {"broken": {"x": 1}},
    }


def test_upscaler_facts_come_from_heartbeats_apart_from_models() -> None:
    hbs = {"a/CPU": hb(esrgan=CPU), "b/CUDA0": hb(esrgan=CUDA)}
    assert upscaler_key("esrgan") == "upscaler:esrgan"
    assert upscaler_name("upscaler:esrgan") == "esrgan" and upscaler_name("esrgan") is None
    assert model_facts(hbs, "upscaler:esrgan") == CUDA  # valid on both: the larger term
    assert isinstance(model_facts(hbs, "esrgan"), ModelFacts)  # the model, not the upscaler
    assert model_facts(hbs, "upscaler:nope") is None
    assert farm_upscalers(hbs) == ["esrgan"]  # the malformed entry is left out


def test_a_queued_upscale_job_is_shaped_by_its_input_and_tile_size() -> None:
    spec = {"model": "upscaler:esrgan", "kind": "upscale",
            "params": {"image": "sha256:" + "0" * 64, "upscaler": "esrgan", "factor": 0,
                       "tile_size": 64, "input_size": [300, 200]}}  # fmt: skip
    job = _pending_job("j1", 5, ["queued", "upscaler:esrgan", "me", "1.0", json.dumps(spec)])
    assert job is not None
    assert job.shape == ("upscaler:esrgan", 300, 200, False, (), 64, None, "off", 1)
    estimate = job_estimate(CPU, job.width, job.height, tile_size=job.tile_size)
    assert estimate == CPU.estimate(300, 200, 64)
    assert estimate < CPU.estimate(300, 200, 0)  # tiles: less working memory
    # a size the scheduler cannot read places as the largest input (the worker re-checks)
    spec["params"]["input_size"] = "big"
    job = _pending_job("j2", 5, ["queued", "upscaler:esrgan", "me", "1.0", json.dumps(spec)])
    assert job is not None and (job.width, job.height) == (4096, 4096)


def test_placement_prefers_the_device_holding_the_upscaler() -> None:
    key = upscaler_key("esrgan")
    estimate = CPU.estimate(256, 256, 128)

    def dev(name: str, loaded: tuple[LoadedModel, ...] = ()) -> DeviceState:
        host, device = name.split("/")
        return DeviceState(
            host=host, device=device, type="cpu", compute_figure=8 * GiB, slow_figure=8 * GiB,
            capacity=8 * GiB, loaded=loaded,
        )  # fmt: skip

    devices = [dev("a/CPU"), dev("b/CPU", (LoadedModel(key, CPU.resident()),))]
    assert [d.key for d in devices] == ["a/CPU", "b/CPU"]
    outcome = place(JobRequest(key, estimate), devices, 0.0)
    assert isinstance(outcome, Placed) and outcome.device == "b/CPU"
    # another model of the same name held elsewhere does not count
    devices = [dev("a/CPU", (LoadedModel("esrgan", 1 << 30),)), dev("b/CPU", ())]
    outcome = place(JobRequest(key, estimate), devices, 0.0)
    assert isinstance(outcome, Placed) and outcome.tier != "loaded"


def test_a_hires_model_upscaler_adds_its_working_memory_to_a_generation() -> None:
    from sdfarm.scheduler.dispatch import _hires_bytes
    from sdfarm.scheduler.registry import Snapshot

    params = {"prompt": "x", "width": 256, "height": 256, "hires_scale": 2.0,
              "hires_upscaler": "esrgan", "hires_tile_size": 64}  # fmt: skip
    spec = json.dumps({"model": "m", "params": params})
    job = _pending_job("j3", 5, ["queued", "m", "me", "1.0", spec])
    assert job is not None and job.hires == ("esrgan", 256, 256, 64)
    assert (job.width, job.height, job.encodes) == (512, 512, True)  # encoded again
    snap = Snapshot(heartbeats={"a/CPU": hb(esrgan=CPU)})
    assert _hires_bytes(snap, job.hires) == CPU.working(256, 256, 64) > CPU.bytes
    assert _hires_bytes(snap, None) == 0
    assert _hires_bytes(snap, ("unknown", 256, 256, 64)) == 0  # the client refuses it
