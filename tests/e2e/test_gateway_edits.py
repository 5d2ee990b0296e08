"""POST /v1/images/edits through the real `openai` package's `images.edit`, against the gateway
served by uvicorn over a real local farm (redis-server, scheduler, one CPU worker, the tiny
model): edited PNGs that follow the input image, OpenAI's mask semantics as the runtime
applies them, owners, and bad inputs refused with 400 naming the field before any job exists.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image, PngImagePlugin

from sdfarm.gateway.bodylimit import MAX_BODY
from sdfarm.native.images import MAX_IMAGE_BYTES
from sdfarm.store import Store

from helpers.gateway import cpu_farm, served_gateway

pytestmark = pytest.mark.e2e

MODEL = "tiny-f16"
TOKEN_A, TOKEN_B = "edits-token-a", "edits-token-b"
RUN = {"seed": 11, "steps": 4, "strength": 0.5}


def png(im: Image.Image, pad_to: int = 0) -> bytes:
    """`im` as PNG bytes; `pad_to`: a text chunk makes the file exactly that many bytes."""
    buf = io.BytesIO()
    im.save(buf, "PNG")
    if pad_to:
        info = PngImagePlugin.PngInfo()
        info.add_text("pad", "x" * (pad_to - len(buf.getvalue()) - 16))
        buf = io.BytesIO()
        im.save(buf, "PNG", pnginfo=info)
    return buf.getvalue()


def noise(seed: int, size: tuple[int, int] = (64, 64)) -> Image.Image:
    rgb = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(rgb, "RGB")


def with_alpha(im: Image.Image, transparent_left: bool) -> Image.Image:
    """`im` as RGBA: fully transparent on its left half (or nowhere), opaque elsewhere."""
    alpha = np.full((im.height, im.width), 255, dtype=np.uint8)
    if transparent_left:
        alpha[:, : im.width // 2] = 0
    out = im.convert("RGBA")
    out.putalpha(Image.fromarray(alpha, "L"))
    return out


def mask(size: tuple[int, int], alpha: int) -> bytes:
    return png(Image.new("RGBA", size, (0, 0, 0, alpha)))


def pixels(b64: str | bytes) -> np.ndarray:
    import base64

    data = base64.b64decode(b64) if isinstance(b64, str) else b64
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="module")
def farm(models_dir: Path) -> Iterator[Any]:
    with cpu_farm(models_dir, "editshost") as f:
        yield f


@pytest.fixture(scope="module")
def gateway(farm: Any) -> Iterator[str]:
    with served_gateway(farm.url, [TOKEN_A, TOKEN_B], 120.0) as url:
        yield url


@pytest.fixture
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=TOKEN_A, max_retries=0, timeout=120)


def edit(client: openai.OpenAI, image: Any, **kw: Any) -> list[np.ndarray]:
    extra = {**RUN, **kw.pop("extra", {})}
    got = client.images.edit(
        model=MODEL,
        image=image,
        prompt=kw.pop("prompt", "a red barn"),
        response_format="b64_json",
        extra_body=extra,
        **kw,
    )
    assert got.data
    return [pixels(d.b64_json or "") for d in got.data]


def test_edit_returns_pngs_that_follow_the_image(client: openai.OpenAI) -> None:
    a, b = png(noise(1)), png(noise(2))
    first = edit(client, ("a.png", a, "image/png"), n=2, size="64x64")
    again = edit(client, ("a.png", a, "image/png"), n=2, size="64x64")
    other = edit(client, ("b.png", b, "image/png"), n=2, size="64x64")
    assert len(first) == 2 and first[0].shape == (64, 64, 3)
    assert all(np.array_equal(x, y) for x, y in zip(first, again, strict=True))
    assert np.abs(first[0] - other[0]).max() > 0  # the image is the job's init image
    assert np.abs(first[0] - first[1]).max() > 0  # n images: seeds seed, seed+1
    auto = edit(client, ("wide.png", png(noise(3, (100, 70))), "image/png"))  # size=auto
    assert auto[0].shape == (64, 96, 3)  # each side rounded down to a multiple of 8
    refs = edit(client, [("a.png", a, "image/png"), ("b.png", b, "image/png")], size="64x64")
    assert refs[0].shape == (64, 64, 3)  # image[]: the others are reference images


def test_the_mask_follows_openai_semantics(client: openai.OpenAI) -> None:
    """OpenAI's mask is transparent where to edit. A fully opaque mask keeps the whole image
    (the seed cannot matter); a fully transparent one redraws it (the seed does); an image
    transparent on its left half, with no mask, is the same job as the opaque image with a
    mask transparent on its left half."""
    image = ("i.png", png(noise(4)), "image/png")

    def seeded(m: bytes, seed: int) -> np.ndarray:
        return edit(client, image, mask=("m.png", m, "image/png"), extra={"seed": seed})[0]

    keep = mask((64, 64), 255)
    assert np.array_equal(seeded(keep, 1), seeded(keep, 2))
    redraw = mask((64, 64), 0)
    assert np.abs(seeded(redraw, 1) - seeded(redraw, 2)).max() > 0
    own = edit(client, ("t.png", png(with_alpha(noise(4), True)), "image/png"))[0]
    left = png(with_alpha(Image.new("RGB", (64, 64)), True))
    given = edit(client, image, mask=("m.png", left, "image/png"))[0]
    assert np.array_equal(own, given)
    assert np.abs(own - seeded(keep, RUN["seed"])).max() > 0


def test_urls_and_owners_as_for_generations(client: openai.OpenAI, gateway: str) -> None:
    got = client.images.edit(
        model=MODEL, image=("a.png", png(noise(5)), "image/png"), prompt="x",
        response_format="url", extra_body=RUN,
    )  # fmt: skip
    url = got.data[0].url or ""
    assert httpx.get(url, timeout=30).content.startswith(b"\x89PNG")  # signed: no token needed
    job_id = url.split("/v1/jobs/")[1].split("/")[0]
    mine = httpx.get(f"{gateway}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {TOKEN_A}"})
    theirs = httpx.get(f"{gateway}/v1/jobs/{job_id}",
                       headers={"Authorization": f"Bearer {TOKEN_B}"})  # fmt: skip
    assert mine.status_code == 200 and theirs.status_code == 404
    anonymous = httpx.post(f"{gateway}/v1/images/edits", files={"image": ("a.png", b"x")})
    assert anonymous.status_code == 401


def test_image_and_mask_at_their_caps_pass_the_body_limit(client: openai.OpenAI) -> None:
    image, m = png(noise(6), MAX_IMAGE_BYTES), png(with_alpha(noise(7), True), MAX_IMAGE_BYTES)
    assert len(image) == len(m) == MAX_IMAGE_BYTES and 2 * MAX_IMAGE_BYTES < MAX_BODY
    got = edit(client, ("big.png", image, "image/png"), mask=("m.png", m, "image/png"))
    assert got[0].shape == (64, 64, 3)


def _refused(client: openai.OpenAI, image: Any, **kw: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(model=MODEL, image=image, prompt="x", extra_body=RUN, **kw)
    assert info.value.status_code == 400
    err = info.value.body
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
    return err


def test_bad_inputs_are_refused_naming_the_field_before_any_job(
    client: openai.OpenAI, farm: Any, gateway: str
) -> None:
    good = png(noise(8))
    store = Store.connect(farm.url)
    before = sum(store.count_by_state().values())
    cases = [
        (("c.png", good[: len(good) // 2], "image/png"), {}, "image", "damaged"),
        (("t.txt", b"not an image at all", "text/plain"), {}, "image", "not a PNG"),
        (("big.png", png(noise(9), MAX_IMAGE_BYTES + 1), "image/png"), {}, "image", "bytes"),
        (("i.png", good, "image/png"), {"mask": ("m.png", mask((32, 32), 0))}, "mask", "size"),
        (("i.png", good, "image/png"), {"mask": ("m.png", png(noise(1)))}, "mask", "alpha"),
        (("i.png", good, "image/png"), {"mask": ("m.gif", b"GIF89a")}, "mask", "not a PNG"),
        (("i.png", good, "image/png"), {"size": "64x65"}, "size", "multiple"),
    ]
    for image, kw, param, words in cases:
        err = _refused(client, image, **kw)
        assert err["param"] == param and words in err["message"], (param, err)
    auth = {"Authorization": f"Bearer {TOKEN_A}"}
    r = httpx.post(f"{gateway}/v1/images/edits", json={"model": MODEL, "prompt": "x"},
                   headers=auth)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"
    r = httpx.post(f"{gateway}/v1/images/edits", data={"model": MODEL, "prompt": "x"},
                   files={"mask": ("m.png", mask((64, 64), 0))}, headers=auth)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "image"
    assert sum(store.count_by_state().values()) == before  # nothing was submitted
    store.close()
