"""A video job's encoded file: an animated WebP (Pillow, always there) or an MP4 (H.264, when
the optional extra `video` is installed: `pip install 'sdfarm[video]'`, i.e. imageio-ffmpeg,
whose wheel ships an ffmpeg binary).

Why an extra and not a dependency: the imageio-ffmpeg 0.8.1 wheel is 68 MB and installs to
165 MiB (its ffmpeg binary), measured with `pip install --target DIR imageio-ffmpeg` (3.5 s
here); a farm that only makes images should not carry it.

The worker encodes, so what matters is the workers' library, not the submitter's: each
worker's heartbeat lists the formats it can encode (`encodable_formats`), and `Farm.video`
refuses mp4 at submit, naming the extra, when a live worker that has the model cannot
(`check_workers`; the job could land there). In one process (`sdfarm video --in-process`, and
the engine itself before its native call) the check is the local one (`check_format`).

The format is per job (`VideoParams.format`); every door (`sdfarm video --format`, a batch
line's `format`, `POST /v1/videos`'s `format`) reaches `check_format`.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from PIL import Image

from sdfarm.native.errors import InvalidParameterError

VIDEO_FORMATS = ("webp", "mp4")
MEDIA_TYPES = {"webp": "image/webp", "mp4": "video/mp4"}
MP4_EXTRA = "video"
MP4_LIBRARY = "imageio_ffmpeg"
MP4_CRF = 18
"""x264's constant quality: 18 is close to visually lossless (its default is 23); the frames
are the product a user paid device minutes for, the file stays small either way."""
MP4_TIMEOUT_S = 600.0
"""How long ffmpeg may take for one video (81 frames of 832x480 take seconds): a hung
encoder fails the job instead of holding the worker."""


def mp4_available() -> bool:
    """Whether MP4 can be encoded here: the `video` extra's library is importable. Only looked
    up, not imported (its import is cheap, but a farm without it must not pay a failed one on
    every job)."""
    return importlib.util.find_spec(MP4_LIBRARY) is not None


def check_format(fmt: str, available: Callable[[], bool] = mp4_available) -> str:
    """`fmt` when this process can encode it; InvalidParameterError naming `format` otherwise:
    an unknown format, or mp4 without the `video` extra (`available` is the probe, a
    parameter so the refusal is tested without uninstalling anything)."""
    if fmt not in VIDEO_FORMATS:
        raise InvalidParameterError("format", f"{fmt!r}; choose one of {', '.join(VIDEO_FORMATS)}")
    if fmt == "mp4" and not available():
        raise InvalidParameterError(
            "format",
            f"mp4 needs the optional extra {MP4_EXTRA!r} (the {MP4_LIBRARY} package, which "
            f"ships ffmpeg): pip install 'sdfarm[{MP4_EXTRA}]', or ask for format webp",
        )
    return fmt


def encodable_formats(available: Callable[[], bool] = mp4_available) -> list[str]:
    """The formats this process can encode: what a worker's heartbeat lists (`video_formats`)."""
    return [f for f in VIDEO_FORMATS if f != "mp4" or available()]


def check_workers(fmt: str, workers: Mapping[str, Sequence[str] | None]) -> None:
    """InvalidParameterError naming `format` when a worker that may get a job of format `fmt`
    cannot encode it. `workers`: each live worker that has the job's model -> the formats its
    heartbeat lists (None from a worker older than that list: webp only)."""
    lacking = sorted(w for w, formats in workers.items() if fmt not in (formats or ["webp"]))
    if lacking:
        more = f" and {len(lacking) - 5} more" if len(lacking) > 5 else ""
        shown = ", ".join(lacking[:5]) + more
        raise InvalidParameterError(
            "format",
            f"{fmt} needs the optional extra {MP4_EXTRA!r} (the {MP4_LIBRARY} package) on every "
            f"worker that has the model, and {shown} lack it: pip install 'sdfarm[{MP4_EXTRA}]' "
            "there, or ask for format webp",
        )


def format_of(data: bytes) -> str | None:
    """The format of encoded video bytes by their magic (webp, mp4), None for anything else
    (a frame's PNG): how a store or the gateway tells a video result from its frames."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[4:8] == b"ftyp":
        return "mp4"
    return None


def mp4(frames: Sequence[Image.Image], fps: int) -> bytes:
    """The frames as an MP4 (H.264 by libx264 at MP4_CRF, yuv420p so every player plays it,
    the index first for streaming). ffmpeg writes to a seekable file (an MP4's index needs it), read
    back and removed. Frame sizes are multiples of 16 (the video schema's), so nothing is
    rescaled. InvalidParameterError naming `format` without the `video` extra."""
    check_format("mp4")
    import imageio_ffmpeg

    width, height = frames[0].size
    with tempfile.TemporaryDirectory(prefix="sdfarm-mp4-") as tmp:
        path = Path(tmp) / "video.mp4"
        writer = imageio_ffmpeg.write_frames(
            os.fspath(path),
            (width, height),
            fps=fps,
            codec="libx264",
            pix_fmt_out="yuv420p",
            quality=None,
            macro_block_size=16,
            ffmpeg_log_level="error",
            ffmpeg_timeout=MP4_TIMEOUT_S,
            output_params=["-crf", str(MP4_CRF), "-movflags", "+faststart"],
        )
        writer.send(None)
        try:
            for frame in frames:
                writer.send(frame.convert("RGB").tobytes())
        finally:
            writer.close()
        return path.read_bytes()
