"""OpenAI's images/edits request turned into a farm job: the multipart form read (files
`image` (or `image[]`, repeated) and `mask`, the other fields as text), OpenAI's mask turned
into the runtime's, and the `auto` size.

The masks differ. OpenAI's mask is an image whose fully transparent pixels (alpha 0) mark
where `image` is edited; without a mask, the image's own fully transparent pixels do. The
runtime (stable-diffusion.cpp's `prepare_image_generation_latents`) reads a single-channel
mask, rounds each pixel to 0 or 1 and keeps `denoised * mask + init * (1 - mask)`: white is
redrawn, black is kept. So alpha 0 becomes white, every other alpha black. An image with no
fully transparent pixel and no mask is redrawn whole, at `strength` (img2img).

Everything here is checked before a job exists: a damaged or oversized image, a non-image, a
mask without an alpha channel or of another size than the image are 400s naming the field.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from sdfarm.gateway.errors import APIError
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.images import FORMATS, check_image
from sdfarm.native.params import BY_NAME, MAX_REF_IMAGES

IMAGE, MASK = "image", "mask"
MAX_IMAGES = 1 + MAX_REF_IMAGES
"""The first image is edited; the others go to the job as reference images."""
MAX_FIELDS = 200


@dataclass
class EditForm:
    """The form, read: its text fields (a repeated `name[]` as a list), the images, the mask."""

    fields: dict[str, Any] = field(default_factory=dict)
    images: list[bytes] = field(default_factory=list)
    mask: bytes | None = None


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"invalid {param}: {message}", param=param, code="invalid_parameter")


async def form_body(request: Request) -> EditForm:
    """Dependency: the request's multipart form, read whole (the body limit bounds it) and
    closed; the handler validates it, so authorization comes first."""
    ctype = request.headers.get("content-type", "").lower()
    if not ctype.startswith("multipart/form-data"):
        raise APIError(
            400,
            "send an edit as multipart/form-data: the files image (and mask), the other "
            "fields as text",
            code="invalid_content_type",
        )
    try:
        form = await request.form(max_files=MAX_IMAGES + 1, max_fields=MAX_FIELDS)
    except HTTPException as exc:  # Starlette's answer to a malformed or oversized form
        raise APIError(400, f"the form is not valid: {exc.detail}", code="invalid_form") from None
    try:
        out = EditForm()
        for key, value in form.multi_items():
            await _add(out, key, value)
    finally:
        await form.close()
    if not out.images:
        raise _bad(IMAGE, "is required: send the image to edit as the file field image")
    if len(out.images) > MAX_IMAGES:
        raise _bad(IMAGE, f"{len(out.images)} images given, at most {MAX_IMAGES}")
    return out


async def _add(out: EditForm, key: str, value: Any) -> None:
    """One form item into `out`; files only as image or mask, each text field once."""
    name, is_list = (key[:-2], True) if key.endswith("[]") else (key, False)
    if isinstance(value, UploadFile):
        if name not in (IMAGE, MASK):
            raise _bad(name, "only image and mask are files; send this field as text")
        data = await value.read()
        if name == IMAGE:
            out.images.append(data)
        elif out.mask is not None:
            raise _bad(MASK, "one mask at most")
        else:
            out.mask = data
        return
    if name in (IMAGE, MASK):
        raise _bad(name, "must be a file (a form part with a filename), not text")
    have = out.fields.get(name)
    if is_list and (have is None or isinstance(have, list)):
        out.fields[name] = [*(have or []), value]
    elif have is not None:
        raise _bad(name, "given more than once")
    else:
        out.fields[name] = value


def _open(data: bytes) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(data), formats=FORMATS)


def _png(im: Any) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def runtime_mask(image: bytes, mask: bytes | None) -> bytes | None:
    """The runtime's mask (a PNG, mode L: white redrawn, black kept) for OpenAI's `mask`
    over `image` (both already passed `check_image`), or, with no mask, for the image's own
    transparency; None when nothing marks a place (no mask, no fully transparent pixel):
    the image is then redrawn whole. InvalidParameterError("mask") for a mask of another size
    or without an alpha channel."""
    from PIL import Image

    if mask is None:
        with _open(image) as im:
            if not im.has_transparency_data:
                return None
            alpha = im.convert("RGBA").getchannel("A")
        if alpha.getextrema()[0] > 0:  # no fully transparent pixel
            return None
    else:
        with _open(image) as base, _open(mask) as im:
            if im.size != base.size:
                raise InvalidParameterError(
                    MASK,
                    f"is {im.size[0]}x{im.size[1]} pixels; it must be the image's size, "
                    f"{base.size[0]}x{base.size[1]}",
                )
            if not im.has_transparency_data:
                raise InvalidParameterError(
                    MASK,
                    "has no alpha channel: its fully transparent pixels (alpha 0) mark where "
                    "the image is edited",
                )
            alpha = im.convert("RGBA").getchannel("A")
    edited = alpha.point(lambda a: 255 if a == 0 else 0)
    assert isinstance(edited, Image.Image)
    return _png(edited)


def auto_size(image: bytes) -> tuple[int, int]:
    """The job's size for size=auto: the image's, each side rounded down to the size step and
    kept within the width and height bounds (the engine resizes the image to it and says so)."""
    with _open(image) as im:
        w, h = im.size
    return _fit("width", w), _fit("height", h)


def _fit(name: str, side: int) -> int:
    p = BY_NAME[name]
    step = int(p.step or 1)
    return int(min(max(side // step * step, p.lo or step), p.hi or side))


def checked_images(form: EditForm) -> tuple[bytes, list[bytes], bytes | None]:
    """(the image, the reference images, the runtime's mask), each checked; a bad one is
    InvalidParameterError naming the form's field."""
    image = check_image(IMAGE, form.images[0])
    refs = [check_image(f"{IMAGE}[{i}]", d) for i, d in enumerate(form.images[1:], 1)]
    mask = None if form.mask is None else check_image(MASK, form.mask)
    return image, refs, runtime_mask(image, mask)
