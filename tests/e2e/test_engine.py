"""The real runtime with the tiny model: determinism, memory refusals, bad files, bad
parameters and the log ring. Every test runs in this process: none of these may crash it."""

from __future__ import annotations

import io
import threading
import time

import pytest

from sdfarm.native.engine import Engine, LogConfig
from sdfarm.native.errors import InvalidParameterError, ModelLoadError, ModelTooLargeError
from sdfarm.native.logs import Scrubber
from sdfarm.native.params import GenerationParams
from sdfarm.native.png import png_bytes, read_params
from sdfarm.native.ring import LogRing

from helpers.badmodels import make_broken_model, make_sparse_huge_model

SMALL = {"width": 64, "height": 64, "steps": 1}


@pytest.fixture(scope="module")
def engine(tiny_models):
    e = Engine.load(tiny_models[0])
    yield e
    e.dispose()


def png(engine, seed, prompt="a lighthouse at dusk"):
    r = engine.generate(GenerationParams(prompt=prompt, seed=seed, **SMALL))
    return png_bytes(r.image, r.metadata)


def test_same_seed_same_png_bytes_in_one_engine_and_another_seed_differs(engine):
    a, b = png(engine, 42), png(engine, 42)
    assert a == b
    assert png(engine, 43) != a
    assert read_params(a)["seed"] == 42


def test_result_metadata_names_what_made_the_image(engine):
    r = engine.generate(GenerationParams(prompt="x", seed=5, **SMALL))
    assert r.image.size == (64, 64)
    meta = r.metadata
    assert meta["seed"] == 5 and meta["backend"] == "CPU" and meta["model"] == "tiny-f16"
    assert meta["sd_version"] == "master-596-90e87bc"
    assert meta["fit_plan"]["placement"]["diffusion"] == "cpu"
    assert meta["timings"]["generate_s"] > 0
    caps = engine.capabilities
    assert caps.backend == "CPU" and caps.device_type == "cpu"
    assert caps.estimate == engine.estimate_for(256, 256)
    assert caps.memory_check == "ok" and "MemAvailable" in caps.figures


def test_quantized_gguf_model_generates(tiny_models):
    with Engine.load(tiny_models[1]) as e:
        assert e.generate(GenerationParams(prompt="q", seed=1, **SMALL)).image.size == (64, 64)


BAD_PARAMS = [
    ({"width": 0}, "width"),
    ({"height": -8}, "height"),
    ({"steps": 0}, "steps"),
    ({"steps": -1}, "steps"),
    ({"width": 100000, "height": 100000}, "width"),
    ({"sampler": "warp_drive"}, "sampler"),
]


@pytest.mark.parametrize(("kw", "param"), BAD_PARAMS, ids=[b[1] + str(b[0]) for b in BAD_PARAMS])
def test_bad_parameters_make_no_native_call_and_the_engine_goes_on(engine, kw, param):
    calls = engine.native_calls
    with pytest.raises(InvalidParameterError) as err:
        engine.generate(GenerationParams(**{"prompt": "p", **SMALL, **kw}))
    assert err.value.parameter == param
    assert engine.native_calls == calls
    assert engine.generate(GenerationParams(prompt="still alive", seed=1, **SMALL)).images


def test_sparse_huge_model_is_refused_with_estimate_and_figures(tiny_models, tmp_path):
    huge = make_sparse_huge_model(tiny_models[0], tmp_path / "huge")
    with pytest.raises(ModelTooLargeError) as err:
        Engine.load(huge)
    msg = str(err.value)
    assert err.value.estimate > 200 * 10**9
    assert "MemAvailable" in msg and "estimate" in msg and "--no-check-memory" in msg
    assert "MemAvailable" in err.value.figures


def test_sparse_huge_model_without_the_check_fails_quoting_the_runtime(tiny_models, tmp_path):
    huge = make_sparse_huge_model(tiny_models[0], tmp_path / "huge")
    with pytest.raises(ModelLoadError) as err:
        Engine.load(huge, check_memory=False)
    assert "wrong shape" in str(err.value)
    assert any("wrong shape" in r for r in err.value.records)
    assert str(tmp_path) not in str(err.value)


def test_without_the_check_the_engine_still_reports_the_device_the_figures_choose(tiny_models):
    """--no-check-memory skips the refusal, not the device choice: on a GPU host the engine
    used to report (and plan for) the CPU. Figures injected: a host with a large GPU."""
    from sdfarm.native.devices import Device, HostFigures

    gib = 1024**3
    host = HostFigures(
        (
            Device(0, "CPU", "cpu", "cpu", 8 * gib, 8 * gib),
            Device(1, "CUDA0", "gpu", "gpu", 40 * gib, 48 * gib),
        ),
        mem_available=8 * gib,
    )
    with Engine.load(tiny_models[0], check_memory=False, figures=host, warm_up=False) as e:
        assert e.capabilities.memory_check == "skip"
        assert e.capabilities.device == "CUDA0" and e.fit.device == "CUDA0"


@pytest.mark.parametrize("kind", ["garbage", "empty", "truncated", "wrong-role"])
def test_broken_model_files_are_clear_errors_naming_the_role(tiny_models, tmp_path, kind):
    broken = make_broken_model(tiny_models[0], tmp_path / kind, kind)
    with pytest.raises(ModelLoadError) as err:
        Engine.load(broken)
    assert "diffusion_model" in str(err.value)
    assert str(tmp_path) not in str(err.value)


def test_a_size_whose_estimate_exceeds_the_host_is_refused_before_generating(engine):
    calls = engine.native_calls
    # Untiled (decoded in tiles, 4096x4096 would fit a host of 17 GiB: test_vae_tiling.py).
    with pytest.raises(ModelTooLargeError, match="4096x4096"):
        engine.generate(
            GenerationParams(prompt="big", width=4096, height=4096, steps=1, vae_tiling="off")
        )
    assert engine.native_calls == calls


def test_records_are_scrubbed_and_levelled(tiny_models):
    log = LogConfig(level="debug")
    prompt = "a quokka juggling saxophones"
    with Engine.load(tiny_models[0], log=log) as e:
        load = e.drain_load_records()
        gen = e.generate(GenerationParams(prompt=prompt, seed=3, **SMALL)).records
    records = load + gen
    assert records and all(r.message.startswith("stable_diffusion: ") for r in records)
    assert any("<diffusion_model file>" in r.message for r in load)
    text = "\n".join(r.message for r in records)
    assert str(tiny_models[0]) not in text
    assert "quokka" not in text and "saxophones" not in text
    assert any(r.level == "debug" for r in records)


def test_default_level_none_delivers_no_records(tiny_models):
    with Engine.load(tiny_models[0]) as e:
        assert e.drain_load_records() == []
        assert e.generate(GenerationParams(prompt="x", seed=1, **SMALL)).records == []


def test_ring_overflow_keeps_the_newest_records_and_counts_the_dropped(engine):
    ring = LogRing.load()
    ring.configure(4096, "debug")
    ring.flood(1000, "info")
    raw, dropped = ring.drain_raw()
    texts = [t for _, _, _, t in raw]
    seqs = [s for s, _, _, _ in raw]
    kept = len(raw)
    assert 0 < kept < 1000
    assert dropped == 1000 - kept
    assert texts[-1].endswith("flood record 999")
    assert texts[0].endswith(f"flood record {1000 - kept}")
    assert seqs == list(range(seqs[0], seqs[0] + kept))
    ring.flood(300, "info")
    records = ring.drain(Scrubber({}))
    warning = records[0]
    assert warning.level == "warn" and warning.source == "engine"
    assert f"{300 - (len(records) - 1)} log records were dropped" in warning.message
    assert sum("were dropped" in r.message for r in records) == 1
    ring.configure(256 * 1024, "none")


def test_png_carries_the_parameters(engine):
    r = engine.generate(GenerationParams(prompt="chunk", seed=11, **SMALL))
    data = png_bytes(r.image, r.metadata)
    params = read_params(data)
    assert params["prompt"] == "chunk" and params["seed"] == 11 and params["model"] == "tiny-f16"
    from PIL import Image

    assert Image.open(io.BytesIO(data)).size == (64, 64)


def test_a_generation_prepared_while_another_waits_changes_nothing_of_it(models_dir):
    """The worker prepares the next job while the current one runs (sdfarm.worker.chain):
    a preparation holds nothing in the engine, so one made in between (here with a LoRA)
    leaves the call prepared before it as it was, and each gives what `generate` gives."""
    from sdfarm.native.loras import LoraCatalog, lora_dirs
    from sdfarm.native.testmodel import TEST_LORA

    lora = LoraCatalog(lora_dirs([models_dir])).load(TEST_LORA)
    plain = GenerationParams(prompt="a lighthouse", seed=7, **SMALL)
    styled = GenerationParams(prompt="a lighthouse", seed=7, loras=((TEST_LORA, 1.0),), **SMALL)
    with Engine.load(models_dir / "tiny-f16") as e:
        first = e.prepare(plain)
        second = e.prepare(styled, loras={TEST_LORA: lora})
        a = e.run_prepared(first).finish()
        b = e.run_prepared(second).finish()
        assert a.image.tobytes() == e.generate(plain).image.tobytes()
        again = e.generate(styled, loras={TEST_LORA: lora}).image.tobytes()
        assert b.image.tobytes() == again != a.image.tobytes()
        assert "lora_hashes" not in a.metadata and TEST_LORA in b.metadata["lora_hashes"]
        assert e.native_calls == 5  # the load, then four generations: none while preparing


def test_one_progress_watcher_per_engine_which_ends_with_it(tiny_models):
    def watchers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "sdfarm-progress"]

    before = len(watchers())
    steps: list[tuple[int, int]] = []
    e = Engine.load(tiny_models[0])
    for seed in (1, 2, 3):
        params = GenerationParams(prompt="x", seed=seed, width=64, height=64, steps=2)
        e.generate(params, progress=lambda step, n, _s: steps.append((step, n)))
    assert len(watchers()) == before + 1  # one thread for three calls
    assert steps and all(n == 2 for _, n in steps)
    e.dispose()
    deadline = time.monotonic() + 5
    while len(watchers()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(watchers()) == before
