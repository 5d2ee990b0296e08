"""The upscale job's schema: its parameters, declared once like a generation's (`Param`s of
sdfarm.native.params), and their validation before any native call.

`UpscaleParams` is the only list of an upscale job's parameters; the CLI flags of `sdfarm
upscale`, `Farm.upscale`, the gateway's `POST /v1/upscale` body and the result's metadata are
derived from `UPSCALE_PARAMS`.

What the runtime does with them (src/upscaler.cpp of master-596): `upscale()` ignores the
factor it is given and always returns the input times the model's scale, so a job's factor is
the upscaler's scale or 0 ("the upscaler's own"), checked once the upscaler is known
(`check_against`). Tiles are `tile_size` input pixels a side with a quarter of overlap; 0 runs
the whole image at once (the most memory); tiles below 32 pixels are refused (params.MIN_TILE).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, replace
from typing import Any

from sdfarm.native import images
from sdfarm.native.catalog import NAME
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.params import (
    DEFAULT_TILE,
    MAX_TILE,
    MIN_TILE,
    WHOLE_IMAGE,
    Param,
    _params_of,
    attached_image,
    param,
    read_image,
)

MAX_FACTOR = 4
MAX_OUTPUT_SIDE = 8192
MAX_OUTPUT_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class UpscaleParams:
    """One upscale request as the upscaler runs it."""

    image: bytes = param("image", MISSING, "the image to upscale")
    upscaler: str = param(
        "text", MISSING, "the upscaler, by name (the farm's upscalers/ folders)", max_chars=128
    )
    factor: int = param(
        "int", 0, "how many times larger: the upscaler's own scale, the only one it makes",
        lo=1, hi=MAX_FACTOR, auto=0, auto_text="the upscaler's scale",
    )  # fmt: skip
    tile_size: int = param(
        "int", DEFAULT_TILE, "input pixels a tile's side: smaller tiles need less memory",
        lo=MIN_TILE, hi=MAX_TILE, auto=0, auto_text=WHOLE_IMAGE,
    )  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready values: the image by its digest and its size (which the scheduler's
        estimate reads; the worker measures the image itself)."""
        out = asdict(self)
        out["image"] = images.digest(self.image)
        out["input_size"] = list(images.size(self.image))
        return out


UPSCALE_PARAMS: tuple[Param, ...] = _params_of(UpscaleParams)
"""Every parameter of an upscale job, in order: what each door derives its fields from."""
UPSCALE_NAMES: tuple[str, ...] = tuple(p.name for p in UPSCALE_PARAMS)


def from_mapping(values: Mapping[str, Any]) -> UpscaleParams:
    """UpscaleParams from a mapping of parameter names; an unknown or missing name is an
    InvalidParameterError naming it. Not validated yet: pass the result to `validate`."""
    values = {k: v for k, v in values.items() if k != "input_size"}
    unknown = sorted(set(values) - set(UPSCALE_NAMES))
    if unknown:
        raise InvalidParameterError(
            unknown[0], f"unknown parameter; the parameters are {', '.join(UPSCALE_NAMES)}"
        )
    for p in UPSCALE_PARAMS:
        if p.required and values.get(p.name) is None:
            raise InvalidParameterError(p.name, "missing")
    return UpscaleParams(**values)


def validate(params: UpscaleParams) -> UpscaleParams:
    """A checked copy, or InvalidParameterError naming the first bad parameter. The output
    size is checked against the largest factor the job may get (its own, else 4), so a job
    the upscaler's scale would make too large is caught here when it can be."""
    checked = {p.name: p.check(getattr(params, p.name)) for p in UPSCALE_PARAMS}
    if not NAME.match(checked["upscaler"]):
        raise InvalidParameterError(
            "upscaler", f"{checked['upscaler']!r} is not a name (letters, digits, '.', '_', '-')"
        )
    out = replace(params, **checked)
    check_output(out, checked["factor"] or None)
    return out


def check_output(params: UpscaleParams, factor: int | None) -> tuple[int, int]:
    """The output size at `factor` (None: only what any factor allows); InvalidParameterError
    naming the image when it is beyond the caps."""
    w, h = images.size(params.image)
    f = factor or 1
    ow, oh = w * f, h * f
    if max(ow, oh) > MAX_OUTPUT_SIDE or ow * oh > MAX_OUTPUT_PIXELS:
        raise InvalidParameterError(
            "image",
            f"{w}x{h} times {f} is {ow}x{oh}, beyond {MAX_OUTPUT_SIDE} pixels a side or "
            f"{MAX_OUTPUT_PIXELS:,} in all; upscale a smaller image",
        )
    return ow, oh


def check_against(params: UpscaleParams, scale: int) -> UpscaleParams:
    """`params` with the factor resolved against the upscaler's `scale` (the only factor the
    runtime produces); InvalidParameterError naming the factor or the image otherwise."""
    if params.factor not in (0, scale):
        raise InvalidParameterError(
            "factor",
            f"{params.factor} is not this upscaler's scale: {params.upscaler!r} upscales "
            f"{scale}x only (the runtime ignores any other factor); use {scale} or 0",
        )
    check_output(params, scale)
    return replace(params, factor=scale)


def detach(params: UpscaleParams) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(the parameters with the image named by its digest, {"image": its bytes}): how an
    upscale job travels, its image beside its parameters (like a generation's inputs)."""
    return params.as_dict(), {"image": params.image}


def attach(values: Mapping[str, Any], inputs: Mapping[str, bytes]) -> dict[str, Any]:
    """The parameters of `detach` with the image back in place of its digest, which it must
    match; InvalidParameterError naming the image otherwise."""
    out = dict(values)
    out["image"] = attached_image("image", values.get("image"), inputs.get("image"))
    return out


def read_image_file(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with an image given as a file path read into its bytes (the CLI, a Python
    caller); InvalidParameterError naming the image when unreadable."""
    out = dict(values)
    if isinstance(out.get("image"), str | os.PathLike):
        out["image"] = read_image("image", out["image"])
    return out


def input_size(values: Mapping[str, Any]) -> tuple[int, int] | None:
    """The input size an upscale job's stored parameters carry (the scheduler's estimate),
    or None when absent or malformed."""
    size = values.get("input_size")
    try:
        w, h = (int(x) for x in size)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        return None
    return (w, h) if w > 0 and h > 0 else None
