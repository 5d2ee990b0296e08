"""The A1111 infotext (sdfarm.native.infotext): its exact text, the PNG's `parameters` chunk
that carries it, and a third-party reader (sd-parsers) recognising our PNGs by it."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from PIL import Image
from sd_parsers import ParserManager

from sdfarm.gateway import a1111
from sdfarm.native.infotext import infotext
from sdfarm.native.params import GenerationParams
from sdfarm.native.png import PARAM_KEYS, png_bytes, read_params

INIT = Image.new("RGB", (64, 64), "gray")


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def job(**kwargs: Any) -> dict[str, Any]:
    """What png_bytes is given for one image: the job's parameters (init image by digest)
    plus the engine's model and runtime version, as the engine's metadata holds them."""
    fields = {"prompt": "a red fox", "steps": 4, "seed": 42, "width": 512, "height": 512,
              "sampler": "euler_a", "scheduler": "karras", **kwargs}  # fmt: skip
    return {**GenerationParams(**fields).as_dict(), "model": "tiny-sd", "sd_version": "m-596"}


SETTINGS = "Steps: 4, Sampler: Euler a, Schedule type: Karras, CFG scale: 1.0, Seed: 42, Size: 512x512, Model: tiny-sd"  # noqa: E501


def test_txt2img_without_a_negative_prompt_has_no_negative_line() -> None:
    assert infotext(job()) == f"a red fox\n{SETTINGS}, Version: sdfarm"


def test_txt2img_with_a_negative_prompt() -> None:
    text = infotext(job(negative_prompt="blurry, low quality"))
    assert text == f"a red fox\nNegative prompt: blurry, low quality\n{SETTINGS}, Version: sdfarm"


def test_img2img_writes_its_denoising_strength() -> None:
    text = infotext(job(init_image=_png(INIT), strength=0.6))
    assert text == f"a red fox\n{SETTINGS}, Denoising strength: 0.6, Version: sdfarm"


def test_txt2img_writes_no_denoising_strength_even_off_its_default() -> None:
    assert "Denoising" not in infotext(job(strength=0.3))


def test_loras_go_into_the_prompt_as_tags_and_hashes_only_when_known() -> None:
    params = job(loras=(("detail", 0.8), ("style:v2", 1.0)))
    assert infotext(params) == (
        f"a red fox <lora:detail:0.8> <lora:style:v2:1>\n{SETTINGS}, Version: sdfarm"
    )
    hashed = {**params, "lora_hashes": {"detail": "0123456789ab", "style:v2": "ba9876543210"}}
    assert infotext(hashed) == (
        f"a red fox <lora:detail:0.8> <lora:style:v2:1>\n{SETTINGS}, "
        'Lora hashes: "detail: 0123456789ab, stylev2: ba9876543210", Version: sdfarm'
    )


def test_hires_fields_and_model_hash_and_clip_skip_in_a1111_order() -> None:
    params = {**job(hires_scale=1.5, hires_steps=3, hires_strength=0.5, clip_skip=2),
              "model_hash": "abcdef0123"}  # fmt: skip
    assert infotext(params) == (
        "a red fox\nSteps: 4, Sampler: Euler a, Schedule type: Karras, CFG scale: 1.0, "
        "Seed: 42, Size: 512x512, Model hash: abcdef0123, Model: tiny-sd, "
        "Denoising strength: 0.5, Clip skip: 2, Hires upscale: 1.5, Hires steps: 3, "
        "Hires upscaler: Latent, Version: sdfarm"
    )


def test_the_runtimes_default_sampler_and_schedule_are_automatic() -> None:
    text = infotext(job(sampler="default", scheduler="default", cfg_scale=7))
    assert "Sampler: Automatic, Schedule type: Automatic, CFG scale: 7.0," in text


def test_the_gateway_answers_the_same_text_the_png_carries() -> None:
    meta = {**job(negative_prompt="n"), "seeds": [42, 43]}
    info = json.loads(a1111.answer([b"1", b"2"], meta, "tiny-sd", {})["info"])
    assert info["infotexts"] == [infotext(meta, seed=s) for s in (42, 43)]
    png = png_bytes(Image.new("RGB", (8, 8)), {**meta, "seed": 43})
    with Image.open(io.BytesIO(png)) as im:
        assert im.text["parameters"] == info["infotexts"][1]


def test_the_png_keeps_the_sdfarm_json_chunk_beside_it_and_its_bytes_are_stable() -> None:
    params = {**job(negative_prompt="n"), "timings": {"generate_s": 1.0}, "host": "w1"}
    image = Image.new("RGB", (16, 16), "teal")
    data = png_bytes(image, params)
    assert data == png_bytes(image, {**params, "timings": {"generate_s": 2.0}, "host": "w2"})
    with Image.open(io.BytesIO(data)) as im:
        kept = {k: params[k] for k in PARAM_KEYS if k in params}
        assert im.text["sdfarm"] == json.dumps(kept, sort_keys=True)
        assert im.text["parameters"] == infotext(params)
    assert read_params(data) == kept


def test_a_non_latin1_prompt_goes_into_an_itxt_chunk() -> None:
    data = png_bytes(Image.new("RGB", (8, 8)), job(prompt="狐, 雪"))
    assert b"iTXtparameters" in data
    with Image.open(io.BytesIO(data)) as im:
        assert im.text["parameters"].startswith("狐, 雪\nSteps: 4,")


@pytest.mark.parametrize("negative", ["", "blurry, low quality"])
def test_sd_parsers_recognises_our_png(negative: str) -> None:
    """The third-party reader takes prompt, negative prompt, seed, steps, sampler, size and
    model from the PNG png_bytes writes (its A1111 parser reads the `parameters` chunk)."""
    params = job(prompt="a red fox, in the snow", negative_prompt=negative, seed=1234,
                 steps=6, width=320, height=192, sampler="dpm++2m", cfg_scale=2.5)  # fmt: skip
    data = png_bytes(Image.new("RGB", (320, 192), "white"), params)
    info = ParserManager().parse(io.BytesIO(data))
    assert info is not None and info.generator.name == "AUTOMATIC1111"
    (sampler,) = info.samplers
    assert [p.value for p in info.prompts] == ["a red fox, in the snow"]
    assert [p.value for p in info.negative_prompts] == ([negative] if negative else [])
    assert sampler.name == "DPM++ 2M"
    assert sampler.parameters["seed"] == "1234" and sampler.parameters["steps"] == "6"
    assert sampler.parameters["cfg_scale"] == "2.5"
    assert sampler.parameters["scheduler"] == "Karras"
    assert info.metadata["Size"] == "320x192"
    assert sampler.model is not None and sampler.model.name == "tiny-sd"


def test_sd_parsers_reads_an_img2img_png_with_loras() -> None:
    params = job(init_image=_png(INIT), strength=0.6, loras=(("detail", 0.8),))
    info = ParserManager().parse(io.BytesIO(png_bytes(INIT, params)))
    assert info is not None
    assert [p.value for p in info.prompts] == ["a red fox <lora:detail:0.8>"]
    assert info.metadata["Denoising strength"] == "0.6"
    assert info.samplers[0].parameters["seed"] == "42"
