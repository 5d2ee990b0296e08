"""Image inputs on a real farm with the tiny model (its TAESD has an encoder): img2img and
inpainting change the image as their inputs do, the same inputs give the same bytes, the images
travel through the store and expire with the job, a model that cannot encode fails the job
saying why, and a bad image is refused before anything is queued."""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file

from sdfarm.client.farm import Farm, JobFailed
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.model import Model
from sdfarm.store import keys

from helpers.gateway import cpu_farm, served_gateway

pytestmark = pytest.mark.e2e

MODEL = "tiny-f16"
SMALL = {"width": 64, "height": 64, "steps": 4, "seed": 11}


def noise_png(seed: int, size: tuple[int, int] = (64, 64)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG")
    return buf.getvalue()


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_models: list[Path]) -> Path:
    """The tiny models plus `no-encoder`: tiny-f16 with its TAESD's encoder removed."""
    root = tmp_path_factory.mktemp("image-models")
    for model in tiny_models:
        shutil.copytree(model, root / model.name)
    cut = root / "no-encoder"
    shutil.copytree(tiny_models[0], cut)
    tensors = load_file(str(cut / "taesd.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("encoder.")},
              str(cut / "taesd.safetensors"))  # fmt: skip
    return root


@pytest.fixture(scope="module")
def farm(models: Path) -> Iterator[Any]:
    with cpu_farm(models, "imagehost") as f:
        yield f


@pytest.fixture
def client(farm: Any) -> Iterator[Farm]:
    with Farm(farm.url, submitter="image-tests") as f:
        yield f


def test_img2img_follows_its_init_image_and_repeats_exactly(client: Farm) -> None:
    a, b = noise_png(1), noise_png(2)
    first = client.submit(MODEL, "img2img", init_image=a, strength=0.25, **SMALL).result(60)
    again = client.submit(MODEL, "img2img", init_image=a, strength=0.25, **SMALL).result(60)
    other = client.submit(MODEL, "img2img", init_image=b, strength=0.25, **SMALL).result(60)
    plain = client.submit(MODEL, "img2img", **SMALL).result(60)
    assert first.png == again.png  # the same inputs, the same bytes
    assert np.abs(pixels(first.png) - pixels(other.png)).max() > 0  # the init image counts
    assert np.abs(pixels(first.png) - pixels(plain.png)).max() > 0  # img2img is not txt2img
    assert first.metadata["strength"] == 0.25
    assert first.metadata["init_image"].startswith("sha256:")


def test_inpainting_and_a_resized_input_say_so(client: Farm) -> None:
    init = noise_png(3, (80, 72))
    mask = io.BytesIO()
    Image.new("L", (64, 64), 255).save(mask, "PNG")
    job = client.submit(MODEL, "inpaint", init_image=init, mask_image=mask.getvalue(),
                        strength=0.5, **SMALL)  # fmt: skip
    result = job.result(60)
    assert result.png.startswith(b"\x89PNG")
    assert "init_image was resized to 64x64, the job's size" in result.metadata["warnings"]
    ttls = client.store.ttls(job.id)
    assert 0 < ttls[keys.input_key(job.id)] <= keys.RESULT_TTL  # the images expire with it


def test_a_model_that_cannot_encode_fails_the_job_saying_why(client: Farm, models: Path) -> None:
    assert Model.from_dir(models / MODEL).can_encode
    assert not Model.from_dir(models / "no-encoder").can_encode
    assert client.submit("no-encoder", "txt2img still works", **SMALL).result(60).png
    job = client.submit("no-encoder", "img2img", init_image=noise_png(4), **SMALL)
    with pytest.raises(JobFailed) as info:
        job.result(60)
    assert "cannot encode an image" in info.value.error and "no encoder" in info.value.error


def test_a_bad_image_is_refused_before_anything_is_queued(client: Farm, farm: Any) -> None:
    before = client.store.queues()["pending"], sum(client.store.count_by_state().values())
    with pytest.raises(InvalidParameterError) as info:
        client.submit(MODEL, "bad", init_image=b"GIF89a not an image", **SMALL)
    assert info.value.parameter == "init_image"
    with pytest.raises(InvalidParameterError, match="cannot read"):
        client.submit(MODEL, "missing", init_image=Path("/nonexistent/init.png"), **SMALL)
    assert (client.store.queues()["pending"], sum(client.store.count_by_state().values())) == (
        before
    )
    with served_gateway(farm.url, [], 60) as base:
        body = {"model": MODEL, "prompt": "x", "init_image": "not base64!", **SMALL}
        r = httpx.post(f"{base}/v1/jobs", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "init_image"
        good = base64.b64encode(noise_png(5)).decode()
        r = httpx.post(f"{base}/v1/jobs", json={**body, "init_image": good}, timeout=30)
        assert r.status_code == 202, r.text
        assert client.job(r.json()["id"]).result(60).metadata["init_image"].startswith("sha256:")
