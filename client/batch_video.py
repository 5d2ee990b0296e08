"""Video lines of a batch file: a line whose `kind` is `video` (the job schema's name for the
job kind, sdfarm.store.records.JOB_KINDS) asks for a video of the batch's (Wan) model; its
fields are the video job's parameters (sdfarm.native.video_params: frames, fps, format,
init_image, end_image, ...). Other lines are image jobs (`kind` empty or `generate`).

Why a video line is checked whole when the file is read, not when it is queued as an image
line's ranges are: a video costs minutes of a device, and a typo in line 900 (frames 16, not
4k+1; format gif; an end_image that is not there) should stop the
batch before line 1 is rendered, with the line and the field named. Image paths are relative
to the batch file's folder, as an image line's, and must name a file when the line is read;
the image itself is read and decoded when the line is queued. Pure but for that file check:
tested without a farm (tests/unit/test_batch_video.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.params import Param
from sdfarm.native.video_params import VIDEO_PARAMS, check_frames

KINDS = ("generate", "video")
"""The job kinds a batch line may ask for; `generate` (an image) when left out."""
VIDEO_FIELDS: dict[str, Param] = {p.name: p for p in VIDEO_PARAMS if p.name != "prompt"}
"""Per-line fields of a video line (every video parameter but the prompt)."""
VIDEO_IMAGES = {p.name: p.kind for p in VIDEO_PARAMS if p.kind in ("image", "images")}


class LineError(ValueError):
    """A line of the batch file is wrong; `field` is the field to blame, if one is."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def line_kind(value: Any) -> str:
    """The job kind a line's `kind` field asks for ("generate" when empty); LineError for
    anything else."""
    if value in (None, ""):
        return "generate"
    if value in KINDS:
        return str(value)
    raise LineError(f"kind must be one of {', '.join(KINDS)}, got {value!r}", "kind")


def check_line(params: dict[str, Any]) -> None:
    """A video line's own fields (converted to their types, images still paths) checked
    against the video schema as a job would be: ranges, 4k+1 frames, a known format (whether
    the workers can encode it is asked at submit). LineError naming the field; the seed's -1
    stays -1 (a random seed per job)."""
    for name, value in params.items():
        p = VIDEO_FIELDS[name]
        if p.kind in ("image", "images"):
            continue
        try:
            p.check(value)
            if name == "frames":
                check_frames(value)
        except InvalidParameterError as exc:
            raise LineError(str(exc), name) from None


def check_images(params: dict[str, Any], folder: Path) -> None:
    """Each image path of a video line (already absolute) names a file; LineError naming the
    field and the path as written relative to the batch file's `folder` otherwise."""
    for name in VIDEO_IMAGES:
        value = params.get(name)
        if value is None:
            continue
        path = Path(value)
        if not path.is_file():
            shown = path.relative_to(folder) if path.is_relative_to(folder) else path
            raise LineError(
                f"{name}: no image file {str(shown)!r} (paths are relative to the batch "
                f"file's folder {str(folder)!r})",
                name,
            )


def common_fields(common: dict[str, Any]) -> dict[str, Any]:
    """The command's flags (image parameters) that a video line takes too (width, height,
    steps, seed, cfg_scale, sampler, ...); the others (strength, batch_count, ...) are an
    image's only and do not apply to it."""
    return {k: v for k, v in common.items() if k in VIDEO_FIELDS}
