"""AUTOMATIC1111's web UI API in our terms: its sampler and scheduler names, its txt2img and
img2img bodies as farm jobs, and its answer (base64 images, `info` as a JSON string holding the
infotext). Pure: the routes (sdfarm.gateway.routes_a1111) do the reading and the waiting.

Image tools, bots and plugins speak this API (the `webuiapi` package among them). Its bodies
carry dozens of fields with defaults; a field we do not know is ignored, a field at its
default is ignored, and a field asking for something the farm cannot do (face restoration,
seamless tiling, scripts, variation seeds, an upscaler the farm does not have) is refused by
name, so a client is never given an image made differently from what it asked.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time
from collections.abc import Mapping
from typing import Any

from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.infotext import (  # A1111's names and infotext, shared with the PNG chunk
    SAMPLER_NAMES,
    SCHEDULER_LABELS,
    VERSION,
    infotext,
    sampler_name,
)
from sdfarm.native.params import MAX_BATCH

LATENT_UPSCALERS = (
    "Latent",
    "Latent (antialiased)",
    "Latent (bicubic)",
    "Latent (bicubic antialiased)",
    "Latent (nearest)",
    "Latent (nearest-exact)",
)
LORA_TAG = re.compile(r"<lora:([^:>]+)(?::([-+0-9.eE]+))?>")


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9+]", "", name.lower())


_SAMPLER_BY_KEY = {_key(v): k for k, v in SAMPLER_NAMES.items()} | {
    _key(k): k for k in SAMPLER_NAMES
}
_SCHEDULER_BY_KEY = {_key(v): k for k, v in SCHEDULER_LABELS.items()} | {
    _key(k): k for k in SCHEDULER_LABELS
}


def sampler(name: Any) -> str:
    """The runtime's sampler for an A1111 sampler name ("Euler a", "k_euler_a", "euler_a");
    "default" for none. A Karras-style suffix ("DPM++ 2M Karras") is A1111's old way of
    naming the scheduler too: use `scheduler` for that."""
    if name in (None, ""):
        return "default"
    text = str(name)
    if text.lower().startswith("k_"):
        text = text[2:]
    found = _SAMPLER_BY_KEY.get(_key(text))
    if found is None:
        known = ", ".join(SAMPLER_NAMES.values())
        raise InvalidParameterError("sampler_name", f"unknown sampler {name!r}; known: {known}")
    return found


def scheduler(name: Any) -> str:
    """The runtime's scheduler for an A1111 scheduler name or label ("Automatic": the model's
    own)."""
    if name in (None, "") or _key(str(name)) == "automatic":
        return "default"
    found = _SCHEDULER_BY_KEY.get(_key(str(name)))
    if found is None:
        known = ", ".join(["Automatic", *SCHEDULER_LABELS.values()])
        raise InvalidParameterError("scheduler", f"unknown scheduler {name!r}; known: {known}")
    return found


def samplers_doc() -> list[dict[str, Any]]:
    """GET /sdapi/v1/samplers."""
    return [
        {"name": label, "aliases": [name, "k_" + name], "options": {}}
        for name, label in SAMPLER_NAMES.items()
    ]


def schedulers_doc() -> list[dict[str, Any]]:
    """GET /sdapi/v1/schedulers."""
    rows = [("automatic", "Automatic")] + list(SCHEDULER_LABELS.items())
    return [
        {"name": n, "label": label, "aliases": None, "default_rho": -1, "need_inner_model": False}
        for n, label in rows
    ]


def model_name(title: str) -> str:
    """A checkpoint as A1111 names it ("name.safetensors [hash]", "name [hash]") -> ours."""
    name = re.sub(r"\s*\[[0-9a-fA-F]*\]\s*$", "", str(title)).strip()
    for ext in (".safetensors", ".gguf", ".ckpt"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    return name


def split_loras(prompt: str) -> tuple[str, list[tuple[str, float]]]:
    """A1111's `<lora:name:weight>` tags taken out of the prompt, as the job's `loras`."""
    loras: list[tuple[str, float]] = []

    def take(m: re.Match[str]) -> str:
        try:
            weight = float(m.group(2)) if m.group(2) else 1.0
        except ValueError:
            raise InvalidParameterError(
                "prompt", f"bad LoRA weight in {m.group(0)!r}: give <lora:name:0.8>"
            ) from None
        loras.append((m.group(1).strip(), weight))
        return ""

    text = LORA_TAG.sub(take, prompt)
    text = re.sub(r"\s+,", ",", re.sub(r"\s{2,}", " ", text))
    return text.strip(" ,"), loras


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    """InvalidParameterError naming the first field that asks for what the farm cannot do."""
    asks = {
        "restore_faces": "face restoration is not available on this farm",
        "tiling": "seamless tiling is not available on this farm",
        "script_name": "scripts are not available on this farm",
    }
    for name, why in asks.items():
        if body.get(name):
            raise InvalidParameterError(name, why)
    for name, value in (body.get("alwayson_scripts") or {}).items():
        args = (value or {}).get("args") if isinstance(value, Mapping) else None
        if args and args[0] is not False:
            raise InvalidParameterError(
                "alwayson_scripts", f"the script {name!r} is not available on this farm"
            )
    if float(body.get("subseed_strength") or 0) > 0:
        raise InvalidParameterError("subseed_strength", "variation seeds are not available")
    if body.get("styles"):
        raise InvalidParameterError("styles", "this farm keeps no prompt styles")
    for name in ("hr_checkpoint_name", "hr_sampler_name", "hr_prompt", "hr_negative_prompt"):
        value = body.get(name)
        if value not in (None, "", "Use same checkpoint", "Use same sampler"):
            raise InvalidParameterError(name, "the hires pass uses the first pass's settings")


def _number(body: Mapping[str, Any], name: str, default: Any, kind: type = int) -> Any:
    value = body.get(name)
    if value is None:
        return default
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise InvalidParameterError(name, f"not a number: {value!r}") from None


def job_fields(body: Mapping[str, Any], *, img2img: bool) -> dict[str, Any]:
    """The farm job (Farm.submit's keyword arguments, prompt included, model excluded) of an
    A1111 txt2img or img2img body. Images stay base64 here (decoded by the route)."""
    _refuse_unsupported(body)
    prompt, loras = split_loras(str(body.get("prompt") or ""))
    batch = _number(body, "batch_size", 1) * _number(body, "n_iter", 1)
    if not 1 <= batch <= MAX_BATCH:
        raise InvalidParameterError(
            "batch_size", f"batch_size x n_iter is {batch}; the farm makes 1 to {MAX_BATCH}"
        )
    fields: dict[str, Any] = {
        "prompt": prompt,
        "negative_prompt": str(body.get("negative_prompt") or ""),
        "width": _number(body, "width", 512),
        "height": _number(body, "height", 512),
        "steps": _number(body, "steps", 20),
        "cfg_scale": _number(body, "cfg_scale", 7.0, float),
        "seed": _number(body, "seed", -1),
        "batch_count": batch,
        "sampler": sampler(body.get("sampler_name") or body.get("sampler_index")),
        "scheduler": scheduler(body.get("scheduler")),
    }
    if loras:
        fields["loras"] = loras
    clip_skip = (body.get("override_settings") or {}).get("CLIP_stop_at_last_layers")
    if clip_skip not in (None, 1, 0):
        fields["clip_skip"] = _number({"clip_skip": clip_skip}, "clip_skip", 1)
    if img2img:
        fields.update(_img2img_fields(body))
    elif body.get("enable_hr"):
        fields.update(_hires_fields(body, fields["width"], fields["height"]))
    return fields


def _hires_fields(body: Mapping[str, Any], width: int, height: int) -> dict[str, Any]:
    upscaler = str(body.get("hr_upscaler") or "Latent")
    model = {} if upscaler in LATENT_UPSCALERS else {"hires_upscaler": upscaler}
    scale = _number(body, "hr_scale", 2.0, float)
    rx, ry = _number(body, "hr_resize_x", 0), _number(body, "hr_resize_y", 0)
    if rx or ry:  # a target size wins over the scale, as in A1111
        scale = max(rx / width if rx else 0.0, ry / height if ry else 0.0)
    return {
        "hires_scale": scale,
        "hires_steps": _number(body, "hr_second_pass_steps", 0),
        "hires_strength": _number(body, "denoising_strength", 0.7, float),
        **model,  # a farm upscaler by name (GET /sdapi/v1/upscalers); the farm checks it
    }


def _img2img_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    images = body.get("init_images") or []
    if not images:
        raise InvalidParameterError("init_images", "img2img needs one image in init_images")
    if len(images) > 1:
        raise InvalidParameterError(
            "init_images", "give one image: the farm redraws one init image per job"
        )
    fields: dict[str, Any] = {
        "init_image": images[0],
        "strength": _number(body, "denoising_strength", 0.75, float),
    }
    if body.get("mask"):
        fields["mask_image"] = body["mask"]
    return fields


def prepare_mask(png: bytes, invert: bool, blur: int) -> bytes:
    """An A1111 mask (white: redraw) as the job's mask: inverted when the body says
    `inpainting_mask_invert`, softened by `mask_blur` pixels as A1111 does."""
    from PIL import Image, ImageFilter, ImageOps

    try:
        im = Image.open(io.BytesIO(png))
        im.load()
    except Exception:  # noqa: BLE001 - the job schema names what is wrong with it
        return png
    mask = im.convert("L")
    if invert:
        mask = ImageOps.invert(mask)
    if blur > 0:
        mask = mask.filter(ImageFilter.GaussianBlur(blur))
    if not invert and blur <= 0 and im.mode == "L":
        return png
    out = io.BytesIO()
    mask.save(out, format="PNG")
    return out.getvalue()


def answer(
    pngs: list[bytes], meta: Mapping[str, Any], model: str, body: Mapping[str, Any]
) -> dict[str, Any]:
    """The txt2img/img2img response: base64 images, the request's parameters, and `info` as
    a JSON string (what A1111 clients json.loads)."""
    seeds = [int(s) for s in (meta.get("seeds") or [])] or [int(meta.get("seed") or 0)]
    texts = [infotext(meta, seed=s, model=model) for s in seeds]
    info = {
        "prompt": meta.get("prompt"),
        "all_prompts": [meta.get("prompt")] * len(pngs),
        "negative_prompt": meta.get("negative_prompt") or "",
        "all_negative_prompts": [meta.get("negative_prompt") or ""] * len(pngs),
        "seed": seeds[0],
        "all_seeds": seeds,
        "subseed": -1,
        "all_subseeds": [-1] * len(seeds),
        "subseed_strength": 0,
        "width": meta.get("width"),
        "height": meta.get("height"),
        "sampler_name": sampler_name(meta.get("sampler")),
        "cfg_scale": meta.get("cfg_scale"),
        "steps": meta.get("steps"),
        "batch_size": len(pngs),
        "restore_faces": False,
        "sd_model_name": model,
        "sd_model_hash": None,
        "seed_resize_from_w": -1,
        "seed_resize_from_h": -1,
        "denoising_strength": meta.get("strength"),
        "clip_skip": meta.get("clip_skip"),
        "index_of_first_image": 0,
        "infotexts": texts,
        "styles": [],
        "job_timestamp": time.strftime("%Y%m%d%H%M%S"),
        "is_using_inpainting_conditioning": False,
        "version": VERSION,
    }
    params = {k: v for k, v in body.items() if k not in ("init_images", "mask")}
    return {
        "images": [base64.b64encode(p).decode() for p in pngs],
        "parameters": params,
        "info": json.dumps(info),
    }


def progress_doc(
    progress: Mapping[str, Any] | None, state: str | None, preview: str | None = None
) -> dict[str, Any]:
    """GET /sdapi/v1/progress for the caller's newest live job (state None: none)."""
    step = int((progress or {}).get("step") or 0)
    steps = int((progress or {}).get("steps") or 0)
    per_step = float((progress or {}).get("s_per_step") or 0.0)
    running = state in ("queued", "placed", "running")
    return {
        "progress": round(step / steps, 4) if steps else 0.0,
        "eta_relative": round(max(0, steps - step) * per_step, 3),
        "state": {
            "skipped": False,
            "interrupted": state == "cancelled",
            "stopping_generation": False,
            "job": "sdfarm" if running else "",
            "job_count": 1 if running else 0,
            "job_timestamp": time.strftime("%Y%m%d%H%M%S"),
            "job_no": 0,
            "sampling_step": step,
            "sampling_steps": steps,
        },
        "current_image": preview,
        "textinfo": None,
    }


def extras_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The upscale job (Farm.upscale's image, upscaler and factor) of an extra-single-image
    body. Face restoration, a second upscaler and resizing to a size are refused by name; the
    factor is the upscaler's own scale (the runtime makes no other), so `upscaling_resize`
    must be that scale (the farm refuses another, naming it)."""
    for name in ("gfpgan_visibility", "codeformer_visibility", "extras_upscaler_2_visibility"):
        if float(body.get(name) or 0) > 0:
            raise InvalidParameterError(name, "not available on this farm")
    if int(body.get("resize_mode") or 0) != 0:
        raise InvalidParameterError(
            "resize_mode", "only resize_mode 0 (by upscaling_resize) is available"
        )
    upscaler = body.get("upscaler_1")
    if not upscaler or upscaler == "None":
        raise InvalidParameterError("upscaler_1", "name an upscaler (GET /sdapi/v1/upscalers)")
    if not body.get("image"):
        raise InvalidParameterError("image", "give the image to upscale, base64")
    return {
        "image": body["image"],
        "upscaler": str(upscaler),
        "factor": _number(body, "upscaling_resize", 0),
    }
