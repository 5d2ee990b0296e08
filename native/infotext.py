"""A job's parameters as AUTOMATIC1111's infotext: the one text image tools read.

A1111 writes it into every PNG (the `parameters` text chunk) and answers it in its API's
`info.infotexts`; image viewers, galleries, Civitai and readers such as the `sd-parsers`
package recognise an image by it and take prompt, seed, steps, sampler and size from it. They
parse it by position and spelling, so a near miss (a `Negative prompt:` line that is empty, our
own parameter names) is an unrecognised image. Both our doors that carry it, the PNG
(sdfarm.native.png) and the A1111 API (sdfarm.gateway.a1111), build it here, so they cannot
drift apart.

The format, as A1111's `create_infotext` (modules/processing.py of v1.10) writes it::

    PROMPT
    Negative prompt: NEGATIVE            <- only when there is one
    Steps: 4, Sampler: Euler a, Schedule type: Karras, CFG scale: 1.0, Seed: 42, ...

The settings are A1111's, in its order and spelling, each only when it applies (a value that
holds a comma, a colon or a newline is JSON-quoted, as A1111's `quote` does). The LoRAs a job
used go back into the prompt as `<lora:name:weight>` tags, as A1111's prompt holds them, so
pasting the text into A1111 asks for the same LoRAs; `Lora hashes` lists a short hash of each
file only where the parameters carry one (`lora_hashes`, name -> hash), and `Model hash` the
same (`model_hash`). Only what made the image goes in, never timings or hosts, so the same
parameters give the same text, and the same PNG bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sdfarm.native.params import SAMPLERS, SCHEDULERS

# A1111's names (modules/sd_samplers_kdiffusion.py, sd_samplers_lcm.py, ...) for the runtime's
# samplers and schedulers (sdfarm.native.params spells them as master-596 does).
SAMPLER_NAMES: dict[str, str] = {
    "euler": "Euler",
    "euler_a": "Euler a",
    "heun": "Heun",
    "dpm2": "DPM2",
    "dpm++2s_a": "DPM++ 2S a",
    "dpm++2m": "DPM++ 2M",
    "dpm++2mv2": "DPM++ 2M v2",
    "ipndm": "IPNDM",
    "ipndm_v": "IPNDM_V",
    "lcm": "LCM",
    "ddim_trailing": "DDIM",
    "tcd": "TCD",
    "res_multistep": "Res Multistep",
    "res_2s": "Res 2s",
    "er_sde": "ER SDE",
}
SCHEDULER_LABELS: dict[str, str] = {
    "discrete": "Discrete",
    "karras": "Karras",
    "exponential": "Exponential",
    "ays": "Align Your Steps",
    "gits": "GITS",
    "sgm_uniform": "SGM Uniform",
    "simple": "Simple",
    "smoothstep": "Smoothstep",
    "kl_optimal": "KL Optimal",
    "lcm": "LCM",
    "bong_tangent": "Bong Tangent",
}
assert set(SAMPLER_NAMES) == set(SAMPLERS) and set(SCHEDULER_LABELS) == set(SCHEDULERS)
AUTOMATIC = "Automatic"
"""A1111's word for "the model's own" schedule; also written for our sampler "default" (the
runtime picks the model's own sampler), since a reader needs a `Sampler`."""
LATENT = "Latent"
"""A1111's hires upscaler that upscales the latent: ours when no upscaler model is named."""
VERSION = "sdfarm"


def sampler_name(sampler: Any) -> str:
    """A1111's display name of one of our samplers ("euler_a" -> "Euler a")."""
    if sampler in (None, "", "default"):
        return AUTOMATIC
    return SAMPLER_NAMES.get(str(sampler), str(sampler))


def scheduler_label(scheduler: Any) -> str:
    """A1111's display name of one of our schedulers ("karras" -> "Karras")."""
    return SCHEDULER_LABELS.get(str(scheduler), AUTOMATIC)


def quote(value: Any) -> str:
    """A setting's value as A1111 writes it (infotext_utils.quote): JSON-quoted when it holds a
    comma, a colon or a newline, which would otherwise split it."""
    text = str(value)
    if "," not in text and ":" not in text and "\n" not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def _weight(value: Any) -> str:
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


def _alias(name: str) -> str:
    """A LoRA's name as A1111's `Lora hashes` writes it (no comma or colon, its separators)."""
    return str(name).replace(":", "").replace(",", "")


def settings(params: Mapping[str, Any]) -> dict[str, Any]:
    """The settings line of `params` (our parameter names, as sdfarm.native.params and the
    engine's metadata spell them), A1111's keys in its order; only those that apply."""
    out: dict[str, Any] = {
        "Steps": params.get("steps"),
        "Sampler": sampler_name(params.get("sampler")),
        "Schedule type": scheduler_label(params.get("scheduler")),
        "CFG scale": None if params.get("cfg_scale") is None else float(params["cfg_scale"]),
        "Seed": params.get("seed"),
        "Size": None,
        "Model hash": params.get("model_hash") or None,
        "Model": params.get("model") or None,
        "Denoising strength": None,
        "Clip skip": None,
    }
    if params.get("width") and params.get("height"):
        out["Size"] = f"{params['width']}x{params['height']}"
    if params.get("init_image") and params.get("strength") is not None:  # img2img, inpainting
        out["Denoising strength"] = float(params["strength"])
    clip_skip = params.get("clip_skip")
    if clip_skip is not None and int(clip_skip) > 1:
        out["Clip skip"] = int(clip_skip)
    if float(params.get("hires_scale") or 1.0) > 1.0:
        out["Denoising strength"] = float(params.get("hires_strength") or 0.0)
        out["Hires upscale"] = float(params["hires_scale"])
        if params.get("hires_steps"):
            out["Hires steps"] = int(params["hires_steps"])
        out["Hires upscaler"] = params.get("hires_upscaler") or LATENT
    hashes = params.get("lora_hashes") or {}
    known = [(n, hashes[n]) for n, _ in params.get("loras") or () if hashes.get(n)]
    if known:
        out["Lora hashes"] = ", ".join(f"{_alias(n)}: {h}" for n, h in known)
    out["Version"] = VERSION
    return {k: v for k, v in out.items() if v is not None}


def infotext(params: Mapping[str, Any], *, seed: Any = None, model: Any = None) -> str:
    """The A1111 infotext of one image made with `params`; `seed` and `model`, when given,
    replace theirs (one image of a batch has its own seed)."""
    if seed is not None or model is not None:
        params = {
            **params,
            **({"seed": seed} if seed is not None else {}),
            **({"model": model} if model is not None else {}),
        }
    prompt = str(params.get("prompt") or "")
    tags = " ".join(f"<lora:{n}:{_weight(w)}>" for n, w in params.get("loras") or ())
    if tags:
        prompt = f"{prompt} {tags}" if prompt else tags
    negative = params.get("negative_prompt")
    negative_line = f"\nNegative prompt: {negative}" if negative else ""
    line = ", ".join(f"{k}: {quote(v)}" for k, v in settings(params).items())
    return f"{prompt}{negative_line}\n{line}".strip()
