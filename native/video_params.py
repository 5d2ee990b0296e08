"""The video job's schema: its parameters, declared once like a generation's (`Param`s of
sdfarm.native.params), and their validation before any native call.

`VideoParams` is the only list of a video job's parameters; `sdfarm video`, `Farm.video`, the
gateway's `POST /v1/videos` body, a batch line of kind video and the frames' metadata derive
from `VIDEO_PARAMS`.

What the runtime does with them (generate_video in src/stable-diffusion.cpp of master-596):
- frames: it makes (frames - 1) // 4 * 4 + 1 frames, silently dropping the rest (the Wan VAE
  packs 4 frames a latent step after the first), so a job asks for 4k+1 frames exactly;
- width and height: it aligns them up to 16 pixels (8 for the VAE times the DiT's 2x2
  patches) with only a warning, so a job gives multiples of 16;
- init_image and end_image: read only by some Wan variants (`sdfarm.native.video.VideoModel`),
  ignored by the others, so they are refused where unused (`VideoModel.check`). The end image
  is pinned as the last frame at the frame size: one of another size is refused (`validate`)
  rather than stretched;
- the high-noise parameters and `moe_boundary`: read only with a Wan 2.2 pair (a model with a
  high_noise_diffusion_model), refused for any other model (`VideoModel.check`). The runtime
  samples `high_noise_steps` steps with the high-noise expert and then `steps` with the
  low-noise one over one schedule of both counts; with -1 (its default) it schedules `steps`
  and switches at the first sigma below `moe_boundary`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, replace
from typing import Any

from sdfarm.native import images
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.params import (
    _PROMPT,
    MAX_SEED,
    MAX_STEPS,
    MIN_STEPS,
    RANDOM_SEED,
    SAMPLERS,
    SCHEDULERS,
    Param,
    _params_of,
    attached_image,
    param,
    read_image,
)
from sdfarm.native.videofile import VIDEO_FORMATS

VIDEO_SIZE_STEP = 16
MIN_VIDEO_SIZE, MAX_VIDEO_SIZE = 32, 2048
MAX_FRAMES = 161
FRAME_STEP = 4
MAX_VIDEO_PIXELS = 64 * 2**20
"""frames x width x height at most: 81 frames of 832x480 (Wan's own clip) are 32.3 M; this
also bounds a result (every frame a PNG, plus the animated WebP)."""
MAX_FPS = 60
VIDEO_IMAGES = ("init_image", "end_image")
MOE_BOUNDARY = 0.875
"""The runtime's default switch (sd_vid_gen_params_init); Wan2.2's own I2V pipeline uses 0.9."""
SWITCH_AT_BOUNDARY = -1
SAME_AS_LOW = -1.0
MOE_PARAMS = ("high_noise_steps", "moe_boundary", "high_noise_cfg_scale", "high_noise_sampler")
"""The parameters of a Wan 2.2 pair's high-noise expert: the runtime reads them only with one."""

_SIZE = {"lo": MIN_VIDEO_SIZE, "hi": MAX_VIDEO_SIZE, "step": VIDEO_SIZE_STEP, "unit": " pixels"}


@dataclass(frozen=True)
class VideoParams:
    """One video request as the engine runs it. `seed=-1` picks a random seed, which the
    result reports."""

    prompt: str = param("text", MISSING, "what to draw", **_PROMPT)
    negative_prompt: str = param("text", "", "what to keep out of the video", **_PROMPT)
    width: int = param("int", 256, "frame width", **_SIZE)
    height: int = param("int", 256, "frame height", **_SIZE)
    frames: int = param(
        "int", 17, "frames of the video: 4k+1 (1, 5, 9, ...), as the Wan VAE packs them",
        lo=1, hi=MAX_FRAMES,
    )  # fmt: skip
    fps: int = param("int", 16, "frames a second of the video", lo=1, hi=MAX_FPS)
    format: str = param(
        "choice", "webp", "the video file: webp (animated, lossless) or mp4 (H.264; needs the "
        "optional extra `video`)", choices=VIDEO_FORMATS,
    )  # fmt: skip
    steps: int = param("int", 20, "sampling steps", lo=1, hi=MAX_STEPS)
    seed: int = param("int", RANDOM_SEED, "random seed", lo=0, hi=MAX_SEED, auto=RANDOM_SEED)
    cfg_scale: float = param("float", 5.0, "classifier-free guidance scale", lo=0.0, hi=50.0)
    sampler: str = param("choice", "default", "sampling method", choices=("default", *SAMPLERS))
    scheduler: str = param(
        "choice", "default", "noise schedule of the sampler", choices=("default", *SCHEDULERS)
    )
    init_image: bytes | None = param(
        "image", None, "the first frame (image-to-video models: Wan2.2 TI2V 5B, Wan2.2 I2V "
        "14B, Wan2.1 I2V / FLF2V with a CLIP vision encoder; a VACE model's reference image)",
    )  # fmt: skip
    end_image: bytes | None = param(
        "image", None, "the last frame, of the frame size (Wan2.2 I2V 14B; Wan2.1 I2V / FLF2V "
        "with a CLIP vision encoder)",
    )  # fmt: skip
    high_noise_steps: int = param(
        "int", SWITCH_AT_BOUNDARY, "steps of a Wan 2.2 pair's high-noise expert, before `steps` "
        "of the low-noise one (0: the low-noise expert only)", lo=0, hi=MAX_STEPS,
        auto=SWITCH_AT_BOUNDARY, auto_text="switch at moe_boundary within `steps`",
    )  # fmt: skip
    moe_boundary: float = param(
        "float", MOE_BOUNDARY, "the noise level (sigma) below which a Wan 2.2 pair's low-noise "
        "expert takes over, when high_noise_steps is -1 (Wan2.2 I2V was trained with 0.9)",
        lo=0.0, hi=1.0,
    )  # fmt: skip
    high_noise_cfg_scale: float = param(
        "float", SAME_AS_LOW, "classifier-free guidance of a Wan 2.2 pair's high-noise expert",
        lo=0.0, hi=50.0, auto=SAME_AS_LOW, auto_text="the same as cfg_scale",
    )  # fmt: skip
    high_noise_sampler: str = param(
        "choice", "default", "sampling method of a Wan 2.2 pair's high-noise expert",
        choices=("default", *SAMPLERS),
    )  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready values: each input image by its digest."""
        out = asdict(self)
        for name in VIDEO_IMAGES:
            value = out[name]
            out[name] = None if value is None else images.digest(value)
        return out

    @property
    def moe_given(self) -> tuple[str, ...]:
        """The high-noise parameters set to other than their defaults (which only a Wan 2.2
        pair reads)."""
        return tuple(
            p.name for p in _params_of(VideoParams) if p.name in MOE_PARAMS and
            getattr(self, p.name) != p.default
        )  # fmt: skip

    @property
    def encodes(self) -> bool:
        """Whether the VAE encodes an input image first (its encoder's working memory)."""
        return self.init_image is not None or self.end_image is not None


VIDEO_PARAMS: tuple[Param, ...] = _params_of(VideoParams)
"""Every parameter of a video job, in order: what each door derives its fields from."""
VIDEO_NAMES: tuple[str, ...] = tuple(p.name for p in VIDEO_PARAMS)


def from_mapping(values: Mapping[str, Any]) -> VideoParams:
    """VideoParams from a mapping of parameter names; an unknown or missing name is an
    InvalidParameterError naming it. Not validated yet: pass the result to `validate`."""
    unknown = sorted(set(values) - set(VIDEO_NAMES))
    if unknown:
        raise InvalidParameterError(
            unknown[0], f"unknown parameter; the parameters are {', '.join(VIDEO_NAMES)}"
        )
    for p in VIDEO_PARAMS:
        if p.required and values.get(p.name) is None:
            raise InvalidParameterError(p.name, "missing")
    return VideoParams(**values)


def check_frames(frames: int) -> None:
    """InvalidParameterError unless `frames` is 4k+1 (the runtime would drop the rest)."""
    if (frames - 1) % FRAME_STEP:
        below = (frames - 1) // FRAME_STEP * FRAME_STEP + 1
        raise InvalidParameterError(
            "frames",
            f"{frames} is not 4k+1: the runtime makes (frames - 1) // 4 * 4 + 1 frames and "
            f"would return {below}; use {below} or {below + FRAME_STEP}",
        )


def check_end_size(data: bytes, width: int, height: int) -> None:
    """InvalidParameterError unless the end image is width x height: the runtime pins it as
    the last frame, and a resize would stretch or squash it unseen."""
    got = images.size(data)
    if got != (width, height):
        raise InvalidParameterError(
            "end_image",
            f"is {got[0]}x{got[1]}, the frames are {width}x{height}: the last frame must be "
            "the frame size; resize the image or ask for frames of its size",
        )


def validate(params: VideoParams) -> VideoParams:
    """A checked copy (types converted, seed resolved), or InvalidParameterError naming the
    first bad parameter and its allowed range."""
    checked = {p.name: p.check(getattr(params, p.name)) for p in VIDEO_PARAMS}
    check_frames(checked["frames"])
    least, why = MIN_STEPS.get(checked["scheduler"], (1, ""))
    if checked["steps"] < least:  # the same schedules as an image's (gits: SIGSEGV at 1)
        raise InvalidParameterError(
            "steps",
            f"scheduler {checked['scheduler']} needs at least {least} steps, got "
            f"{checked['steps']}: {why}; use {least} or more steps, or another scheduler",
        )
    if checked["end_image"] is not None:
        check_end_size(checked["end_image"], checked["width"], checked["height"])
    if checked["moe_boundary"] <= 0 and checked["high_noise_steps"] == SWITCH_AT_BOUNDARY:
        # The runtime switches at the first sigma below the boundary; none is below 0, so it
        # would never run the high-noise expert, the opposite of what a boundary of 0 says.
        raise InvalidParameterError(
            "moe_boundary",
            "0 would never switch the high-noise expert on (the runtime switches at the first "
            "sigma below it); ask a boundary above 0, or high_noise_steps = steps for the "
            "high-noise expert throughout",
        )
    total = checked["frames"] * checked["width"] * checked["height"]
    if total > MAX_VIDEO_PIXELS:
        raise InvalidParameterError(
            "frames",
            f"{checked['frames']} frames of {checked['width']}x{checked['height']} are "
            f"{total:,} pixels, beyond {MAX_VIDEO_PIXELS:,}; ask for fewer frames or smaller ones",
        )
    if checked["seed"] == RANDOM_SEED:
        checked["seed"] = secrets.randbelow(2**31)
    return replace(params, **checked)


def detach(params: VideoParams) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(the parameters with each image named by its digest, {name: bytes}): how a video job
    travels, its images beside its parameters (like a generation's inputs)."""
    inputs = {n: getattr(params, n) for n in VIDEO_IMAGES if getattr(params, n) is not None}
    return params.as_dict(), inputs


def attach(values: Mapping[str, Any], inputs: Mapping[str, bytes]) -> dict[str, Any]:
    """The parameters of `detach` with each image back in place of its digest, which it must
    match; InvalidParameterError naming the image otherwise."""
    out = dict(values)
    for name in VIDEO_IMAGES:
        if out.get(name) is not None:
            out[name] = attached_image(name, out[name], inputs.get(name))
    return out


def read_image_files(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with images given as file paths read into their bytes (the CLI, a Python
    caller, a batch line); InvalidParameterError naming the image when unreadable."""
    out = dict(values)
    for name in VIDEO_IMAGES:
        if isinstance(out.get(name), str | os.PathLike):
            out[name] = read_image(name, out[name])
    return out


def placement_size(values: Mapping[str, Any]) -> tuple[int, int, int, bool]:
    """(width, height, frames, encodes) of a video job's stored parameters: what the
    scheduler's estimate reads (ValueError, TypeError or InvalidParameterError when
    malformed)."""
    p = from_mapping({k: v for k, v in values.items() if k in VIDEO_NAMES})
    width, height = int(p.width), int(p.height)
    frames = int(p.frames)
    if min(width, height, frames) < 1:
        raise ValueError("a video's size and frames are positive")
    return width, height, frames, p.init_image is not None or p.end_image is not None
