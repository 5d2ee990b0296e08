"""The A1111 translation (sdfarm.gateway.a1111): names, bodies to jobs, refusals, infotext."""

from __future__ import annotations

import json

import pytest

from sdfarm.gateway import a1111
from sdfarm.native.errors import InvalidParameterError


@pytest.mark.parametrize(
    ("given", "ours"),
    [("Euler a", "euler_a"), ("k_euler_a", "euler_a"), ("euler_a", "euler_a"),
     ("DPM++ 2M", "dpm++2m"), ("dpm++2m", "dpm++2m"), ("DDIM", "ddim_trailing"),
     (None, "default"), ("", "default")],
)  # fmt: skip
def test_sampler_names(given: str | None, ours: str) -> None:
    assert a1111.sampler(given) == ours


@pytest.mark.parametrize(
    ("given", "ours"),
    [("Automatic", "default"), ("automatic", "default"), ("Karras", "karras"),
     ("SGM Uniform", "sgm_uniform"), ("sgm_uniform", "sgm_uniform"), (None, "default")],
)  # fmt: skip
def test_scheduler_names(given: str | None, ours: str) -> None:
    assert a1111.scheduler(given) == ours


def test_unknown_names_are_refused_by_field() -> None:
    with pytest.raises(InvalidParameterError) as e:
        a1111.sampler("Nope")
    assert e.value.parameter == "sampler_name" and "Euler a" in str(e.value)
    with pytest.raises(InvalidParameterError) as e:
        a1111.scheduler("Nope")
    assert e.value.parameter == "scheduler"


@pytest.mark.parametrize(
    ("title", "name"),
    [("tiny-f16", "tiny-f16"), ("tiny-f16 [abc123]", "tiny-f16"),
     ("sd-turbo.safetensors [0a1b]", "sd-turbo"), ("x.gguf", "x")],
)  # fmt: skip
def test_model_titles(title: str, name: str) -> None:
    assert a1111.model_name(title) == name


def test_lora_tags_leave_the_prompt() -> None:
    text, loras = a1111.split_loras("a cat <lora:style:0.6>, sunny <lora:detail>")
    assert text == "a cat, sunny"
    assert loras == [("style", 0.6), ("detail", 1.0)]


def test_txt2img_body_to_job() -> None:
    body = {"prompt": "a boat", "negative_prompt": "blur", "seed": 4, "steps": 3,
            "cfg_scale": 2.5, "width": 128, "height": 64, "batch_size": 2, "n_iter": 3,
            "sampler_name": "Euler", "scheduler": "Karras", "eta": 1.0, "s_noise": 1,
            "enable_hr": True, "hr_resize_x": 256, "hr_second_pass_steps": 2,
            "denoising_strength": 0.4}  # fmt: skip
    job = a1111.job_fields(body, img2img=False)
    assert job["batch_count"] == 6 and job["sampler"] == "euler"
    assert job["scheduler"] == "karras" and job["cfg_scale"] == 2.5
    assert job["hires_scale"] == 2.0 and job["hires_steps"] == 2
    assert job["hires_strength"] == 0.4


def test_img2img_body_to_job() -> None:
    job = a1111.job_fields({"init_images": ["AAAA"], "mask": "BBBB", "denoising_strength": 0.3},
                           img2img=True)  # fmt: skip
    assert job["init_image"] == "AAAA" and job["mask_image"] == "BBBB"
    assert job["strength"] == 0.3
    with pytest.raises(InvalidParameterError) as e:
        a1111.job_fields({"init_images": []}, img2img=True)
    assert e.value.parameter == "init_images"
    with pytest.raises(InvalidParameterError) as e:
        a1111.job_fields({"init_images": ["a", "b"]}, img2img=True)
    assert e.value.parameter == "init_images"


@pytest.mark.parametrize(
    ("field", "body"),
    [("restore_faces", {"restore_faces": True}), ("styles", {"styles": ["x"]}),
     ("subseed_strength", {"subseed_strength": 0.2}),
     ("hr_prompt", {"enable_hr": True, "hr_prompt": "other"})],
)  # fmt: skip
def test_what_cannot_be_done_is_refused(field: str, body: dict) -> None:
    with pytest.raises(InvalidParameterError) as e:
        a1111.job_fields({"prompt": "x", **body}, img2img=False)
    assert e.value.parameter == field


def test_defaults_are_not_refusals() -> None:
    body = {"prompt": "x", "restore_faces": False, "tiling": False, "styles": [],
            "alwayson_scripts": {"ADetailer": {"args": [False]}}, "hr_prompt": "",
            "hr_checkpoint_name": None, "subseed_strength": 0.0}  # fmt: skip
    assert a1111.job_fields(body, img2img=False)["prompt"] == "x"


def test_answer_info_is_a_json_string() -> None:
    meta = {"prompt": "p", "negative_prompt": "n", "seeds": [7, 8], "width": 64, "height": 64,
            "steps": 2, "sampler": "euler_a", "scheduler": "default", "cfg_scale": 1.0}  # fmt: skip
    doc = a1111.answer([b"png1", b"png2"], meta, "m", {"prompt": "p", "init_images": ["x"]})
    info = json.loads(doc["info"])
    assert info["all_seeds"] == [7, 8] and info["sd_model_name"] == "m"
    assert info["infotexts"][1].startswith("p\nNegative prompt: n\nSteps: 2, Sampler: Euler a")
    assert "Seed: 8" in info["infotexts"][1]
    assert "init_images" not in doc["parameters"]


def test_a_named_hires_upscaler_becomes_the_jobs_model_upscaler() -> None:
    body = {"prompt": "x", "enable_hr": True, "hr_upscaler": "tiny-esrgan-x2", "hr_scale": 2}
    assert a1111.job_fields(body, img2img=False)["hires_upscaler"] == "tiny-esrgan-x2"
    latent = {**body, "hr_upscaler": "Latent (bicubic)"}
    assert "hires_upscaler" not in a1111.job_fields(latent, img2img=False)
