"""Input images are checked before any native call: format, size, pixels, damage; they travel
as digests beside the parameters and come back only if they match."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from sdfarm.native import images
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.params import GenerationParams, attach_images, detach_images, validate


def encoded(fmt: str, size: tuple[int, int] = (32, 24), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 128).save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_png_jpeg_and_webp_pass_as_they_are(fmt: str) -> None:
    data = encoded(fmt)
    assert images.check_image("init_image", data) == data


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (encoded("GIF"), "is not a PNG, JPEG or WebP"),
        (b"GIF89a not an image at all", "is not a PNG, JPEG or WebP"),
        (encoded("PNG")[:60], "damaged"),
        (encoded("PNG", (4, 4)), "each side must be 8..4096"),
        (encoded("PNG", (4100, 8)), "4100x8 pixels"),
        ("a string", "must be image bytes"),
    ],
)
def test_bad_images_are_refused_naming_the_parameter(data: object, says: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        images.check_image("init_image", data)
    assert err.value.parameter == "init_image" and says in str(err.value)


def test_the_byte_cap_is_checked_before_decoding() -> None:
    big = b"\x89PNG\r\n\x1a\n" + b"\0" * images.MAX_IMAGE_BYTES
    with pytest.raises(InvalidParameterError, match="more than the"):
        images.check_image("mask_image", big)


def test_a_mask_needs_an_init_image_and_lists_are_capped() -> None:
    png = encoded("PNG")
    with pytest.raises(InvalidParameterError) as err:
        validate(GenerationParams(prompt="p", mask_image=png))
    assert err.value.parameter == "mask_image" and "needs an init_image" in str(err.value)
    with pytest.raises(InvalidParameterError, match="at most 4"):
        validate(GenerationParams(prompt="p", ref_images=(png,) * 5))
    with pytest.raises(InvalidParameterError) as err:
        validate(GenerationParams(prompt="p", ref_images=(png, b"junk")))
    assert err.value.parameter == "ref_images[1]"


def test_images_travel_as_digests_and_come_back_only_if_they_match() -> None:
    init, ref = encoded("PNG"), encoded("JPEG")
    params = validate(GenerationParams(prompt="p", init_image=init, ref_images=(ref,)))
    values, inputs = detach_images(params)
    assert values["init_image"] == images.digest(init) and values["ref_images"] == [
        images.digest(ref)
    ]
    assert inputs == {"init_image": init, "ref_images:0": ref}
    back = validate(GenerationParams(**attach_images(values, inputs)))
    assert back == params
    with pytest.raises(InvalidParameterError, match="did not arrive"):
        attach_images(values, {"ref_images:0": ref})
    with pytest.raises(InvalidParameterError, match="is not sha256:"):
        attach_images(values, {**inputs, "init_image": ref})


def test_pixels_are_the_jobs_size_and_a_mask_has_one_channel() -> None:
    raw, resized = images.pixels(encoded("PNG", (32, 24)), 64, 48)
    assert len(raw) == 64 * 48 * 3 and resized
    raw, resized = images.pixels(encoded("PNG", (64, 48), "L"), 64, 48, mask=True)
    assert len(raw) == 64 * 48 and not resized
