"""LoRAs on a real farm with the tiny model and its test LoRA (`loras/tiny-lora`): a LoRA
changes the image, the same job gives the same bytes whatever ran before it on the engine
(LoRAs are applied at run time, never merged into the weights), the job's estimate counts the
LoRA's file, no log record names its path, and a LoRA no worker has is refused at submit."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from sdfarm.client.farm import Farm
from sdfarm.native.engine import Engine
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.filehash import lora_hash, model_hash
from sdfarm.native.loras import LoraCatalog, lora_dirs
from sdfarm.native.png import read_params
from sdfarm.native.testmodel import TEST_LORA

from helpers.gateway import cpu_farm

pytestmark = pytest.mark.e2e

MODEL = "tiny-f16"
SMALL = {"width": 64, "height": 64, "steps": 2, "seed": 21}


@pytest.fixture(scope="module")
def farm(models_dir: Path) -> Iterator[Any]:
    with cpu_farm(models_dir, "lorahost") as f:
        yield f


@pytest.fixture
def client(farm: Any) -> Iterator[Farm]:
    with Farm(farm.url, submitter="lora-tests") as f:
        yield f


def test_a_lora_changes_the_image_and_leaves_no_trace(client: Farm) -> None:
    def png(**extra: Any) -> bytes:
        return client.submit(MODEL, "a lora test", **SMALL, **extra).result(60).png

    plain = png()
    styled = png(loras=[f"{TEST_LORA}:1.0"])
    weaker = png(loras=[f"{TEST_LORA}:0.3"])
    assert len({plain, styled, weaker}) == 3  # the LoRA and its weight count
    assert png(loras=[f"{TEST_LORA}:1.0"]) == styled  # the same job, the same bytes
    assert png() == plain  # after LoRA jobs the engine's weights are as they were
    models = client.models()
    assert [m["name"] for m in models] == ["tiny-f16", "tiny-q8_0"]  # loras/ is not a model


def test_the_farms_png_names_the_model_and_lora_by_hash(client: Farm, models_dir: Path) -> None:
    """The worker's PNG carries the engine's hashes (tests/e2e/test_file_hashes.py checks them
    against hashlib): A1111's Model hash and Lora hashes in `parameters`, both in our chunk."""
    data = client.submit(MODEL, "a lora test", **SMALL, loras=[f"{TEST_LORA}:1.0"]).result(60).png
    chunk = read_params(data)
    lora = LoraCatalog(lora_dirs([models_dir])).load(TEST_LORA)
    assert chunk["lora_hashes"] == {TEST_LORA: lora_hash(lora.path)}
    assert chunk["model_hash"] == model_hash(models_dir / MODEL / "dit.safetensors")
    with Image.open(io.BytesIO(data)) as im:
        text = im.text["parameters"]
    assert f"Model hash: {chunk['model_hash']}, Model: {MODEL}," in text
    assert f'Lora hashes: "{TEST_LORA}: {chunk["lora_hashes"][TEST_LORA]}"' in text


def test_the_estimate_counts_the_lora_and_its_path_stays_out_of_the_logs(
    client: Farm, models_dir: Path
) -> None:
    job = client.submit(MODEL, "a lora test", log_level="debug", loras=[TEST_LORA], **SMALL)
    result = job.result(60)
    lora = LoraCatalog(lora_dirs([models_dir])).load(TEST_LORA)
    with Engine.load(models_dir / MODEL, threads=1) as engine:
        plain = engine.estimate_for(64, 64)
        assert int(job.record()["estimate"]) == engine.estimate_for(64, 64, False, lora.size)
    assert int(job.record()["estimate"]) > plain
    text = "\n".join(r["message"] for r in result.records)
    assert "<lora tiny-lora file>" in text and str(lora.path) not in text
    assert str(models_dir) not in text


def test_a_lora_no_worker_has_is_refused_before_anything_is_queued(client: Farm) -> None:
    before = sum(client.store.count_by_state().values())
    with pytest.raises(InvalidParameterError) as err:
        client.submit(MODEL, "x", loras=["no-such-lora"], **SMALL)
    assert err.value.parameter == "loras"
    assert "unknown LoRA 'no-such-lora'; the farm has tiny-lora" in str(err.value)
    assert sum(client.store.count_by_state().values()) == before
