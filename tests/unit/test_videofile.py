"""A video job's file (sdfarm.native.videofile) and how the gateway signs its URL
(sdfarm.gateway.auth): mp4 refused with the extra's name when its library is absent here (the
probe injected) or on a worker that has the model (its heartbeat's list); the MP4 decodes to
the frames asked for and depends on them; the formats told apart by their bytes; a video URL's
signature good, tampered and expired."""

from __future__ import annotations

import pytest
from PIL import Image

from sdfarm.client.job import Result
from sdfarm.gateway.auth import Gate
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.video_params import VideoParams, validate
from sdfarm.native.videofile import (
    check_format,
    check_workers,
    encodable_formats,
    format_of,
    mp4,
    mp4_available,
)

from helpers.videomodels import decode_mp4

JOB = "0123456789abcdef0123456789abcdef"


def frames(n: int, size: tuple[int, int], shift: int = 0) -> list[Image.Image]:
    return [
        Image.new("RGB", size, ((40 * i + shift) % 256, 120, (200 - shift) % 256)) for i in range(n)
    ]


def test_mp4_without_its_library_is_refused_naming_the_extra() -> None:
    with pytest.raises(InvalidParameterError) as err:
        check_format("mp4", available=lambda: False)
    assert err.value.parameter == "format"
    assert "pip install 'sdfarm[video]'" in str(err.value) and "imageio_ffmpeg" in str(err.value)
    assert check_format("webp", available=lambda: False) == "webp"  # webp needs nothing
    assert check_format("mp4", available=lambda: True) == "mp4"
    with pytest.raises(InvalidParameterError, match="'gif'; choose one of webp, mp4"):
        check_format("gif")


def test_a_worker_lists_what_it_encodes_and_a_submit_needs_every_worker_with_the_model() -> None:
    assert encodable_formats(available=lambda: False) == ["webp"]
    assert encodable_formats(available=lambda: True) == ["webp", "mp4"]
    check_workers("mp4", {"a/CPU": ["webp", "mp4"], "b/Vulkan0": ["webp", "mp4"]})
    check_workers("webp", {"old/CPU": None})  # a worker from before the list: webp only
    with pytest.raises(InvalidParameterError) as err:
        check_workers("mp4", {"a/CPU": ["webp", "mp4"], "b/Vulkan0": ["webp"], "old/CPU": None})
    assert err.value.parameter == "format"
    message = str(err.value)
    assert "b/Vulkan0, old/CPU lack it" in message and "a/CPU" not in message
    assert "pip install 'sdfarm[video]'" in message
    many = {f"h{i}/CPU": ["webp"] for i in range(8)}
    with pytest.raises(InvalidParameterError, match="h4/CPU and 3 more lack it"):
        check_workers("mp4", many)


def test_the_video_schema_checks_the_format_like_every_parameter() -> None:
    with pytest.raises(InvalidParameterError) as err:
        validate(VideoParams("x", format="avi"))
    assert err.value.parameter == "format"
    assert validate(VideoParams("x")).format == "webp"  # the default, as before the choice


def test_formats_are_told_apart_by_their_bytes() -> None:
    assert format_of(b"RIFF\x10\x00\x00\x00WEBPVP8L") == "webp"
    assert format_of(b"\x00\x00\x00\x20ftypisom") == "mp4"
    assert format_of(b"\x89PNG\r\n\x1a\n....") is None
    assert format_of(b"RIFF\x10\x00\x00\x00WAVEfmt ") is None  # a RIFF that is not a WebP


@pytest.mark.skipif(not mp4_available(), reason="the `video` extra (imageio-ffmpeg) is absent")
def test_an_mp4_decodes_to_the_frames_and_depends_on_them() -> None:
    clip = frames(9, (48, 32))
    data = mp4(clip, 8)
    assert format_of(data) == "mp4"
    meta, decoded = decode_mp4(data)
    assert meta["size"] == (48, 32) and meta["fps"] == 8.0 and len(decoded) == 9
    # lossy, but close: each decoded frame's mean colour is its source's
    for source, got in zip(clip, decoded, strict=True):
        red = sum(got[0::3]) / (48 * 32)
        assert abs(red - source.getpixel((0, 0))[0]) < 8
    assert mp4(clip, 8) == data  # the same frames, the same bytes
    assert mp4(frames(9, (48, 32), shift=90), 8) != data
    assert len(decode_mp4(mp4(clip[:5], 8))[1]) == 5


def test_a_result_names_its_video_by_format() -> None:
    pngs = [b"png0", b"png1", b"\x00\x00\x00\x20ftypisom"]
    video = Result("j", pngs, {"kind": "video", "video_index": 2, "format": "mp4"})
    assert video.frames == [b"png0", b"png1"] and video.mp4 == pngs[2] and video.webp is None
    assert (video.video, video.video_format) == (pngs[2], "mp4")
    old = Result("j", [b"png0", b"RIFFwebp"], {"kind": "video", "webp_index": 1})
    assert old.webp == b"RIFFwebp" and old.video_format == "webp" and old.frames == [b"png0"]
    image = Result("j", [b"png0"], {"seeds": [1]})
    assert image.video is None and image.video_format is None and image.frames == [b"png0"]


def test_a_video_url_is_signed_for_its_job_format_and_expiry_and_then_expires() -> None:
    gate = Gate(["tok"], 60.0, url_ttl_s=600)
    path, expires = gate.video_url(JOB, "mp4", now=1000.0)
    assert expires == 1600 and path.startswith(f"v1/jobs/{JOB}/video.mp4?exp=1600&sig=")
    sig = path.rsplit("sig=", 1)[1]
    assert gate.video_signature(JOB, "mp4", 1600, sig, now=1599.0) == "valid"
    assert gate.video_signature(JOB, "mp4", 1600, sig, now=1601.0) == "expired"
    tampered = ("0" if sig[0] != "0" else "1") + sig[1:]
    assert gate.video_signature(JOB, "mp4", 1600, tampered, now=1000.0) == "invalid"
    assert gate.video_signature(JOB, "mp4", 9999, sig, now=1000.0) == "invalid"  # a later exp
    assert gate.video_signature(JOB, "webp", 1600, sig, now=1000.0) == "invalid"
    assert gate.video_signature("f" * 32, "mp4", 1600, sig, now=1000.0) == "invalid"
    assert gate.video_signature(JOB, "mp4", 1600, "", now=1000.0) == "invalid"
    # another gateway with the same tokens accepts it (replicas); other tokens do not
    assert Gate(["tok"], 60.0).video_signature(JOB, "mp4", 1600, sig, now=1000.0) == "valid"
    assert Gate(["other"], 60.0).video_signature(JOB, "mp4", 1600, sig, now=1000.0) == "invalid"
    # an open gateway signs nothing and needs nothing
    open_gate = Gate([], 60.0)
    assert open_gate.video_url(JOB, "webp") == (f"v1/jobs/{JOB}/video.webp", None)
    assert open_gate.video_signature(JOB, "webp", 1600, sig) == "invalid"
