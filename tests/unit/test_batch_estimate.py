"""A job's images sampled together (native/patches/batch_sample.hpp) grow its estimate by the
UNet's working memory for every latent beyond the first, wherever the estimate is made: the
model's facts, the heartbeat that carries them and the scheduler's shape of a queued job."""

from __future__ import annotations

import json

import pytest

from sdfarm.native.estimate import BATCH_BYTES_PER_PIXEL, ModelFacts, job_estimate
from sdfarm.scheduler.dispatch import _pending_job

UNET = ModelFacts(1 << 30, (512, 512), decode_per_pixel=100, size_multiple=64,
                  batch_per_pixel=BATCH_BYTES_PER_PIXEL)  # fmt: skip
DIT = ModelFacts(1 << 30, (512, 512), decode_per_pixel=100)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize(("width", "height"), [(512, 512), (1024, 768)])
def test_every_image_beyond_the_first_adds_the_unets_latent_working_memory(
    width: int, height: int, tiled: bool
) -> None:
    one = UNET.estimate(width, height, tiled=tiled)
    assert UNET.estimate(width, height, tiled=tiled, batch=1) == one
    for batch in (2, 4, 8):
        grown = UNET.estimate(width, height, tiled=tiled, batch=batch)
        assert grown - one == (batch - 1) * width * height * BATCH_BYTES_PER_PIXEL


def test_a_model_that_samples_one_by_one_is_estimated_as_one_image() -> None:
    assert DIT.estimate(512, 512, batch=4) == DIT.estimate(512, 512)


def test_the_term_travels_in_the_heartbeat_and_the_cautious_facts_keep_it() -> None:
    doc = UNET.as_json()
    assert doc["batch_per_pixel"] == BATCH_BYTES_PER_PIXEL
    assert ModelFacts.from_json(json.loads(json.dumps(doc))) == UNET
    assert "batch_per_pixel" not in DIT.as_json()
    assert ModelFacts.cautious([DIT, UNET]).batch_per_pixel == BATCH_BYTES_PER_PIXEL


def test_a_queued_jobs_images_are_in_its_shape_and_its_estimate() -> None:
    params = {"prompt": "x", "width": 512, "height": 512, "batch_count": 4}
    spec = {"model": "sd", "params": params}
    job = _pending_job("j1", 5, ["queued", "sd", "me", "1.0", json.dumps(spec)])
    assert job is not None and job.batch == 4 and job.shape[-1] == 4
    single = _pending_job(
        "j2",
        5,
        ["queued", "sd", "me", "1.0", json.dumps({"model": "sd", "params": {"prompt": "x"}})],
    )
    assert single is not None and single.batch == 1 and single.shape != job.shape
    size = {"encodes": False, "tile_size": 0, "extra_bytes": 0}
    assert (
        job_estimate(UNET, 512, 512, **size, batch=job.batch)
        == UNET.estimate(512, 512, batch=4)
        > job_estimate(UNET, 512, 512, **size)
    )
