"""A size the runtime rounds (sdfarm.native.drawsize): on a real farm with the random-weight
SD 1.x model (a UNet: the runtime draws multiples of 64), a 72x72 job returns exactly 72x72,
the centre of the 128x128 the runtime drew (the same pixels a 128x128 job of the same seed
has there), says so in its warnings and `drawn_size`, is placed by the 128x128 estimate, and
its PNG's chunks say 72x72, the image's size. The tiny DiT model draws 72x72 as asked."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from sdfarm.client.farm import Farm
from sdfarm.native.engine import Engine
from sdfarm.native.params import GenerationParams
from sdfarm.native.png import read_params

from helpers.gateway import cpu_farm

pytestmark = pytest.mark.e2e

MODEL = "sd1-tiny"
JOB = {"steps": 1, "seed": 11}


@pytest.fixture(scope="module")
def client(sd1_dir: Path) -> Iterator[Farm]:
    with cpu_farm(sd1_dir, "sizehost") as farm, Farm(farm.url, submitter="size-tests") as f:
        yield f


def _image(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def test_an_asked_72x72_is_the_centre_of_the_128x128_drawn(client: Farm) -> None:
    job = client.submit(MODEL, "a harbour", width=72, height=72, **JOB)
    result = job.result(300)
    meta = result.metadata
    assert _image(result.png).size == (72, 72)
    assert meta["drawn_size"] == [128, 128]
    assert any("drew 128x128 and the 72x72 asked is its centre" in w for w in meta["warnings"])
    assert (meta["width"], meta["height"]) == (72, 72)

    whole = client.submit(MODEL, "a harbour", width=128, height=128, **JOB).result(300)
    assert _image(whole.png).size == (128, 128) and "drawn_size" not in whole.metadata
    centre = _image(whole.png).crop((28, 28, 100, 100))
    assert centre.tobytes() == _image(result.png).tobytes()
    # Placed by what the runtime holds: the 128x128 estimate, not 72x72's.
    assert int(job.record()["estimate"]) == int(whole.metadata["estimate"])

    with Image.open(io.BytesIO(result.png)) as im:
        assert "Size: 72x72," in im.text["parameters"]
    chunk = read_params(result.png)
    assert (chunk["width"], chunk["height"], chunk["drawn_size"]) == (72, 72, [128, 128])


def test_a_dit_model_draws_72x72_as_asked(tiny_models: list[Path]) -> None:
    with Engine.load(tiny_models[0]) as e:
        r = e.generate(GenerationParams(prompt="x", width=72, height=72, **JOB))
    assert r.image.size == (72, 72) and "drawn_size" not in r.metadata
    assert e.last_call["width"] == 72 and not any("drew" in w for w in r.metadata["warnings"])
