"""Input images (img2img, inpainting masks, reference images): checked before any native call,
named by their digest, and turned into what the runtime reads.

An input image comes from a user, over the network: it is decoded here with Pillow, whose
formats are limited to PNG, JPEG and WebP (no format Pillow would guess from a name), with a
cap on its encoded size and on its pixels checked before the pixels are decoded (a
decompression bomb is refused from its header). The runtime takes raw 8-bit pixels of the job's
size: an image of another size is resized (its aspect ratio is not kept; the job's warnings say
so), a mask is made single-channel.

Images are large, so they do not travel inside the job's parameters: those carry each image's
digest (`sha256:...`), the bytes travel beside them (the store's `input:{id}`), and the
metadata and the PNG chunk record the digest, which names the input exactly.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

from sdfarm.native.errors import InvalidParameterError

FORMATS = ("PNG", "JPEG", "WEBP")
MAX_IMAGE_BYTES = 8 * 1024 * 1024
MAX_IMAGE_SIDE = 4096
MIN_IMAGE_SIDE = 8
DIGEST_PREFIX = "sha256:"


def digest(data: bytes) -> str:
    """How an input image is named in parameters, metadata and the PNG chunk."""
    return DIGEST_PREFIX + hashlib.sha256(data).hexdigest()


def is_digest(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(DIGEST_PREFIX) and len(value) == 71


def check_image(name: str, data: Any) -> bytes:
    """`data` if it is a PNG, JPEG or WebP image within the caps; InvalidParameterError naming
    the parameter and what is wrong otherwise. Decodes it fully (a truncated file fails
    here, not in the runtime)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(data, bytearray | memoryview):
        data = bytes(data)
    if not isinstance(data, bytes):
        raise InvalidParameterError(name, f"must be image bytes, got {type(data).__name__}")
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidParameterError(
            name, f"is {len(data):,} bytes, more than the {MAX_IMAGE_BYTES:,} an input image may be"
        )
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:
            w, h = im.size
            if not (
                MIN_IMAGE_SIDE <= w <= MAX_IMAGE_SIDE and MIN_IMAGE_SIDE <= h <= MAX_IMAGE_SIDE
            ):
                raise InvalidParameterError(
                    name,
                    f"is {w}x{h} pixels; each side must be {MIN_IMAGE_SIDE}..{MAX_IMAGE_SIDE}",
                )
            im.load()
    except InvalidParameterError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError):
        raise InvalidParameterError(
            name, "is not a PNG, JPEG or WebP image (or too large to decode)"
        ) from None
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
        raise InvalidParameterError(name, f"is a damaged image: {exc}") from None
    return data


def size(data: bytes) -> tuple[int, int]:
    """(width, height) of an image that passed `check_image`, from its header."""
    from PIL import Image

    with Image.open(io.BytesIO(data), formats=FORMATS) as im:
        return im.size


def rgb(data: bytes) -> tuple[bytes, int, int, bool]:
    """An image as the upscaler reads it, at its own size: 8-bit RGB pixels, width, height,
    and whether an alpha channel was dropped (the runtime upscales three channels)."""
    from PIL import Image

    with Image.open(io.BytesIO(data), formats=FORMATS) as im:
        alpha = "A" in im.getbands() or "transparency" in im.info
        im = im.convert("RGB")
        return im.tobytes(), im.width, im.height, alpha


def pixels(data: bytes, width: int, height: int, mask: bool = False) -> tuple[bytes, bool]:
    """The image as the runtime reads it: 8-bit RGB (a mask: one channel, L) of exactly
    width x height, and whether it had to be resized."""
    from PIL import Image

    with Image.open(io.BytesIO(data), formats=FORMATS) as im:
        im = im.convert("L" if mask else "RGB")
        resized = im.size != (width, height)
        if resized:
            im = im.resize((width, height), Image.NEAREST if mask else Image.LANCZOS)
        return im.tobytes(), resized
