"""Preview images (pure): the encoding's byte bound, the event round trip, the kind per model,
and the job parameter's range."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.params import MAX_STEPS, GenerationParams, validate
from sdfarm.native.preview import MAX_PREVIEW_BYTES, PREVIEW_SIDE, Preview, encode, mode_for


def noise(w: int, h: int) -> bytes:
    return np.random.default_rng(1).integers(0, 256, (h, w, 3), dtype=np.uint8).tobytes()


def gradient(w: int, h: int) -> bytes:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8).tobytes()


def test_a_smooth_frame_keeps_its_size() -> None:
    data, w, h = encode(gradient(PREVIEW_SIDE, 128), PREVIEW_SIDE, 128)
    assert (w, h) == (PREVIEW_SIDE, 128) and len(data) <= MAX_PREVIEW_BYTES
    assert data[:4] == b"RIFF" and data[8:12] == b"WEBP"


def test_noise_is_shrunk_until_it_fits_the_byte_bound() -> None:
    data, w, h = encode(noise(PREVIEW_SIDE, PREVIEW_SIDE), PREVIEW_SIDE, PREVIEW_SIDE)
    assert len(data) <= MAX_PREVIEW_BYTES
    assert w == h < PREVIEW_SIDE  # 256x256 noise is about 35 KB as WebP: it had to shrink
    small, sw, _ = encode(noise(64, 64), 64, 64, max_bytes=2000)
    assert len(small) <= 2000 and sw < 64
    tiny, tw, th = encode(noise(64, 64), 64, 64, max_bytes=1)
    assert max(tw, th) <= 16 and len(tiny) > 1  # never below 16 pixels: a bound too low stops


def test_a_preview_survives_its_event() -> None:
    data, w, h = encode(gradient(40, 24), 40, 24)
    p = Preview(seq=3, step=2, steps=4, width=w, height=h, data=data)
    ev = p.as_event()
    assert base64.b64decode(ev["image"]) == data and ev["format"] == "webp"
    back = Preview.from_event(ev)
    assert back == p and back.image.size == (40, 24)
    assert p.data_url().startswith("data:image/webp;base64,UklGR")
    with pytest.raises(ValueError):
        Preview.from_event({**ev, "image": "not base64!"})


def test_tae_when_the_model_has_a_taesd_else_the_projection() -> None:
    assert mode_for({"diffusion_model", "llm", "taesd"}) == "tae"
    assert mode_for({"checkpoint"}) == "proj"
    assert mode_for({"diffusion_model", "vae", "t5xxl"}) == "proj"  # never the full VAE


def test_preview_every_is_bounded_and_off_by_default() -> None:
    assert GenerationParams(prompt="p").preview_every == 0
    assert validate(GenerationParams(prompt="p", preview_every=MAX_STEPS)).preview_every == 200
    for bad in (-1, MAX_STEPS + 1):
        with pytest.raises(InvalidParameterError, match="preview_every"):
            validate(GenerationParams(prompt="p", preview_every=bad))
