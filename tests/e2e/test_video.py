"""Video on the real runtime, in-process, with the random-weight Wan2.1 T2V 1.3B test model:
the frames are as many and as large as asked and the animated WebP holds them all; the same
seed gives the same pixels in another process, another seed other pixels, and with the VACE
variant another init image other pixels; the prompt does
nothing without a text encoder (the result says so); and everything the runtime would abort
on or silently change is refused before any native call, the engine usable after."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from sdfarm.native.engine import Engine
from sdfarm.native.errors import InvalidParameterError, ModelLoadError
from sdfarm.native.video import NO_PROMPT_WARNING
from sdfarm.native.video_params import VideoParams

from helpers.videomodels import digest, digest_in_child, fake_wan

pytestmark = pytest.mark.e2e

SMALL = {"width": 48, "height": 32, "frames": 5, "steps": 1, "cfg_scale": 1.0}


@pytest.fixture(scope="module")
def engine(wan_model: Path) -> Iterator[Engine]:
    with Engine.load(wan_model, device="cpu", threads=2) as e:
        yield e


@pytest.fixture(scope="module")
def first(engine: Engine) -> Any:
    return engine.video(prompt="a cat", seed=42, **SMALL)


def test_frames_and_webp_are_as_asked(first: Any) -> None:
    assert len(first.frames) == 5
    assert all(f.size == (48, 32) and f.mode == "RGB" for f in first.frames)
    assert len({f.tobytes() for f in first.frames}) > 1  # frames differ from each other
    webp = Image.open(io.BytesIO(first.webp))
    assert webp.format == "WEBP" and webp.n_frames == 5 and webp.size == (48, 32)
    webp.seek(2)
    assert webp.convert("RGB").tobytes() == first.frames[2].tobytes()  # lossless
    meta = first.metadata
    assert meta["kind"] == "video" and meta["video_model"] == "Wan2.1-T2V-1.3B"
    assert meta["frames"] == 5 and meta["seed"] == 42 and meta["webp_index"] == 5
    assert NO_PROMPT_WARNING in meta["warnings"]


def test_the_same_seed_gives_the_same_frames_in_another_process(
    engine: Engine, first: Any, wan_model: Path
) -> None:
    assert digest_in_child(wan_model, {"prompt": "a cat", "seed": 42, **SMALL}) == digest(
        first.frames
    )
    other = engine.video(prompt="a cat", seed=43, **SMALL)
    assert digest(other.frames) != digest(first.frames)
    # without a text encoder the runtime conditions on nothing: the prompt changes nothing
    dog = engine.video(prompt="a dog", seed=42, **SMALL)
    assert digest(dog.frames) == digest(first.frames)


def test_bad_input_is_refused_before_any_native_call(engine: Engine) -> None:
    png = io.BytesIO()
    Image.new("RGB", (48, 32), (200, 10, 10)).save(png, "PNG")
    calls = engine.native_calls
    cases = {
        "frames": {"frames": 4},  # the runtime would make 1
        "width": {"width": 40},  # the runtime would align it up to 48
        "init_image": {"init_image": png.getvalue()},  # T2V ignores it
        "end_image": {"end_image": png.getvalue()},
    }
    for name, change in cases.items():
        with pytest.raises(InvalidParameterError) as err:
            engine.video(VideoParams(**{"prompt": "x", "seed": 1, **SMALL, **change}))
        assert err.value.parameter == name, err.value
    with pytest.raises(InvalidParameterError) as err:
        engine.video(prompt="x", **{**SMALL, "frames": 165})
    assert err.value.parameter == "frames"
    with pytest.raises(InvalidParameterError, match="is a video model") as err:
        engine.generate(prompt="x", width=64, height=64, steps=1)
    assert err.value.parameter == "model"
    assert engine.native_calls == calls  # nothing reached the runtime
    assert engine.poisoned is None


def test_an_image_model_is_no_video_model(tiny_models: list[Path]) -> None:
    with Engine.load(tiny_models[0], device="cpu") as tiny:
        calls = tiny.native_calls
        with pytest.raises(InvalidParameterError, match="not a video model") as err:
            tiny.video(prompt="x", width=64, height=64, frames=5, steps=1)
        assert err.value.parameter == "model" and tiny.native_calls == calls


def test_a_wan_layer_count_the_runtime_aborts_on_never_loads(tmp_path: Path) -> None:
    bad = fake_wan(tmp_path / "wan-31", 31)
    with pytest.raises(ModelLoadError, match="31 layers"):
        Engine.load(bad, device="cpu")  # the runtime would GGML_ABORT: this process lives on
    # 30 layers pass our check; the runtime then refuses the wrong shapes itself, without
    # aborting (only the layer count ends the process)
    shapes = fake_wan(tmp_path / "wan-30", 30)
    with pytest.raises(ModelLoadError, match="has wrong shape in model file"):
        Engine.load(shapes, device="cpu")


def test_an_init_image_steers_a_vace_model(vace_model: Path) -> None:
    def png(seed: int) -> bytes:
        import numpy as np

        buf = io.BytesIO()
        pixels = np.random.default_rng(seed).integers(0, 255, (32, 48, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, "PNG")
        return buf.getvalue()

    with Engine.load(vace_model, device="cpu", threads=2) as vace:
        a = vace.video(prompt="x", seed=3, init_image=png(1), **SMALL)
        assert a.metadata["video_model"] == "Wan2.1-VACE-1.3B"
        assert len(a.frames) == 5 and a.frames[0].size == (48, 32)  # the reference frame is cut
        b = vace.video(prompt="x", seed=3, init_image=png(2), **SMALL)
        assert digest(a.frames) != digest(b.frames)  # the same seed: the image made the change
        calls = vace.native_calls
        with pytest.raises(InvalidParameterError, match="takes no end_image") as err:
            vace.video(prompt="x", seed=3, end_image=png(1), **SMALL)
        assert err.value.parameter == "end_image" and vace.native_calls == calls
