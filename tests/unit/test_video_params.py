"""The video job's pure parts: its parameters' validation (frames 4k+1, sizes of 16, the caps),
the reading of a Wan DiT's header as the runtime reads it (variant, layer count: one the
runtime would abort on is refused), which input images each variant takes, the test model's
architecture, the video estimate and the scheduler's shape of a queued video job, and the
client's view of a video result."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from sdfarm.client.job import Result
from sdfarm.native import video_params
from sdfarm.native.errors import InvalidParameterError, ModelLoadError
from sdfarm.native.estimate import ModelFacts, job_estimate
from sdfarm.native.headers import FileHeader, TensorInfo
from sdfarm.native.video import CLIP_VISION_NEEDED, check_header, check_pair, describe
from sdfarm.native.video_params import MAX_FRAMES, VideoParams, check_frames, validate
from sdfarm.native.wantestmodel import dit_specs, vae_specs
from sdfarm.scheduler.dispatch import _pending_job, _video_frames


def ok(**kw: Any) -> VideoParams:
    return validate(VideoParams(**{"prompt": "x", "width": 64, "height": 64, **kw}))


def refused(**kw: Any) -> InvalidParameterError:
    with pytest.raises(InvalidParameterError) as err:
        ok(**kw)
    return err.value


def test_frames_must_be_4k_plus_1_within_the_cap() -> None:
    for frames in (1, 5, 9, 81, MAX_FRAMES):
        check_frames(frames)
        assert ok(frames=frames).frames == frames
    for frames in (2, 4, 6, 8, 80):
        err = refused(frames=frames)
        below = (frames - 1) // 4 * 4 + 1
        assert err.parameter == "frames" and "4k+1" in str(err)
        assert f"use {below} or {below + 4}" in str(err)  # what the runtime would have made
    for frames in (0, -3, MAX_FRAMES + 4):
        assert refused(frames=frames).parameter == "frames"


def test_sizes_are_multiples_of_16_and_the_video_is_capped() -> None:
    assert refused(width=72).parameter == "width"  # a multiple of 8, not of 16
    assert refused(height=16).parameter == "height"  # below 32
    err = refused(width=2048, height=2048, frames=17)  # 71 M pixels in all
    assert err.parameter == "frames" and "fewer frames" in str(err)
    assert refused(fps=0).parameter == "fps"
    assert refused(steps=0).parameter == "steps"
    assert "SIGSEGV" in str(refused(steps=1, scheduler="gits"))  # as for an image
    assert ok(seed=-1).seed >= 0  # resolved, so the result reports it
    assert refused(end_image=b"not an image").parameter == "end_image"


def test_parameters_travel_with_their_images_by_digest() -> None:
    from io import BytesIO

    from PIL import Image

    buf = BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, "PNG")
    params = ok(init_image=buf.getvalue())
    doc, inputs = video_params.detach(params)
    assert doc["init_image"].startswith("sha256:") and doc["end_image"] is None
    assert video_params.validate(video_params.from_mapping(video_params.attach(doc, inputs)))
    with pytest.raises(InvalidParameterError, match="init_image"):
        video_params.attach(doc, {})
    with pytest.raises(InvalidParameterError, match="unknown parameter"):
        video_params.from_mapping({"prompt": "x", "strength": 0.5})
    assert video_params.placement_size(doc) == (64, 64, 17, True)


def header(specs: dict[str, tuple[int, ...]], prefix: str = "") -> FileHeader:
    tensors = {prefix + n: TensorInfo("F16", s, 2 * int(np.prod(s))) for n, s in specs.items()}
    return FileHeader("gguf", tensors, 0, 0, 0)


def dit(layers: int = 30, **extra: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    specs = {n: shape for n, (shape, _kind) in dit_specs(layers).items()}
    return {**specs, **extra}


def test_the_runtime_s_wan_variants_are_read_from_the_header() -> None:
    t2v = describe(header(dit()), text_encoder=False)
    assert t2v is not None and (t2v.desc, t2v.layers) == ("Wan2.1-T2V-1.3B", 30)
    assert not t2v.init_image and not t2v.end_image and not t2v.text_encoder
    prefixed = describe(header(dit(), "model.diffusion_model."), True)
    assert prefixed is not None and prefixed.desc == "Wan2.1-T2V-1.3B"
    i2v = describe(header(dit(**{"img_emb.proj.1.weight": (1280, 1280)})), True)
    assert i2v is not None and i2v.desc == "Wan2.1-I2V-1.3B" and i2v.desc in CLIP_VISION_NEEDED
    ti2v = dit(**{"patch_embedding.weight": (3072, 48, 1, 2, 2)})
    found = describe(header(ti2v), True)
    assert found is not None and found.desc == "Wan2.2-TI2V-5B" and found.init_image
    i2v14 = dit(40, **{"patch_embedding.weight": (5120, 36, 1, 2, 2)})
    found = describe(header(i2v14), True)
    assert found is not None and found.desc == "Wan2.2-I2V-14B" and found.end_image
    flf = dit(40, **{"img_emb.emb_pos": (1, 514, 1280), "img_emb.proj.1.weight": (1280, 1280)})
    found = describe(header(flf), True)
    assert found is not None and found.desc == "Wan2.1-FLF2V-14B"
    t2v14 = describe(header(dit(40)), True)
    assert t2v14 is not None and t2v14.desc == "Wan2.x-T2V-14B"
    # an image model's diffusion model is no video model
    assert describe(header({"double_blocks.0.img_attn.qkv.weight": (384, 128)}), True) is None


def test_a_wan_layer_count_the_runtime_aborts_on_is_refused_from_the_header() -> None:
    check_header(header(dit(30)), "x")
    check_header(header(dit(40)), "x")
    check_header(header({"double_blocks.0.img_attn.qkv.weight": (384, 128)}), "x")  # not Wan
    for layers in (1, 29, 31, 39, 41):
        with pytest.raises(ModelLoadError, match=f"with {layers} layers") as err:
            check_header(header(dit(layers)), "diffusion_model file dit.gguf")
        assert "30 or 40" in str(err.value) and "dit.gguf" in str(err.value)
    # VACE blocks are not layers (the runtime counts them apart)
    vace = dit(30, **{f"vace_blocks.{i}.after_proj.weight": (1536, 1536) for i in range(15)})
    check_header(header(vace), "x")
    found = describe(header(vace), True)
    assert found is not None and found.desc == "Wan2.1-VACE-1.3B"


def test_input_images_are_refused_where_the_variant_does_not_read_them() -> None:
    png = _png()
    t2v = describe(header(dit()), text_encoder=False)
    assert t2v is not None
    t2v.refuse_images(ok())
    for name in ("init_image", "end_image"):
        with pytest.raises(InvalidParameterError, match="ignores it") as err:
            t2v.refuse_images(ok(**{name: png}))
        assert err.value.parameter == name and "Wan2.1-T2V-1.3B" in str(err.value)
    ti2v = describe(header(dit(**{"patch_embedding.weight": (3072, 48, 1, 2, 2)})), True)
    assert ti2v is not None
    ti2v.refuse_images(ok(init_image=png))
    with pytest.raises(InvalidParameterError, match="end_image"):
        ti2v.refuse_images(ok(end_image=png))
    i2v = describe(header(dit(**{"img_emb.proj.1.weight": (1280, 1280)})), True)
    assert i2v is not None
    with pytest.raises(InvalidParameterError, match="CLIP vision"):
        i2v.refuse_images(ok(init_image=png))


def _png(size: tuple[int, int] = (64, 64)) -> bytes:
    """A PNG of the frame size of `ok()` (an end image must be the frame size)."""
    from io import BytesIO

    from PIL import Image

    buf = BytesIO()
    Image.new("RGB", size, (9, 9, 9)).save(buf, "PNG")
    return buf.getvalue()


def test_an_end_image_must_be_the_frame_size() -> None:
    assert ok(end_image=_png()).end_image is not None
    err = refused(end_image=_png((64, 48)))
    assert err.parameter == "end_image"
    assert "is 64x48, the frames are 64x64" in str(err) and "last frame" in str(err)
    assert ok(init_image=_png((64, 48))).init_image is not None  # resized, as before


def test_the_high_noise_parameters_are_checked_and_need_a_pair() -> None:
    assert ok().moe_given == ()
    given = ok(high_noise_steps=2, moe_boundary=0.9, high_noise_cfg_scale=3.0)
    assert given.moe_given == ("high_noise_steps", "moe_boundary", "high_noise_cfg_scale")
    assert ok(high_noise_steps=0).moe_given == ("high_noise_steps",)  # low-noise expert only
    assert ok(high_noise_cfg_scale=-1).high_noise_cfg_scale == -1.0  # the same as cfg_scale
    for bad in (
        {"high_noise_steps": -2},
        {"moe_boundary": 1.5},
        {"moe_boundary": float("nan")},
        {"high_noise_cfg_scale": -0.5},
        {"high_noise_sampler": "nope"},
    ):
        assert refused(**bad).parameter == next(iter(bad))
    # A boundary of 0 never switches the high-noise expert on in the runtime: refused, unless
    # high_noise_steps says how many steps it runs (then the boundary is not read).
    assert "never switch" in str(refused(moe_boundary=0.0))
    assert ok(moe_boundary=0.0, high_noise_steps=2).moe_boundary == 0.0
    t2v = describe(header(dit()), text_encoder=False)
    assert t2v is not None and not t2v.moe
    t2v.check(ok())
    with pytest.raises(InvalidParameterError, match="without a high-noise expert") as err:
        t2v.check(ok(moe_boundary=0.9))
    assert err.value.parameter == "moe_boundary"
    replace(t2v, moe=True).check(given)


def test_a_high_noise_expert_is_checked_against_its_pair() -> None:
    low, high = header(dit()), header(dit())
    check_pair({"diffusion_model": (low, "a"), "high_noise_diffusion_model": (high, "b")}, "m")
    check_pair({"diffusion_model": (low, "a")}, "m")  # no pair: nothing to check
    flux = header({"double_blocks.0.img_attn.qkv.weight": (384, 128)})
    vace = header(dit(**{"vace_blocks.0.after_proj.weight": (1536, 1536)}))
    for main, other, match in (
        (low, flux, "not a Wan diffusion model"),
        (flux, high, "beside a Wan diffusion_model"),
        (low, vace, "same Wan variant"),
    ):
        with pytest.raises(ModelLoadError, match=match) as err:
            check_pair(
                {"diffusion_model": (main, "a.gguf"), "high_noise_diffusion_model": (other, "b")},
                "pair",
            )
        assert err.value.role == "high_noise_diffusion_model" and "model pair" in str(err.value)


def test_the_test_model_has_the_real_architecture_s_sizes() -> None:
    params = {n: int(np.prod(s)) for n, (s, _k) in dit_specs().items()}
    assert len([n for n in params if n.endswith(".modulation")]) == 31  # 30 blocks + head
    assert 1.41e9 < sum(params.values()) < 1.43e9  # Wan2.1 1.3B: 1.42 B parameters
    assert 126e6 < sum(int(np.prod(s)) for s in vae_specs().values()) < 128e6  # the Wan VAE
    kinds = {k for _s, k in dit_specs().values()}
    assert kinds == {"linear", "conv", "f32"}


def test_the_video_estimate_grows_with_frames_and_frame_size() -> None:
    facts = ModelFacts(1 << 30, (64, 64))
    base = facts.video_estimate(64, 64, 5)
    assert base > facts.resident()
    assert facts.video_estimate(64, 64, 9) > base
    assert facts.video_estimate(128, 128, 5) - facts.resident() > 3 * (base - facts.resident())
    assert facts.video_estimate(64, 64, 5, encodes=True) > base
    assert job_estimate(facts, 64, 64, frames=5) == base
    assert job_estimate(facts, 64, 64) == facts.estimate(64, 64)  # an image job: unchanged


def test_a_queued_video_job_is_shaped_by_its_frames() -> None:
    params, _ = video_params.detach(ok(frames=9))
    spec = {"model": "wan", "kind": "video", "params": params}
    job = _pending_job("v1", 5, ["queued", "wan", "me", "1.0", json.dumps(spec)])
    assert job is not None
    assert job.shape == ("wan", 64, 64, False, (), -9, None, "off", 1)
    size = {"encodes": False, "tile_size": job.tile_size, "extra_bytes": 0}
    assert _video_frames(size) == 9 and size["tile_size"] == 0
    facts = ModelFacts(1 << 30, (64, 64))
    assert job_estimate(facts, 64, 64, **size, frames=9) == facts.video_estimate(64, 64, 9)
    image = {"encodes": False, "tile_size": 0, "extra_bytes": 0}
    assert _video_frames(image) == 0  # a generation is not a video


def test_a_video_result_splits_into_frames_and_the_webp() -> None:
    meta = {"kind": "video", "webp_index": 2}
    result = Result("j", [b"png0", b"png1", b"RIFFwebp"], meta)
    assert result.frames == [b"png0", b"png1"] and result.webp == b"RIFFwebp"
    image = Result("j", [b"png0", b"png1"], {"seeds": [1, 2]})
    assert image.webp is None and image.frames == [b"png0", b"png1"]


def test_a_video_model_s_facts_say_so_through_the_heartbeat() -> None:
    facts = ModelFacts(1 << 30, (64, 64), 0, "Wan2.1-T2V-1.3B")
    assert ModelFacts.from_json(facts.as_json()) == facts
    image = ModelFacts(1 << 30, (64, 64))
    assert "video" not in image.as_json() and ModelFacts.from_json(image.as_json()) == image
    assert ModelFacts.cautious([facts, facts]).video == "Wan2.1-T2V-1.3B"
