"""Previews on the real runtime with the tiny model: the shim's slot (downscale, overwrite and
ignore counters), the engine's previews every N steps (TAE, the tiny model's decoder, and the
latent projection), and a job's `preview` events through a real local farm."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sdfarm.client.farm import Farm
from sdfarm.native.binding import load
from sdfarm.native.engine import Engine
from sdfarm.native.params import GenerationParams
from sdfarm.native.preview import MAX_PREVIEW_BYTES, PREVIEW_SIDE, Preview, PreviewSlot

from helpers.gateway import cpu_farm

pytestmark = pytest.mark.e2e

MODEL = "tiny-f16"
JOB = {"prompt": "a preview of a lighthouse", "width": 128, "height": 128, "seed": 7}
SMALL = {**JOB, "width": 64, "height": 64}  # in-process: every TAE preview is a decode


def expected_frame(step: int, w: int, h: int, dw: int, dh: int) -> np.ndarray:
    """The shim's test frame of `step` box-averaged to dw x dh, as the shim computes it."""
    y, x = np.mgrid[0:h, 0:w]
    src = ((x + y + step) % 256).astype(np.int64)
    out = np.zeros((dh, dw), dtype=np.int64)
    for j in range(dh):
        y0, y1 = j * h // dh, max((j + 1) * h // dh, j * h // dh + 1)
        for i in range(dw):
            x0, x1 = i * w // dw, max((i + 1) * w // dw, i * w // dw + 1)
            block = src[y0:y1, x0:x1]
            out[j, i] = (block.sum() + block.size // 2) // block.size
    return out


@pytest.fixture
def slot() -> Iterator[PreviewSlot]:
    s = PreviewSlot(*load())
    yield s
    s.configure("none", 0)


def test_the_slot_keeps_the_newest_frame_downscaled_and_counts_what_it_lost(slot) -> None:
    slot.configure("tae", 2)
    slot.test_frames(5, 600, 300)  # steps 1..5: 2 and 4 wanted, 2 overwritten by 4
    seq, step, steps, w, h, rgb, overwritten = slot.take_raw()
    assert (seq, step, w, h) == (2, 4, PREVIEW_SIDE, PREVIEW_SIDE // 2)
    assert overwritten == 1 and slot.overwritten == 1
    assert slot.ignored == 3  # steps 1, 3 and 5
    pixels = np.frombuffer(rgb, np.uint8).reshape(h, w, 3).astype(np.int64)
    want = expected_frame(4, 600, 300, w, h)
    for c in range(3):
        assert (pixels[:, :, c] == want).all()
    assert slot.take_raw() is None  # nothing new since
    slot.test_frames(2, 8, 8)  # step 1 ignored, step 2 stored
    assert slot.take_raw()[:2] == (3, 2) and slot.ignored == 4


@pytest.mark.parametrize("channels", [1, 4])
def test_a_frame_of_one_or_four_channels_becomes_rgb(slot, channels: int) -> None:
    slot.configure("proj", 1)
    slot.test_frames(1, 40, 24, channels)
    seq, step, _, w, h, rgb, overwritten = slot.take_raw()
    assert (seq, step, w, h, overwritten) == (1, 1, 40, 24, 0)  # small frames stay as they are
    pixels = np.frombuffer(rgb, np.uint8).reshape(h, w, 3)
    y, x = np.mgrid[0:24, 0:40]
    for c in range(3):
        assert (pixels[:, :, c] == (x + y + 1) % 256).all()


def test_previews_off_deliver_nothing(slot) -> None:
    slot.configure("tae", 0)
    slot.test_frames(3, 16, 16)
    assert slot.take_raw() is None and slot.config() == ("none", 0)


@pytest.fixture(scope="module")
def engine(tiny_models: list[Path]) -> Iterator[Engine]:
    with Engine.load(tiny_models[0], threads=2) as e:
        yield e


def run(engine: Engine, **params: Any) -> tuple[list[Preview], bytes]:
    got: list[Preview] = []
    result = engine.generate(GenerationParams(**SMALL, **params), preview=got.append)
    return got, result.image.tobytes()


def test_every_step_gives_bounded_decodable_previews_in_order(engine) -> None:
    assert engine.preview_mode == "tae"  # the tiny model's decoder is a TAESD
    previews, image = run(engine, steps=4, preview_every=1)
    assert engine.last_call["preview_every"] == 1 and engine.last_call["preview_mode"] == "tae"
    steps = [p.step for p in previews]
    assert steps == sorted(set(steps)) and steps[-1] == 4
    # every frame the runtime made was either handed over or counted as overwritten
    assert len(previews) + sum(p.overwritten for p in previews) == 4
    for p in previews:
        assert p.steps == 4 and p.format == "webp" and len(p.data) <= MAX_PREVIEW_BYTES
        img = p.image
        assert img.format == "WEBP" and img.size == (p.width, p.height)
        assert max(img.size) <= PREVIEW_SIDE
    _, plain = run(engine, steps=4)
    assert image == plain  # previews do not change the image


def test_every_second_step_never_decodes_the_others(engine) -> None:
    previews, _ = run(engine, steps=4, preview_every=2)
    assert [p.step for p in previews] == [2, 4]
    # the shim turned the runtime's preview off for steps 1 and 3: it never called back
    assert engine._previews.ignored == 0


def test_no_preview_every_no_previews(engine) -> None:
    previews, _ = run(engine, steps=2)
    assert previews == [] and engine.last_call["preview_every"] == 0


def test_a_caller_without_a_preview_callback_pays_for_no_previews(engine) -> None:
    engine.generate(GenerationParams(**SMALL, steps=2, preview_every=1))
    assert engine.last_call["preview_every"] == 0 and engine.last_call["preview_mode"] == "none"


def test_latent_projection_previews_are_latent_sized(engine) -> None:
    engine.preview_mode = "proj"  # what a model without a TAESD gets
    try:
        previews, _ = run(engine, steps=3, preview_every=1)
    finally:
        engine.preview_mode = "tae"
    assert previews and previews[-1].step == 3
    assert {(p.width, p.height) for p in previews} == {(8, 8)}  # 64 / 8: the latent


# -- through a real local farm ---------------------------------------------------------------


@pytest.fixture(scope="module")
def farm(models_dir: Path) -> Iterator[Farm]:
    with cpu_farm(models_dir, "previewhost") as local, Farm(local.url) as f:
        yield f


def watch(job: Any, timeout: float = 120.0) -> tuple[dict[int, dict[str, Any]], list[Any]]:
    """Every preview event seen while the job ran (polled every 20 ms, by seq) and the
    Job.preview() answers seen meanwhile."""
    seen: dict[int, dict[str, Any]] = {}
    latest: list[Any] = []
    deadline = time.monotonic() + timeout
    while not job.done():
        assert time.monotonic() < deadline, "the job did not end"
        for ev in job.events():
            if ev["event"] == "preview":
                seen[ev["seq"]] = ev
        p = job.preview()
        if p is not None:
            latest.append(p)
        time.sleep(0.02)
    return seen, latest


def test_a_farm_job_publishes_previews_as_events(farm: Farm) -> None:
    farm.submit(MODEL, **{**JOB, "steps": 1}).result(120)  # the model loaded
    job = farm.submit(MODEL, **JOB, steps=8, preview_every=1)
    seen, latest = watch(job)
    result = job.result(10)
    assert len(seen) >= 2, seen.keys()
    ordered = [seen[k] for k in sorted(seen)]
    assert [e["step"] for e in ordered] == sorted({e["step"] for e in ordered})
    for ev in ordered:
        p = Preview.from_event(ev)
        assert p.steps == 8 and 1 <= p.step <= 8 and len(p.data) <= MAX_PREVIEW_BYTES
        assert max(p.image.size) <= PREVIEW_SIDE
        assert len(ev["image"]) <= MAX_PREVIEW_BYTES * 4 // 3 + 4  # base64
    assert latest and all(isinstance(p, Preview) for p in latest)
    events = job.events()
    assert sum(e["event"] == "preview" for e in events) == 1  # only the newest stays
    assert [e["event"] for e in events][:3] == ["queued", "placed", "running"]
    assert job.preview() is None  # the result superseded it
    assert result.metadata["preview_every"] == 1


def test_a_farm_job_without_previews_has_none(farm: Farm) -> None:
    job = farm.submit(MODEL, **JOB, steps=3)
    seen, latest = watch(job)
    job.result(10)
    assert seen == {} and latest == []
    assert not any(e["event"] == "preview" for e in job.events())
