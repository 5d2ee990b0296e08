"""The one job schema: every generation parameter with its type, range, default and help text,
and their validation before any native call.

`GenerationParams` is the only list of a job's parameters. Every door derives from `PARAMS`:
the CLI flags (sdfarm.cli.options), the batch file fields (sdfarm.client.batch), `Farm.submit`,
the gateway's request models (sdfarm.gateway.schemas), the in-process path and the PNG
metadata (png.py). Adding a parameter is one field here plus the engine's use of it.

The runtime aborts the whole process on some inputs (width 0 or a negative height: SIGABRT;
zero steps: SIGSEGV; steps -1: memory grows until the OOM killer; see the facts file), so
every value is checked against the range the runtime survives, and the error names the
parameter and that range. Clients, the gateway and the worker all validate with this code.

Some combinations crash although each value is in range: `bench/crasher_sweep.py
--no-validate` runs every sampler x scheduler x steps x size on the real runtime and
docs/crashers.md lists what it found. Each is refused here by a general rule read from the
runtime's source (a minimum of steps per scheduler, `MIN_STEPS`; a prompt budget,
`MAX_PROMPT_BYTES`), and `tests/e2e/test_crasher_sweep.py` checks that with validation nothing
of the grid crashes.
"""

from __future__ import annotations

import math
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from sdfarm.native import addresses, images
from sdfarm.native.decoders import DECODERS
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.logs import LEVELS

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

# The fewest steps a scheduler's schedule can be built from, and what happens below it, as
# the runtime's source (src/denoiser.hpp of master-596) shows. Every sampler reads the
# schedule the scheduler builds, so the minimum holds for every sampler, and for "default"
# only where it resolves to one of these (the runtime's default for a model family is not
# known here). Found by bench/crasher_sweep.py (docs/crashers.md).
MIN_STEPS: dict[str, tuple[int, str]] = {
    # GITSScheduler indexes its precomputed noise tables with steps - 2 (they cover 2..20
    # steps): 1 step reads before the first table and the process dies (SIGSEGV).
    "gits": (2, "its noise tables start at 2 steps; with 1 the runtime crashes (SIGSEGV)"),
    # Karras and exponential step from sigma_max to sigma_min in steps - 1 intervals: with 1
    # they divide 0 by 0, every sigma is NaN and the image comes back blank (no crash, but a
    # device's time for nothing).
    "karras": (2, "its schedule divides by steps - 1; with 1 the image comes back blank (NaN)"),
    "exponential": (
        2,
        "its schedule divides by steps - 1; with 1 the image comes back blank (NaN)",
    ),
}

# The prompt budget. No text encoder of master-596 truncates a prompt: CLIP (SD 1.x/2.x, SDXL,
# SD3) encodes it in 77-token chunks and concatenates them all, T5 (SD3, Flux, Chroma) likewise
# in chunks of 77, 256 or 512 tokens, and the LLM encoders (Qwen-Image, Z-Image, Ovis-Image,
# Flux.2: `LLMEmbedder`, max_length 100,000,000) in one sequence with an n x n attention mask.
# So every token costs time and memory, growing with the square of the count, while no model
# the runtime runs reads more than 1,024 tokens (Qwen-Image, the longest; Flux's T5 and Flux.2
# read 512, Ovis-Image 256 - the runtime pads their prompts to exactly that -, CLIP 77 a
# chunk). Measured with the tiny model (64x64, 1 step, CPU; docs/crashers.md): a
# 100- or 1,000-character prompt 0.35 s, 5,000 characters 1.7 s, 20,000 characters 18 s and
# 3 GB; 5,000 random CJK characters (8,000 tokens) 92 s and 9 GB, 8,000 of them 263 s and
# 22 GB, and 9,000 (27,000 bytes) kill the process: the runtime's prompt-weight parser
# (parse_prompt_attention, a recursive std::regex) overflows the 8 MiB stack on a run of
# 27,000 bytes, and CLIP's tokenizer on one between 24,000 and 30,000.
# A token takes at least one byte of the prompt in every tokenizer the runtime has (byte-level
# BPE for CLIP, Qwen and Mistral; T5's unigram pieces), besides a few special tokens, so bytes
# bound tokens honestly: 4,096 bytes are at most 4,096 tokens (digits, one token each: 18-22 s
# and 2.6 GB with the tiny model, the worst case) and leave room for 1,024 tokens of English
# (4.5 characters a token with both the Qwen2 and the CLIP tokenizer: 4,096 characters of
# prose are about 900 tokens, 1.3 s). A CJK character is 3 bytes and, measured on random ones,
# 1.6 (Qwen2) to 2.9 (CLIP) tokens: the 1,365 the cap lets through are 2,226 and 3,943.
MAX_PROMPT_TOKENS = 1_024
MAX_PROMPT_BYTES = 4_096
MAX_PROMPT_CHARS = 4_096  # characters <= bytes; the character limit the doors show
PROMPT_LIMIT_WHY = (
    f"the runtime encodes every token of a prompt (none of its text encoders truncates) at a "
    f"cost that grows with the square of their count, and no model it runs reads more than "
    f"{MAX_PROMPT_TOKENS:,} tokens; a token takes at least one byte (in English about 4.5 "
    f"characters)"
)
MAX_SEED = 2**63 - 1
RANDOM_SEED = -1
MAX_REF_IMAGES = 4
MAX_LORAS = 8
STEP_CACHES = ("off", "easycache", "ucache", "dbcache", "taylorseer", "cache_dit", "spectrum")
"""sd_cache_mode_t of master-596, in its order ("off" is SD_CACHE_DISABLED)."""
MAX_LORA_WEIGHT = 10.0
MAX_EMBEDDINGS = 8
MAX_CONTROL_STRENGTH = 2.0
VAE_TILING = ("auto", "on", "off")
"""The values of `vae_tiling` (sdfarm.native.tiling.CHOICES)."""
# Upscaler tiles (sdfarm.native.upscale_params): input pixels a side. Tiles below 32 pixels run
# but cost many times the time (a 40x40 image in 1-pixel tiles took 20 s against 0.1 s).
MIN_TILE, MAX_TILE, DEFAULT_TILE = 32, 1024, 128
WHOLE_IMAGE = "the whole image at once, the most memory"


@dataclass(frozen=True)
class Param:
    """How one parameter is typed, bounded and explained. `kind` is text, int, float, bool,
    choice, url (a webhook's, checked by sdfarm.native.addresses, which resolves its host),
    image (PNG/JPEG/WebP bytes, sdfarm.native.images) or images (a list of them, at most
    `hi`); `lo`..`hi` bound numbers (`unit` names them in errors); `step` is a multiple ints
    must be; `choices` lists a choice's values; `auto` is a value outside the range that
    means "pick one" (seed -1). Text is bounded by `max_chars` characters and `max_bytes`
    UTF-8 bytes; `limit_why` says why, in the error."""

    name: str
    kind: str
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None
    step: int | None = None
    unit: str = ""
    choices: tuple[str, ...] = ()
    auto: float | None = None
    auto_text: str = ""  # what `auto` means, when not "pick one"
    max_chars: int | None = None
    max_bytes: int | None = None
    limit_why: str = ""

    @property
    def required(self) -> bool:
        return self.default is MISSING

    @property
    def python_type(self) -> type:
        return {
            "text": str,
            "choice": str,
            "int": int,
            "float": float,
            "bool": bool,
            "image": bytes,
            "images": bytes,
            "loras": str,
            "names": str,
            "url": str,
        }[self.kind]

    @property
    def range_text(self) -> str:
        """The allowed values in words, for help texts."""
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "bool":
            return "true or false"
        if self.kind == "url":
            return (
                f"an http(s) URL of at most {addresses.MAX_URL_CHARS} characters whose host is "
                "a public address; empty for none"
            )
        if self.kind == "names":
            return f"up to {_num(self.hi)} names, comma-separated"
        if self.kind == "loras":
            return (
                f"up to {_num(self.hi)} NAME:WEIGHT pairs, each weight "
                f"{_num(-MAX_LORA_WEIGHT)}..{_num(MAX_LORA_WEIGHT)}"
            )
        if self.kind in ("image", "images"):
            one = (
                f"a PNG, JPEG or WebP image of at most {images.MAX_IMAGE_BYTES // 2**20} MiB "
                f"and {images.MAX_IMAGE_SIDE} pixels a side"
            )
            return one if self.kind == "image" else f"up to {_num(self.hi)} images, each {one}"
        if self.lo is None:
            return f"at most {self.max_chars} characters" if self.max_chars else "text"
        text = f"{_num(self.lo)}..{_num(self.hi)}{self.unit}"
        if self.step:
            text += f", a multiple of {self.step}"
        if self.auto is not None:
            means = f": {self.auto_text}" if self.auto_text else " picks one"
            text += f"; {self.auto}{means}"
        return text

    def check(self, value: Any) -> Any:
        """`value` converted to this parameter's type and checked; InvalidParameterError
        naming the parameter and its range otherwise."""
        if self.kind == "text":
            return _text(self.name, value, self.max_chars, self.max_bytes, self.limit_why)
        if self.kind == "image":
            return None if value is None else images.check_image(self.name, value)
        if self.kind == "url":
            return addresses.check_url(self.name, value)
        if self.kind == "loras":
            return _loras(self.name, value, int(self.hi or 0))
        if self.kind == "names":
            return _names(self.name, value, int(self.hi or 0))
        if self.kind == "images":
            if not isinstance(value, list | tuple):
                raise InvalidParameterError(self.name, f"must be a list of images, got {value!r}")
            if len(value) > self.hi:  # type: ignore[operator]
                raise InvalidParameterError(
                    self.name, f"has {len(value)} images, at most {_num(self.hi)}"
                )
            return tuple(images.check_image(f"{self.name}[{i}]", v) for i, v in enumerate(value))
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise InvalidParameterError(self.name, f"must be true or false, got {value!r}")
            return value
        if self.kind == "choice":
            if not isinstance(value, str) or value not in self.choices:
                raise InvalidParameterError(
                    self.name,
                    f"unknown {self.name} {value!r}; choose one of " + ", ".join(self.choices),
                )
            return value
        if self.kind == "float":
            number = _float(self.name, value)
            if self.auto is not None and number == self.auto:
                return number
            if not math.isfinite(number) or not self.lo <= number <= self.hi:  # type: ignore[operator]
                raise InvalidParameterError(self.name, f"{number} is outside {self.range_text}")
            return number
        number = _int(self.name, value)
        if self.auto is not None and number == self.auto:
            return number
        if not self.lo <= number <= self.hi:  # type: ignore[operator]
            hint = f" (or {self.auto} for a random {self.name})" if self.auto is not None else ""
            if self.auto_text:
                hint = f" (or {self.auto}: {self.auto_text})"
            raise InvalidParameterError(
                self.name, f"{number} is outside {_num(self.lo)}..{_num(self.hi)}{self.unit}{hint}"
            )
        if self.step and number % self.step:
            raise InvalidParameterError(
                self.name,
                f"{number} is not a multiple of {self.step} (the runtime works in "
                f"{self.step}-pixel latent cells); use {number - number % self.step} or "
                f"{number + self.step - number % self.step}",
            )
        return number


def _num(x: float | None) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def param(kind: str, default: Any, help: str, **rules: Any) -> Any:  # noqa: A002
    """A GenerationParams field carrying its Param (the name is filled in from the field)."""
    return field(default=default, metadata={"param": {"kind": kind, "help": help, **rules}})


_SIZE = {"lo": MIN_SIZE, "hi": MAX_SIZE, "step": SIZE_STEP, "unit": " pixels"}
_PROMPT = {
    "max_chars": MAX_PROMPT_CHARS,
    "max_bytes": MAX_PROMPT_BYTES,
    "limit_why": PROMPT_LIMIT_WHY,
}


@dataclass(frozen=True)
class GenerationParams:
    """One image request as the engine runs it. `seed=-1` picks a random seed, which the
    result reports, so every image can be made again."""

    prompt: str = param("text", MISSING, "what to draw", **_PROMPT)
    negative_prompt: str = param("text", "", "what to keep out of the image", **_PROMPT)
    width: int = param("int", 256, "image width", **_SIZE)
    height: int = param("int", 256, "image height", **_SIZE)
    steps: int = param("int", 4, "sampling steps", lo=1, hi=MAX_STEPS)
    seed: int = param("int", RANDOM_SEED, "random seed", lo=0, hi=MAX_SEED, auto=RANDOM_SEED)
    cfg_scale: float = param("float", 1.0, "classifier-free guidance scale", lo=0.0, hi=50.0)
    sampler: str = param("choice", "default", "sampling method", choices=("default", *SAMPLERS))
    scheduler: str = param(
        "choice", "default", "noise schedule of the sampler", choices=("default", *SCHEDULERS)
    )
    batch_count: int = param(
        "int", 1, "images of one job (seeds seed, seed+1, ...)", lo=1, hi=MAX_BATCH
    )
    clip_skip: int = param("int", -1, "CLIP layers to skip (-1: the model's own)", lo=-1, hi=12)
    init_image: bytes | None = param(
        "image", None, "an image to start from (img2img); with a mask, the image to inpaint"
    )
    strength: float = param(
        "float", 0.75, "how much of the init image is redrawn: 0 keeps it, 1 ignores it",
        lo=0.0, hi=1.0,
    )  # fmt: skip
    mask_image: bytes | None = param(
        "image", None, "inpainting: white where the init image is redrawn, black where kept"
    )
    ref_images: tuple[bytes, ...] = param(
        "images", (), "reference images for edit models (Flux Kontext, Qwen-Image-Edit)",
        hi=MAX_REF_IMAGES,
    )  # fmt: skip
    loras: tuple[tuple[str, float], ...] = param(
        "loras", (), "LoRAs to apply, by name (the farm's loras/ folders), with their weights",
        hi=MAX_LORAS,
    )  # fmt: skip
    control_image: bytes | None = param(
        "image", None, "ControlNet: the image that guides the drawing (an edge map, a pose, a "
        "depth map), resized to the job's size"
    )  # fmt: skip
    control_strength: float = param(
        "float", 0.9, "ControlNet: how strongly the control image guides (0: not at all)",
        lo=0.0, hi=MAX_CONTROL_STRENGTH,
    )  # fmt: skip
    control_net: str = param(
        "text", "", "ControlNet: its name (the farm's controlnets/ folders); SD 1.x/2.x/XL "
        "models only", max_chars=128,
    )  # fmt: skip
    embeddings: str = param(
        "names", "", "textual-inversion embeddings the prompt uses, by name (the farm's "
        "embeddings/ folders), comma-separated; a prompt triggers one by its name; CLIP "
        "models (SD 1.x/2.x/XL) only", hi=MAX_EMBEDDINGS,
    )  # fmt: skip
    hires_scale: float = param(
        "float", 1.0, "a second, high-resolution pass: the final size over width x height "
        "(1: no second pass)", lo=1.0, hi=4.0,
    )  # fmt: skip
    hires_steps: int = param(
        "int", 0, "steps of the high-resolution pass (0: as many as the first)", lo=0,
        hi=MAX_STEPS,
    )  # fmt: skip
    hires_strength: float = param(
        "float", 0.7, "how much the high-resolution pass redraws", lo=0.0, hi=1.0
    )
    hires_upscaler: str = param(
        "text", "", "the high-resolution pass's upscaler, by name (the farm's upscalers/ "
        "folders): it upscales the decoded image, encoded again (empty: the latent is "
        "upscaled)", max_chars=128,
    )  # fmt: skip
    hires_tile_size: int = param(
        "int", DEFAULT_TILE, "input pixels a tile's side of the hires upscaler", lo=MIN_TILE,
        hi=MAX_TILE, auto=0, auto_text=WHOLE_IMAGE,
    )  # fmt: skip
    step_cache: str = param(
        "choice", "off", "reuse the model's output across similar steps: faster, a little "
        "different. ucache suits UNet models (SD 1.x/2.x/XL), easycache, dbcache, taylorseer "
        "and cache_dit DiT models, spectrum both; the runtime ignores a mode the model cannot "
        "use, with a warning (measured: bench/step_cache.py, docs/gpu.md)", choices=STEP_CACHES,
    )  # fmt: skip
    vae_tiling: str = param(
        "choice", "auto", "decode the image in tiles, which bounds the decode's memory: auto "
        "tiles when the untiled estimate does not fit the device (the job's warnings say "
        "so), on always, off never", choices=VAE_TILING,
    )  # fmt: skip
    decoder: str = param(
        "choice", "default", "what turns the latent into pixels: default the model's own (its "
        "full VAE, else its TAESD), vae its full VAE, taesd its TAESD (the model needs a taesd "
        "file): several times faster, a coarser image (docs/gpu.md)", choices=DECODERS,
    )  # fmt: skip
    preview_every: int = param(
        "int", 0, "a small preview image (longest side 256) in the job's events every N "
        "sampling steps (0: none)", lo=0, hi=MAX_STEPS,
    )  # fmt: skip

    @property
    def final_size(self) -> tuple[int, int]:
        """The size of the images the job returns: width x height, times hires_scale rounded
        to the runtime's 8-pixel cells."""
        if self.hires_scale <= 1.0:
            return self.width, self.height
        return (
            _cells(self.width * self.hires_scale),
            _cells(self.height * self.hires_scale),
        )

    def as_dict(self) -> dict[str, Any]:
        """The parameters as JSON-ready values: each input image by its digest."""
        out = asdict(self)
        out["loras"] = [[name, weight] for name, weight in self.loras]
        for p in IMAGE_PARAMS:
            value = out[p.name]
            if p.kind == "image":
                out[p.name] = None if value is None else images.digest(value)
            else:
                out[p.name] = [images.digest(v) for v in value]
        return out

    @property
    def encodes(self) -> bool:
        """Whether the engine encodes an image into latents (img2img, inpainting, the image
        a hires upscaler made)."""
        return (
            self.init_image is not None
            or self.control_image is not None  # the runtime encodes it when it can
            or bool(self.hires_upscaler)
        )


@dataclass(frozen=True)
class JobOptions:
    """How the farm treats a job, beside what it draws: its place in the queue, who fair
    share counts it for, the runtime's log records it keeps, and who is told when it ends."""

    priority: int = param("int", 5, "placement order: 0 (interactive, first) .. 9 (batch)",
                          lo=0, hi=9)  # fmt: skip
    submitter: str = param(
        "text", "", "the name fair share counts the job for (default: the client's)",
        max_chars=200,
    )  # fmt: skip
    log_level: str = param(
        "choice", "none", "the runtime's log records kept with the result", choices=tuple(LEVELS)
    )
    log_prompts: bool = param(
        "bool", False, "keep prompt text in log records (redacted by default)"
    )
    deadline_s: float = param(
        "float",
        3600.0,
        "seconds the job may take once placed on a device; past it the job fails and its "
        "worker stops it",
        lo=1.0,
        hi=7 * 24 * 3600.0,
    )
    webhook: str = param(
        "url",
        "",
        "a URL the farm POSTs the job's outcome to when it ends (done, failed or cancelled), "
        "signed with the farm's webhook secret",
    )


def _params_of(cls: type) -> tuple[Param, ...]:
    return tuple(Param(name=f.name, default=f.default, **f.metadata["param"]) for f in fields(cls))


PARAMS: tuple[Param, ...] = _params_of(GenerationParams)
"""Every generation parameter of a job, in order: what each door derives its fields from."""
IMAGE_PARAMS: tuple[Param, ...] = tuple(p for p in PARAMS if p.kind in ("image", "images"))
OPTIONS: tuple[Param, ...] = _params_of(JobOptions)
"""Every option of a job (JobOptions), for the doors that take them."""
OPTION_NAMES: tuple[str, ...] = tuple(p.name for p in OPTIONS)
BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}
NAMES: tuple[str, ...] = tuple(BY_NAME)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        raise InvalidParameterError(name, f"must be an integer, got {value!r}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise InvalidParameterError(name, f"must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidParameterError(name, f"must be a number, got {value!r}") from None


def _text(
    name: str,
    value: Any,
    max_chars: int | None,
    max_bytes: int | None = None,
    why: str = "",
) -> str:
    if not isinstance(value, str):
        raise InvalidParameterError(name, f"must be text, got {type(value).__name__}")
    if "\x00" in value:
        raise InvalidParameterError(name, "contains a NUL character")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as e:
        # A lone surrogate (JSON can carry "\ud800"): the engine passes text to the runtime
        # as UTF-8, which cannot encode it.
        raise InvalidParameterError(
            name, f"contains {value[e.start]!r} at {e.start}, which UTF-8 cannot encode"
        ) from None
    because = f": {why}" if why else ""
    if max_chars is not None and len(value) > max_chars:
        raise InvalidParameterError(
            name, f"is {len(value)} characters, at most {max_chars}{because}"
        )
    if max_bytes is not None and size > max_bytes:
        raise InvalidParameterError(
            name,
            f"is {len(value)} characters but {size} bytes in UTF-8, at most {max_bytes} "
            f"bytes{because}",
        )
    return value


def from_mapping(values: Mapping[str, Any]) -> GenerationParams:
    """GenerationParams from a mapping of parameter names (a JSON body, a batch line, keyword
    arguments); an unknown name is an InvalidParameterError naming it and the known ones.
    Not validated yet: pass the result to `validate`."""
    unknown = sorted(set(values) - set(NAMES))
    if unknown:
        raise InvalidParameterError(
            unknown[0], f"unknown parameter; the parameters are {', '.join(NAMES)}"
        )
    if "prompt" not in values:
        raise InvalidParameterError("prompt", "missing")
    return GenerationParams(**values)


def validate(params: GenerationParams) -> GenerationParams:
    """Return a checked copy (types converted, seed resolved) or raise InvalidParameterError
    naming the first bad parameter and its allowed range."""
    checked = {p.name: p.check(getattr(params, p.name)) for p in PARAMS}
    if checked["width"] * checked["height"] > MAX_PIXELS:
        raise InvalidParameterError(
            "width x height", f"{checked['width']}x{checked['height']} exceeds {MAX_PIXELS} pixels"
        )
    least, why = MIN_STEPS.get(checked["scheduler"], (1, ""))
    if checked["steps"] < least:
        raise InvalidParameterError(
            "steps",
            f"scheduler {checked['scheduler']} needs at least {least} steps, got "
            f"{checked['steps']}: {why}; use {least} or more steps, or another scheduler",
        )
    final = replace(params, **checked).final_size
    if max(final) > MAX_SIZE or final[0] * final[1] > MAX_PIXELS:
        raise InvalidParameterError(
            "hires_scale",
            f"{checked['width']}x{checked['height']} times {checked['hires_scale']:g} is "
            f"{final[0]}x{final[1]}, beyond {MAX_SIZE} pixels a side or {MAX_PIXELS} in all",
        )
    if checked["hires_upscaler"] and not (
        LORA_NAME.match(checked["hires_upscaler"]) and checked["hires_scale"] > 1.0
    ):
        raise InvalidParameterError(
            "hires_upscaler",
            f"{checked['hires_upscaler']!r}: give an upscaler's name (letters, digits, '.', '_', "
            "'-') and a hires_scale above 1 (the pass is off at 1)",
        )
    if checked["control_net"] and not LORA_NAME.match(checked["control_net"]):
        raise InvalidParameterError(
            "control_net",
            f"{checked['control_net']!r} is not a ControlNet name (letters, digits, '.', '_', '-')",
        )
    if checked["control_net"] and checked["control_image"] is None:
        raise InvalidParameterError(
            "control_net", "needs a control_image: the image the ControlNet follows"
        )
    if checked["control_net"] and checked["hires_scale"] > 1.0:
        # The runtime's hires pass reuses the first pass's control hint at the first pass's
        # size: where the sizes divide it tiles the hint over the larger latent, where they
        # do not (72x64 x2 on SD 1.x: 128x64 -> 192x128) ggml aborts the process
        # (GGML_ASSERT ggml_can_repeat; tests/e2e/test_controlnet.py keeps it refused).
        raise InvalidParameterError(
            "hires_scale",
            "a ControlNet job cannot have a high-resolution pass: the runtime's second pass "
            "reuses the first pass's control hint at the first pass's size (it tiles it, or "
            "aborts the process where the sizes do not divide); use hires_scale 1",
        )
    if checked["control_image"] is not None and not checked["control_net"]:
        raise InvalidParameterError(
            "control_image", "needs a control_net: the ControlNet that reads it"
        )
    if checked["mask_image"] is not None and checked["init_image"] is None:
        raise InvalidParameterError(
            "mask_image", "needs an init_image: the mask says which part of it is redrawn"
        )
    if checked["seed"] == RANDOM_SEED:
        checked["seed"] = secrets.randbelow(2**31)
    return replace(params, **checked)


def check_options(options: JobOptions) -> JobOptions:
    """A checked copy of `options`, or InvalidParameterError naming the bad option."""
    return replace(options, **{p.name: p.check(getattr(options, p.name)) for p in OPTIONS})


def detach_images(params: GenerationParams) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(the parameters with each image named by its digest, {input name: image bytes}): how a
    job travels, its images beside its parameters. A list parameter's images are named
    `{name}:{i}`."""
    inputs: dict[str, bytes] = {}
    for p in IMAGE_PARAMS:
        value = getattr(params, p.name)
        if p.kind == "image" and value is not None:
            inputs[p.name] = value
        elif p.kind == "images":
            inputs.update({f"{p.name}:{i}": v for i, v in enumerate(value)})
    return params.as_dict(), inputs


def attach_images(values: dict[str, Any], inputs: dict[str, bytes]) -> dict[str, Any]:
    """The parameters of `detach_images` with each digest replaced by its image, which must
    match it; InvalidParameterError when an image is missing or does not match."""
    out = dict(values)
    for p in IMAGE_PARAMS:
        value = out.get(p.name)
        if p.kind == "image" and value is not None:
            out[p.name] = attached_image(p.name, value, inputs.get(p.name))
        elif p.kind == "images" and value:
            out[p.name] = tuple(
                attached_image(f"{p.name}[{i}]", v, inputs.get(f"{p.name}:{i}"))
                for i, v in enumerate(value)
            )
    return out


def attached_image(name: str, want: Any, data: bytes | None) -> bytes:
    """The input image that travelled beside a job's parameters, which must be the one its
    digest `want` names; InvalidParameterError naming parameter `name` otherwise."""
    if data is None:
        raise InvalidParameterError(name, "its image did not arrive with the job (expired?)")
    if images.digest(data) != want:
        raise InvalidParameterError(name, f"the image that arrived is not {want}")
    return data


def read_image_files(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each input image given as a file path (str or os.PathLike) read into its
    bytes: the doors that take paths (the CLI, a batch file, a Python caller) go through here;
    an unreadable file is an InvalidParameterError naming the parameter."""
    out = dict(values)
    for p in IMAGE_PARAMS:
        value = out.get(p.name)
        if p.kind == "image" and isinstance(value, str | os.PathLike):
            out[p.name] = read_image(p.name, value)
        elif p.kind == "images" and isinstance(value, list | tuple):
            out[p.name] = [
                read_image(f"{p.name}[{i}]", v) if isinstance(v, str | os.PathLike) else v
                for i, v in enumerate(value)
            ]
    return out


def read_image(name: str, path: str | os.PathLike[str]) -> bytes:
    """The bytes of image file `path` (at most one byte over the cap, which the check then
    refuses); InvalidParameterError naming parameter `name` when unreadable."""
    try:
        with open(path, "rb") as f:
            return f.read(images.MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise InvalidParameterError(
            name, f"cannot read {os.fspath(path)!r}: {exc.strerror or exc}"
        ) from None


LORA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _loras(name: str, value: Any, most: int) -> tuple[tuple[str, float], ...]:
    """LoRA (name, weight) pairs from a list of pairs, {"name", "weight"} objects or
    "NAME:WEIGHT" strings (a weight left out is 1); each name once."""
    if not isinstance(value, list | tuple):
        raise InvalidParameterError(name, f"must be a list of LoRAs, got {value!r}")
    if len(value) > most:
        raise InvalidParameterError(name, f"has {len(value)} LoRAs, at most {most}")
    out: list[tuple[str, float]] = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if isinstance(item, str):
            lora, _, weight = item.partition(":")
            item = (lora, weight or 1.0)
        elif isinstance(item, dict):
            item = (item.get("name"), item.get("weight", 1.0))
        if not (isinstance(item, list | tuple) and len(item) == 2):
            raise InvalidParameterError(where, f"must be NAME:WEIGHT, got {item!r}")
        lora = item[0]
        if not isinstance(lora, str) or not LORA_NAME.match(lora):
            raise InvalidParameterError(
                where, f"{lora!r} is not a LoRA name (letters, digits, '.', '_', '-')"
            )
        weight = _float(where, item[1])
        if not math.isfinite(weight) or abs(weight) > MAX_LORA_WEIGHT:
            raise InvalidParameterError(
                where, f"weight {weight} is outside {-MAX_LORA_WEIGHT:g}..{MAX_LORA_WEIGHT:g}"
            )
        if any(lora == seen for seen, _ in out):
            raise InvalidParameterError(where, f"LoRA {lora!r} is listed twice")
        out.append((lora, weight))
    return tuple(out)


def _names(name: str, value: Any, most: int) -> str:
    """Asset names from "a,b" or a list of names: each a plain name, each once (the runtime
    lowercases them, so "A" and "a" are one), at most `most`; returned sorted and
    comma-joined, the one spelling every door and the engine key share."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        raise InvalidParameterError(name, f"must be comma-separated names, got {value!r}")
    if len(items) > most:
        raise InvalidParameterError(name, f"has {len(items)} names, at most {most}")
    seen: dict[str, str] = {}
    for item in items:
        if not isinstance(item, str) or not LORA_NAME.match(item):
            raise InvalidParameterError(
                name, f"{item!r} is not a name (letters, digits, '.', '_', '-')"
            )
        if item.lower() in seen:
            raise InvalidParameterError(
                name, f"{item!r} is listed twice (the runtime matches names in lower case)"
            )
        seen[item.lower()] = item
    return ",".join(sorted(seen.values()))


def _cells(x: float) -> int:
    """`x` pixels rounded to the runtime's 8-pixel latent cells."""
    return max(SIZE_STEP, int(round(x / SIZE_STEP)) * SIZE_STEP)
