"""OpenAI's edit mask turned into the runtime's (pure: Pillow only): alpha 0 is redrawn
(white), any other alpha kept (black); the image's own transparency without a mask; the size
and alpha-channel checks; size=auto."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from sdfarm.gateway.edits import auto_size, runtime_mask
from sdfarm.native.errors import InvalidParameterError


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def rgba(alpha: list[list[int]]) -> Image.Image:
    a = np.array(alpha, dtype=np.uint8)
    im = Image.new("RGBA", (a.shape[1], a.shape[0]), (10, 20, 30, 255))
    im.putalpha(Image.fromarray(a, "L"))
    return im


def mask_of(data: bytes | None) -> np.ndarray:
    assert data is not None
    im = Image.open(io.BytesIO(data))
    assert im.mode == "L"
    return np.asarray(im)


IMAGE = png(Image.new("RGB", (2, 2), (1, 2, 3)))


def test_only_fully_transparent_pixels_are_redrawn() -> None:
    got = mask_of(runtime_mask(IMAGE, png(rgba([[0, 1], [128, 255]]))))
    assert got.tolist() == [[255, 0], [0, 0]]


def test_without_a_mask_the_images_own_transparency_marks_the_edit() -> None:
    assert mask_of(runtime_mask(png(rgba([[255, 0], [0, 255]])), None)).tolist() == [
        [0, 255],
        [255, 0],
    ]
    assert runtime_mask(IMAGE, None) is None  # no alpha: redrawn whole
    assert runtime_mask(png(rgba([[255, 3], [9, 255]])), None) is None  # nothing fully clear


def test_a_palette_mask_with_a_transparent_index_counts() -> None:
    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 255, 255, 255])
    pal.putpixel((1, 0), 1)
    pal.info["transparency"] = 1
    image = png(Image.new("RGB", (2, 1)))
    assert mask_of(runtime_mask(image, png(pal))).tolist() == [[0, 255]]


def test_a_mask_of_another_size_or_without_alpha_is_refused() -> None:
    with pytest.raises(InvalidParameterError, match="image's size, 2x2") as info:
        runtime_mask(IMAGE, png(rgba([[0, 0, 0]])))
    assert info.value.parameter == "mask"
    with pytest.raises(InvalidParameterError, match="no alpha channel"):
        runtime_mask(IMAGE, png(Image.new("L", (2, 2), 0)))


def test_auto_size_rounds_down_to_the_step_within_bounds() -> None:
    assert auto_size(png(Image.new("RGB", (100, 70)))) == (96, 64)
    assert auto_size(png(Image.new("RGB", (8, 9)))) == (64, 64)
