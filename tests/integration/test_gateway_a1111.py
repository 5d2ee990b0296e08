"""AUTOMATIC1111's API on the gateway over a real local farm (redis-server, scheduler, one CPU
worker with the tiny models), spoken to by the third-party `webuiapi` package unchanged and by
httpx: txt2img, img2img, models, options, lists, progress and interrupt, refusals by name."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import webuiapi
from PIL import Image

from sdfarm.native.testmodel import TEST_LORA

from helpers.gateway import cpu_farm, served_gateway

TOKEN = "a1111-test-token"
SMALL = {"width": 64, "height": 64, "steps": 2, "cfg_scale": 1.0}


@pytest.fixture(scope="module")
def local_farm(models_dir: Path) -> Iterator[Any]:
    with cpu_farm(models_dir, "a1111host") as farm:
        yield farm


@pytest.fixture(scope="module")
def gateway(local_farm: Any) -> Iterator[str]:
    with served_gateway(local_farm.url, [TOKEN], 120.0) as url:
        yield url


@pytest.fixture(scope="module")
def api(gateway: str) -> webuiapi.WebUIApi:
    port = int(gateway.rsplit(":", 1)[1])
    return webuiapi.WebUIApi(
        host="127.0.0.1", port=port, username="me", password=TOKEN, sampler="Euler", steps=2
    )


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=f"{gateway}/sdapi/v1", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120
    ) as c:
        yield c


def _pixels(img: Image.Image) -> bytes:
    return img.convert("RGB").tobytes()


def _noise(seed: int, size: int = 64) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def test_webuiapi_txt2img_unchanged(api: webuiapi.WebUIApi) -> None:
    first = api.txt2img(prompt="a lighthouse at dusk", seed=5, **SMALL)
    again = api.txt2img(prompt="a lighthouse at dusk", seed=5, **SMALL)
    other = api.txt2img(prompt="a lighthouse at dusk", seed=6, **SMALL)
    assert first.image.size == (64, 64)
    assert _pixels(first.image) == _pixels(again.image)
    assert _pixels(first.image) != _pixels(other.image)
    assert first.info["all_seeds"] == [5]
    assert first.info["sampler_name"] == "Euler"
    assert "Seed: 5" in first.info["infotexts"][0]
    assert "Steps: 2, Sampler: Euler" in first.info["infotexts"][0]
    assert first.parameters["prompt"] == "a lighthouse at dusk"


def test_webuiapi_batch_and_seeds(api: webuiapi.WebUIApi) -> None:
    r = api.txt2img(prompt="two boats", seed=40, batch_size=2, n_iter=1, **SMALL)
    assert len(r.images) == 2
    assert r.info["all_seeds"] == [40, 41]
    assert _pixels(r.images[0]) != _pixels(r.images[1])


def test_webuiapi_img2img_depends_on_its_image(api: webuiapi.WebUIApi) -> None:
    a, b = _noise(1), _noise(2)
    kw = {"prompt": "a red house", "seed": 9, "denoising_strength": 0.25, **SMALL}
    ra = api.img2img(images=[a], **kw)
    ra2 = api.img2img(images=[a], **kw)
    rb = api.img2img(images=[b], **kw)
    assert ra.image.size == (64, 64)
    assert _pixels(ra.image) == _pixels(ra2.image)
    assert _pixels(ra.image) != _pixels(rb.image)
    assert "Denoising strength: 0.25" in ra.info["infotexts"][0]
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 64))  # redraw the left half
    rm = api.img2img(images=[a], mask_image=mask, inpainting_fill=1, mask_blur=0, **kw)
    assert _pixels(rm.image) != _pixels(ra.image)


def test_webuiapi_models_and_model_choice(api: webuiapi.WebUIApi, http: httpx.Client) -> None:
    titles = sorted(m["title"] for m in api.get_sd_models())
    assert titles == ["tiny-f16", "tiny-q8_0"]
    assert api.util_get_model_names() == titles
    api.set_options({"sd_model_checkpoint": "tiny-q8_0 [0123abcd]"})
    assert api.get_options()["sd_model_checkpoint"] == "tiny-q8_0"
    r = api.txt2img(prompt="a field", seed=3, **SMALL)
    assert r.info["sd_model_name"] == "tiny-q8_0"
    over = {"override_settings": {"sd_model_checkpoint": "tiny-f16"}, "prompt": "a field",
            "seed": 3, **SMALL}  # fmt: skip
    doc = http.post("/txt2img", json=over).json()
    assert json.loads(doc["info"])["sd_model_name"] == "tiny-f16"
    bad = http.post("/options", json={"sd_model_checkpoint": "nope"})
    assert bad.status_code == 404 and "nope" in bad.text
    other = http.post("/options", json={"samples_format": "jpg"})
    assert other.status_code == 400 and "samples_format" in other.text


def test_lists(http: httpx.Client) -> None:
    samplers = {s["name"] for s in http.get("/samplers").json()}
    assert {"Euler a", "Euler", "DPM++ 2M", "LCM"} <= samplers
    schedulers = {s["name"] for s in http.get("/schedulers").json()}
    assert {"automatic", "karras", "simple"} <= schedulers
    assert TEST_LORA in {lo["name"] for lo in http.get("/loras").json()}
    assert "Latent" in {u["name"] for u in http.get("/upscalers").json()}
    assert http.get("/scripts").json() == {"txt2img": [], "img2img": []}


def test_lora_tag_in_the_prompt(http: httpx.Client) -> None:
    body = {"prompt": "a cat", "seed": 11, **SMALL}
    plain = http.post("/txt2img", json=body).json()
    tagged = http.post("/txt2img", json={**body, "prompt": f"a cat <lora:{TEST_LORA}:0.9>"})
    assert tagged.status_code == 200, tagged.text
    info = json.loads(tagged.json()["info"])
    assert info["prompt"] == "a cat"
    assert info["infotexts"][0].startswith(f"a cat <lora:{TEST_LORA}:0.9>\n")  # as A1111 writes it
    assert plain["images"][0] != tagged.json()["images"][0]
    unknown = http.post("/txt2img", json={**body, "prompt": "a cat <lora:nope:1>"})
    assert unknown.status_code == 400 and "nope" in unknown.text


@pytest.mark.parametrize(
    ("field", "body"),
    [
        ("restore_faces", {"restore_faces": True}),
        ("tiling", {"tiling": True}),
        ("script_name", {"script_name": "x/y/z plot"}),
        ("hr_upscaler", {"enable_hr": True, "hr_upscaler": "R-ESRGAN 4x+"}),
        ("sampler_name", {"sampler_name": "Nonexistent"}),
        ("batch_size", {"batch_size": 9, "n_iter": 2}),
        ("alwayson_scripts", {"alwayson_scripts": {"ControlNet": {"args": [{"enabled": True}]}}}),
    ],
)
def test_refused_by_name(http: httpx.Client, field: str, body: dict[str, Any]) -> None:
    resp = http.post("/txt2img", json={"prompt": "x", **SMALL, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field


def test_hires_with_a_farm_upscaler(http: httpx.Client) -> None:
    body = {"prompt": "a tower", "seed": 2, "enable_hr": True, "hr_scale": 2,
            "hr_upscaler": "tiny-esrgan-x2", "hr_second_pass_steps": 1,
            "denoising_strength": 0.5, **SMALL}  # fmt: skip
    resp = http.post("/txt2img", json=body)
    assert resp.status_code == 200, resp.text
    img = Image.open(io.BytesIO(base64.b64decode(resp.json()["images"][0])))
    assert img.size == (128, 128)


def test_unknown_fields_ignored_and_hires(http: httpx.Client) -> None:
    body = {"prompt": "a tower", "seed": 2, "enable_hr": True, "hr_scale": 1.5,
            "hr_second_pass_steps": 1, "denoising_strength": 0.5, "eta": 0.3,
            "some_future_field": {"x": 1}, **SMALL}  # fmt: skip
    resp = http.post("/txt2img", json=body)
    assert resp.status_code == 200, resp.text
    img = Image.open(io.BytesIO(base64.b64decode(resp.json()["images"][0])))
    assert img.size == (96, 96)
    assert "Hires upscale: 1.5" in json.loads(resp.json()["info"])["infotexts"][0]


def test_auth(gateway: str) -> None:
    assert httpx.get(f"{gateway}/sdapi/v1/sd-models").status_code == 401
    wrong = httpx.get(f"{gateway}/sdapi/v1/sd-models", auth=("me", "wrong"))
    assert wrong.status_code == 401
    assert httpx.get(f"{gateway}/sdapi/v1/sd-models", auth=("me", TOKEN)).status_code == 200


def test_progress_and_interrupt(http: httpx.Client, gateway: str) -> None:
    idle = http.get("/progress").json()
    assert idle["state"]["job_count"] == 0 and idle["progress"] == 0.0
    answer: dict[str, Any] = {}

    def long_job() -> None:
        body = {"prompt": "a long one", "seed": 1, "width": 256, "height": 256, "steps": 60,
                "cfg_scale": 1.0}  # fmt: skip
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
            answer["resp"] = c.post(f"{gateway}/sdapi/v1/txt2img", json=body)

    t = threading.Thread(target=long_job)
    t.start()
    deadline = time.monotonic() + 60
    doc = idle
    while time.monotonic() < deadline:
        doc = http.get("/progress").json()
        if doc["state"]["sampling_step"] >= 1:
            break
        time.sleep(0.1)
    assert doc["state"]["job_count"] == 1 and doc["state"]["sampling_steps"] == 60
    assert 0 < doc["progress"] < 1
    assert http.post("/interrupt").json() == {}
    t.join(60)
    assert answer["resp"].status_code == 409, answer["resp"].text
    after = http.get("/progress").json()
    assert after["state"]["job_count"] == 0


def test_webuiapi_extra_single_image_upscales_on_the_farm(api: webuiapi.WebUIApi) -> None:
    names = {u["name"]: u["scale"] for u in api.get_upscalers()}
    assert names.get("tiny-esrgan-x2") == 2
    img = _noise(5, 32)
    up = api.extra_single_image(image=img, upscaler_1="tiny-esrgan-x2", upscaling_resize=2)
    again = api.extra_single_image(image=img, upscaler_1="tiny-esrgan-x2", upscaling_resize=2)
    other = api.extra_single_image(image=_noise(6, 32), upscaler_1="tiny-esrgan-x2",
                                   upscaling_resize=2)  # fmt: skip
    assert up.image.size == (64, 64)
    assert _pixels(up.image) == _pixels(again.image) != _pixels(other.image)


@pytest.mark.parametrize(
    ("field", "body"),
    [("upscaling_resize", {"upscaler_1": "tiny-esrgan-x2", "upscaling_resize": 3}),
     ("upscaler_1", {"upscaler_1": "nope", "upscaling_resize": 2}),
     ("gfpgan_visibility", {"upscaler_1": "tiny-esrgan-x2", "gfpgan_visibility": 0.5})],
)  # fmt: skip
def test_extras_refused_by_name(http: httpx.Client, field: str, body: dict[str, Any]) -> None:
    buf = io.BytesIO()
    _noise(7, 32).save(buf, format="PNG")
    image = base64.b64encode(buf.getvalue()).decode()
    resp = http.post("/extra-single-image", json={"image": image, **body})
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["param"] == field


def test_progress_shows_the_running_jobs_preview(http: httpx.Client, gateway: str) -> None:
    answer: dict[str, Any] = {}

    def job() -> None:
        body = {"prompt": "a preview", "seed": 3, "width": 128, "height": 128, "steps": 30,
                "cfg_scale": 1.0, "override_settings": {}}  # fmt: skip
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
            answer["resp"] = c.post(
                f"{gateway}/v1/jobs",
                json={
                    "model": "tiny-q8_0",
                    "preview_every": 1,
                    **{k: v for k, v in body.items() if k != "override_settings"},
                },
            )

    job()
    assert answer["resp"].status_code == 202, answer["resp"].text
    deadline = time.monotonic() + 60
    seen = None
    while time.monotonic() < deadline and seen is None:
        doc = http.get("/progress").json()
        seen = doc["current_image"]
        time.sleep(0.05)
    assert seen is not None, "no preview while the job ran"
    img = Image.open(io.BytesIO(base64.b64decode(seen)))
    assert max(img.size) <= 256
    assert http.post("/interrupt").json() == {}
