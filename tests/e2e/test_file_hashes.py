"""Every image says which model and LoRA files made it: the real runtime with the tiny model
and its test LoRA writes A1111's `Model hash` and `Lora hashes` into the PNG's `parameters`
chunk (and our JSON chunk), each equal to a hash computed here with hashlib alone, and
sd-parsers reads the model hash back. The files are hashed once, not per job."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
from PIL import Image
from sd_parsers import ParserManager

from sdfarm.native.engine import Engine
from sdfarm.native.filehash import default_cache
from sdfarm.native.loras import LoraCatalog, lora_dirs
from sdfarm.native.params import GenerationParams
from sdfarm.native.png import png_bytes, read_params
from sdfarm.native.testmodel import TEST_LORA

pytestmark = pytest.mark.e2e

SMALL = {"width": 64, "height": 64, "steps": 1, "seed": 7}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def engine(tiny_models: list[Path]):
    e = Engine.load(tiny_models[0])
    yield e
    e.dispose()


def test_the_png_names_the_model_and_lora_files_by_a1111s_hashes(
    engine: Engine, tiny_models: list[Path]
) -> None:
    diffusion = tiny_models[0] / "dit.safetensors"  # the diffusion_model role (model.json)
    lora_file = tiny_models[0].parent / "loras" / f"{TEST_LORA}.safetensors"
    raw = lora_file.read_bytes()
    tensors = raw[8 + int.from_bytes(raw[:8], "little") :]  # addnet: after the header
    want_model, want_lora = _sha256(diffusion.read_bytes())[:10], _sha256(tensors)[:12]

    loras = {TEST_LORA: LoraCatalog(lora_dirs([tiny_models[0].parent])).load(TEST_LORA)}
    r = engine.generate(GenerationParams(prompt="a fox", loras=[(TEST_LORA, 0.8)], **SMALL),
                        loras=loras)  # fmt: skip
    data = png_bytes(r.image, {**r.metadata, "seed": r.metadata["seeds"][0]})
    with Image.open(io.BytesIO(data)) as im:
        text = im.text["parameters"]
    assert f"Model hash: {want_model}, Model: tiny-f16," in text
    assert f'Lora hashes: "{TEST_LORA}: {want_lora}"' in text
    assert str(tiny_models[0].parent) not in text and str(tiny_models[0].parent) not in str(
        read_params(data)
    )
    chunk = read_params(data)
    assert chunk["model_hash"] == want_model and chunk["lora_hashes"] == {TEST_LORA: want_lora}

    info = ParserManager().parse(io.BytesIO(data))
    assert info is not None and info.generator.name == "AUTOMATIC1111"
    model = info.samplers[0].model
    assert model is not None and model.hash == want_model and model.name == "tiny-f16"


def test_a_plain_job_carries_the_model_hash_and_no_lora_hashes(engine: Engine) -> None:
    r = engine.generate(GenerationParams(prompt="a fox", **SMALL))
    assert r.metadata["model_hash"] == engine.model_hash and "lora_hashes" not in r.metadata
    with Image.open(io.BytesIO(png_bytes(r.image, r.metadata))) as im:
        assert f"Model hash: {engine.model_hash}," in im.text["parameters"]
        assert "Lora hashes" not in im.text["parameters"]


def test_a_file_is_hashed_once_not_per_job_or_per_load(
    engine: Engine, tiny_models: list[Path]
) -> None:
    cache = default_cache()
    before = cache.computed
    for seed in (1, 2):
        engine.generate(GenerationParams(prompt="x", **{**SMALL, "seed": seed}))
    with Engine.load(tiny_models[0]) as again:  # an engine reloaded, or a second slot
        assert again.model_hash == engine.model_hash
    assert cache.computed == before
