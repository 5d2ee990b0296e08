"""VAE tiling chosen by memory, on the real runtime with the tiny model on the CPU.

A host whose figure (injected in-process; `--memory-limit` on a farm) refuses 1024x256
untiled (estimate 1.10 GiB) but admits it tiled (0.85 GiB): `auto` generates it in tiles and
says so in the job's warnings, `off` is refused with the memory error, `on` tiles a size that
fits anyway. The runtime's own debug records show that it tiled ("processing N tiles").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sdfarm.native.devices import Device, GiB, HostFigures
from sdfarm.native.engine import Engine, LogConfig
from sdfarm.native.errors import ModelTooLargeError
from sdfarm.native.params import GenerationParams

pytestmark = pytest.mark.e2e

FIGURE = 1 * GiB
WIDE = {"width": 1024, "height": 256, "steps": 1, "seed": 7, "prompt": "a long coastline"}
DEBUG = LogConfig(level="debug")


def host(mem: int) -> HostFigures:
    """A CPU host with `mem` bytes of MemAvailable (the CPU's figure)."""
    return HostFigures((Device(0, "CPU", "CPU", "cpu", mem, mem),), mem_available=mem)


def tiles_logged(records: list) -> list[str]:
    return [r.message for r in records if "processing" in r.message and "tiles" in r.message]


def assert_real_image(image, size: tuple[int, int]) -> None:
    pixels = np.asarray(image, dtype=np.float32)
    assert image.size == size
    assert pixels.std() > 1.0, "a flat image"


@pytest.fixture(scope="module")
def engine(tiny_models: list[Path]) -> Iterator[Engine]:
    with Engine.load(tiny_models[0], threads=1, figures=host(FIGURE)) as e:
        yield e


def test_auto_tiles_what_the_figure_refuses_untiled_and_says_so(engine: Engine) -> None:
    untiled, tiled = (engine.estimate_for(1024, 256, tiled=t) for t in (False, True))
    assert tiled < FIGURE < untiled
    result = engine.generate(GenerationParams(**WIDE), log=DEBUG)
    assert_real_image(result.image, (1024, 256))
    meta = result.metadata
    assert meta["vae_tiled"] is True and meta["estimate"] == tiled
    assert meta["vae_tiling"] == "auto"
    assert (
        "decoded in tiles: the untiled estimate 1.10 GiB does not fit this device's 1.00 GiB"
        in meta["warnings"]
    )
    assert engine.last_call["vae_tiling"] == "on" and engine.last_call["vae_tile_size"] == [32, 32]
    assert tiles_logged(result.records), "the runtime did not log a tiled decode"


def test_off_is_refused_with_the_memory_error(engine: Engine) -> None:
    calls = engine.native_calls
    with pytest.raises(ModelTooLargeError, match="1024x256 needs an estimated 1.10 GiB") as err:
        engine.generate(GenerationParams(**WIDE, vae_tiling="off"))
    assert "Decoded in tiles (vae_tiling auto or on) it would need 865.4 MiB" in str(err.value)
    assert err.value.estimate == engine.estimate_for(1024, 256)
    assert engine.native_calls == calls


def test_on_tiles_a_size_that_fits_and_both_outputs_are_real(engine: Engine) -> None:
    small = {**WIDE, "width": 512, "height": 256}
    assert engine.estimate_for(512, 256) <= FIGURE
    whole = engine.generate(GenerationParams(**small), log=DEBUG)
    tiled = engine.generate(GenerationParams(**small, vae_tiling="on"), log=DEBUG)
    assert whole.metadata["vae_tiled"] is False and not tiles_logged(whole.records)
    assert tiled.metadata["vae_tiled"] is True and tiles_logged(tiled.records)
    assert not any("decoded in tiles" in w for w in tiled.metadata["warnings"])  # chosen
    assert_real_image(whole.image, (512, 256))
    assert_real_image(tiled.image, (512, 256))


def test_a_farm_places_it_tiled_on_a_device_whose_figure_refuses_it_untiled(
    models_dir: Path,
) -> None:
    """A worker capped at 1 GiB: the scheduler's plan tiles the auto job (the record carries
    the plan and the tiled estimate, the engine obeys), and refuses the `off` job."""
    from sdfarm.client.farm import Farm, JobFailed
    from sdfarm.localfarm.farm import LocalFarm

    local = LocalFarm(
        [models_dir], devices=["CPU"], threads=1, host="tilinghost", announce=False,
        worker_args=["--memory-limit", "1GiB"],
    )  # fmt: skip
    with local, Farm(local.url) as farm:
        job = farm.submit("tiny-f16", **WIDE, log_level="debug")
        result = job.result(300)
        record = job.record()
        refused = farm.submit("tiny-f16", **{**WIDE, "vae_tiling": "off"})
        with pytest.raises(JobFailed) as err:
            refused.result(60)
    with Engine.load(models_dir / "tiny-f16", threads=1, figures=host(FIGURE)) as e:
        untiled, tiled = e.estimate_for(1024, 256), e.estimate_for(1024, 256, tiled=True)
    assert int(record["estimate"]) == tiled == result.metadata["estimate"]
    assert result.metadata["vae_tiled"] is True
    assert any(w.startswith("decoded in tiles: the untiled estimate 1.10 GiB") for w in
               result.metadata["warnings"])  # fmt: skip
    assert any("processing" in r["message"] and "tiles" in r["message"] for r in result.records)
    assert_real_image(result.image, (1024, 256))
    assert "needs an estimated 1.10 GiB (vae_tiling off" in err.value.error
    assert err.value.estimate == untiled
    assert err.value.figures  # a memory refusal: the gateway answers it with 507
