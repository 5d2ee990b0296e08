"""Generation parameters, validated before any native call.

The runtime aborts the whole process on some inputs (width 0 or a negative height: SIGABRT;
zero steps: SIGSEGV; steps -1: memory grows until the OOM killer; see the facts file), so
every value is checked here against the range the runtime survives, and the error names the
parameter and that range. The scheduler validates with the same code before queueing.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sdfarm.native.errors import InvalidParameterError

# Names as master-596 spells them (sample_method_to_str / scheduler_to_str in
# stable-diffusion.cpp); "default" lets the runtime pick the model's own.
SAMPLERS = (
    "euler",
    "euler_a",
    "heun",
    "dpm2",
    "dpm++2s_a",
    "dpm++2m",
    "dpm++2mv2",
    "ipndm",
    "ipndm_v",
    "lcm",
    "ddim_trailing",
    "tcd",
    "res_multistep",
    "res_2s",
    "er_sde",
)
SCHEDULERS = (
    "discrete",
    "karras",
    "exponential",
    "ays",
    "gits",
    "sgm_uniform",
    "simple",
    "smoothstep",
    "kl_optimal",
    "lcm",
    "bong_tangent",
)
MIN_SIZE, MAX_SIZE, SIZE_STEP = 64, 4096, 8
MAX_PIXELS = 4096 * 4096
MAX_STEPS = 200
MAX_BATCH = 16
MAX_PROMPT_CHARS = 20_000
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class GenerationParams:
    """One image request as the engine runs it. `seed=-1` picks a random seed, which the
    result reports, so every image can be made again."""

    prompt: str
    negative_prompt: str = ""
    width: int = 256
    height: int = 256
    steps: int = 4
    seed: int = -1
    cfg_scale: float = 1.0
    sampler: str = "default"
    scheduler: str = "default"
    batch_count: int = 1
    clip_skip: int = -1
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        raise InvalidParameterError(name, f"must be an integer, got {value!r}")
    return value


def _in_range(name: str, value: int, lo: int, hi: int, hint: str = "") -> int:
    if not lo <= value <= hi:
        raise InvalidParameterError(name, f"{value} is outside {lo}..{hi}{hint}")
    return value


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidParameterError(name, f"must be text, got {type(value).__name__}")
    if "\x00" in value:
        raise InvalidParameterError(name, "contains a NUL character")
    if len(value) > MAX_PROMPT_CHARS:
        raise InvalidParameterError(name, f"is {len(value)} characters, at most {MAX_PROMPT_CHARS}")
    return value


def validate(params: GenerationParams) -> GenerationParams:
    """Return a checked copy (seed resolved) or raise InvalidParameterError naming the first
    bad parameter and its allowed range."""
    prompt = _text("prompt", params.prompt)
    negative = _text("negative_prompt", params.negative_prompt)
    sizes = {}
    for name in ("width", "height"):
        v = _in_range(name, _int(name, getattr(params, name)), MIN_SIZE, MAX_SIZE, " pixels")
        if v % SIZE_STEP:
            raise InvalidParameterError(
                name,
                f"{v} is not a multiple of {SIZE_STEP} (the runtime works in 8-pixel "
                f"latent cells); use {v - v % SIZE_STEP} or {v + SIZE_STEP - v % SIZE_STEP}",
            )
        sizes[name] = v
    if sizes["width"] * sizes["height"] > MAX_PIXELS:
        raise InvalidParameterError(
            "width x height", f"{sizes['width']}x{sizes['height']} exceeds {MAX_PIXELS} pixels"
        )
    steps = _in_range("steps", _int("steps", params.steps), 1, MAX_STEPS)
    batch = _in_range("batch_count", _int("batch_count", params.batch_count), 1, MAX_BATCH)
    clip_skip = _in_range("clip_skip", _int("clip_skip", params.clip_skip), -1, 12)
    seed = _int("seed", params.seed)
    if seed == -1:
        seed = secrets.randbelow(2**31)
    _in_range("seed", seed, 0, MAX_SEED, " (or -1 for a random seed)")
    try:
        cfg = float(params.cfg_scale)
    except (TypeError, ValueError):
        raise InvalidParameterError(
            "cfg_scale", f"must be a number, got {params.cfg_scale!r}"
        ) from None
    if not math.isfinite(cfg) or not 0.0 <= cfg <= 50.0:
        raise InvalidParameterError("cfg_scale", f"{cfg} is outside 0..50")
    if params.sampler != "default" and params.sampler not in SAMPLERS:
        raise InvalidParameterError(
            "sampler",
            f"unknown sampler {params.sampler!r}; choose one of default, " + ", ".join(SAMPLERS),
        )
    if params.scheduler != "default" and params.scheduler not in SCHEDULERS:
        raise InvalidParameterError(
            "scheduler",
            f"unknown scheduler {params.scheduler!r}; choose one of default, "
            + ", ".join(SCHEDULERS),
        )
    return replace(
        params,
        prompt=prompt,
        negative_prompt=negative,
        steps=steps,
        seed=seed,
        cfg_scale=cfg,
        batch_count=batch,
        clip_skip=clip_skip,
        **sizes,
    )
