"""A job's images sampled together (native/patches/batch_sample.hpp), with the real runtime on
the CPU: the random-weight SD 1.x model (`sd1_dir`), whose UNet takes a batch, and the tiny
Ovis model, a DiT, which samples one by one. Each image must be the image of its own seed made
alone, whichever way the job went."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from sdfarm.native.engine import Engine, LogConfig
from sdfarm.native.params import GenerationParams

TOGETHER = "sampling 3 images together - seeds 11..13"
SMALL = {"width": 64, "height": 64, "steps": 2}


@pytest.fixture(scope="module")
def sd1(sd1_dir: Path):
    e = Engine.load(sd1_dir / "sd1-tiny", threads=2, log=LogConfig(level="info"))
    yield e
    e.dispose()


def make(engine: Engine, batch: int, seed: int = 11, **kw):
    result = engine.generate(
        GenerationParams(prompt="a red boat", seed=seed, batch_count=batch, **{**SMALL, **kw})
    )
    return [im.tobytes() for im in result.images], [r.message for r in result.records]


def alone(engine: Engine, seeds: range, **kw) -> list[bytes]:
    return [make(engine, 1, seed=s, **kw)[0][0] for s in seeds]


@pytest.mark.parametrize("sampler", ["default", "euler"])
def test_a_jobs_images_go_through_the_unet_together_as_the_images_of_their_seeds(sd1, sampler):
    # The default sampler of SD 1.x is euler_a: every step draws noise, which each image must
    # draw from its own seed's generator as it does alone.
    images, logs = make(sd1, 3, sampler=sampler)
    assert any(TOGETHER in m for m in logs)
    assert len(images) == 3 and len(set(images)) == 3
    assert images == alone(sd1, range(11, 14), sampler=sampler)


def test_the_switch_off_samples_one_by_one_and_changes_no_image(sd1, monkeypatch):
    together, _ = make(sd1, 3)
    monkeypatch.setenv("SDFARM_BATCH_SAMPLING", "0")
    images, logs = make(sd1, 3)
    assert not any("together" in m for m in logs)
    assert images == together


def test_an_image_to_image_batch_is_sampled_one_by_one(sd1):
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(buf, format="PNG")
    kw = {"init_image": buf.getvalue(), "strength": 0.6}
    images, logs = make(sd1, 3, **kw)
    assert not any("together" in m for m in logs)
    assert len(images) == 3
    assert images == alone(sd1, range(11, 14), **kw)


def test_a_dit_model_samples_one_by_one(tiny_models):
    with Engine.load(tiny_models[0], log=LogConfig(level="info")) as e:
        images, logs = make(e, 2)
        assert not any("together" in m for m in logs)
        assert images == alone(e, range(11, 13))
