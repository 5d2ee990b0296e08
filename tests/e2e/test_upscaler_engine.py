"""The upscaler on the real runtime with the tiny ESRGANs (upscalers/tiny-esrgan-x2, -x4): the
output is the input times the factor, tiled or not; the same input gives the same pixels in
another process, another input other pixels; bad input is refused before any native call and
the upscaler goes on working. A generation's hires pass can use one too."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdfarm.native.engine import Engine
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.params import GenerationParams
from sdfarm.native.upscale import Upscaler
from sdfarm.native.upscalers import UpscalerCatalog, upscaler_dirs

pytestmark = pytest.mark.e2e


def png(w: int, h: int, seed: int = 1, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, (h, w, len(mode)), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def catalog(models_dir: Path) -> UpscalerCatalog:
    return UpscalerCatalog(upscaler_dirs([models_dir]))


@pytest.fixture(scope="module")
def x2(catalog: UpscalerCatalog) -> Iterator[Upscaler]:
    with Upscaler.load(catalog.load("tiny-esrgan-x2"), threads=2) as up:
        yield up


def test_the_output_is_the_input_times_the_factor(catalog: UpscalerCatalog, x2: Upscaler) -> None:
    image = png(40, 24)
    whole = x2.upscale(image=image, tile_size=0)
    tiled = x2.upscale(image=image, tile_size=32, factor=2)
    assert whole.image.size == tiled.image.size == (80, 48)
    assert whole.metadata["factor"] == 2 and whole.metadata["output_size"] == [80, 48]
    assert whole.image.tobytes() != tiled.image.tobytes()  # tiles blend at their seams
    with Upscaler.load(catalog.load("tiny-esrgan-x4"), threads=2) as x4:  # the model.N layout
        assert x4.upscale(image=png(20, 12)).image.size == (80, 48)


SCRIPT = """
import sys, hashlib
from pathlib import Path
from sdfarm.native.upscale import Upscaler
from sdfarm.native.upscalers import UpscalerCatalog, upscaler_dirs
cat = UpscalerCatalog(upscaler_dirs([sys.argv[1]]))
with Upscaler.load(cat.load("tiny-esrgan-x2"), threads=1) as up:
    out = up.upscale(image=Path(sys.argv[2]).read_bytes(), tile_size=int(sys.argv[3]))
print(hashlib.sha256(out.image.tobytes()).hexdigest())
"""


def test_same_input_same_pixels_across_processes(
    x2: Upscaler, models_dir: Path, tmp_path: Path
) -> None:
    image = png(36, 20, seed=7)
    (tmp_path / "in.png").write_bytes(image)
    for tile in (0, 32):
        here = hashlib.sha256(x2.upscale(image=image, tile_size=tile).image.tobytes()).hexdigest()
        there = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(models_dir), str(tmp_path / "in.png"), str(tile)],
            capture_output=True, text=True, check=True, timeout=300,
        ).stdout.split()[-1]  # fmt: skip
        assert here == there
    other = x2.upscale(image=png(36, 20, seed=8), tile_size=0).image
    assert hashlib.sha256(other.tobytes()).hexdigest() != here


def test_bad_input_is_refused_before_any_native_call(x2: Upscaler) -> None:
    before = x2.native_calls
    truncated = png(32, 32)[:200]
    bad = {
        "image": [b"not an image", truncated, png(4100, 8), png(8, 5)],
        "factor": [4, 3, -1, 9],
        "tile_size": [16, 2000, -5],
        "upscaler": ["../tiny-esrgan-x2"],
    }
    for name, values in bad.items():
        for value in values:
            kwargs = {"image": png(16, 16), name: value}
            with pytest.raises(InvalidParameterError) as err:
                x2.upscale(**kwargs)
            assert err.value.parameter == name, (name, value, err.value)
    # An output beyond the caps: 4096x1100 at x2 is 8192x2200, more pixels than an output
    # may have (the input itself is within the input caps).
    flat = io.BytesIO()
    Image.new("RGB", (4096, 1100), (90, 40, 200)).save(flat, "PNG")
    with pytest.raises(InvalidParameterError, match="beyond") as err:
        x2.upscale(image=flat.getvalue())
    assert err.value.parameter == "image"
    assert x2.native_calls == before
    assert x2.upscale(image=png(16, 16)).image.size == (32, 32)  # still working


def test_odd_sizes_and_tiles_upscale_whole(x2: Upscaler) -> None:
    """The sizes and tiles at the edges of what the schema lets through: the smallest image,
    odd sides, a side just over a tile, a thin strip across many tiles."""
    for w, h in ((8, 8), (9, 13), (33, 8), (8, 150)):
        for tile in (0, 32):
            out = x2.upscale(image=png(w, h, seed=w * h), tile_size=tile).image
            assert out.size == (2 * w, 2 * h), (w, h, tile)


def test_an_image_with_alpha_is_read_as_rgb(x2: Upscaler) -> None:
    rgba = png(16, 16, seed=3, mode="RGBA")
    out = x2.upscale(image=rgba, tile_size=0)
    assert out.image.mode == "RGB" and out.image.size == (32, 32)
    assert any("alpha" in w for w in out.metadata["warnings"])


def test_the_hires_pass_can_upscale_with_an_upscaler(
    catalog: UpscalerCatalog, models_dir: Path
) -> None:
    """SD_HIRES_UPSCALER_MODEL: the runtime decodes the first pass, runs the ESRGAN, encodes
    the image again and redraws it; the estimate counts the upscaler's working memory."""
    files = {n: catalog.load(n) for n in catalog.names()}
    base = GenerationParams(prompt="a hires test", width=64, height=64, steps=2, seed=5,
                            hires_scale=2.0, hires_steps=2, hires_strength=0.3)  # fmt: skip
    with Engine.load(models_dir / "tiny-f16", threads=2) as engine:
        latent = engine.generate(base, upscalers=files)
        model = engine.generate(replace(base, hires_upscaler="tiny-esrgan-x2"), upscalers=files)
        assert engine.last_call["hires_upscaler"] == "tiny-esrgan-x2"
        assert engine.last_call["hires_tile_size"] == 128
        again = engine.generate(replace(base, hires_upscaler="tiny-esrgan-x2"), upscalers=files)
        assert latent.image.size == model.image.size == (128, 128)
        assert model.image.tobytes() != latent.image.tobytes()
        assert again.image.tobytes() == model.image.tobytes()
        assert model.metadata["estimate"] > latent.metadata["estimate"]
        assert "hires_upscaler" in model.metadata
        before = engine.native_calls
        bad = [
            (replace(base, hires_upscaler="nope"), "hires_upscaler"),  # not a checked file
            (replace(base, hires_upscaler="tiny-esrgan-x2", hires_scale=1.0), "hires_upscaler"),
            (replace(base, hires_upscaler="../x"), "hires_upscaler"),
            (replace(base, hires_upscaler="tiny-esrgan-x2", hires_tile_size=8), "hires_tile_size"),
        ]
        for params, name in bad:
            with pytest.raises(InvalidParameterError) as err:
                engine.generate(params, upscalers=files)
            assert err.value.parameter == name
        assert engine.native_calls == before
