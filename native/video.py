"""Video models and the video job on a loaded engine (`generate_video` of master-596).

Which models make video, read from their headers as the runtime reads them (src/model.cpp
get_sd_version, src/wan.hpp WanRunner):
- a diffusion model with `blocks.0.cross_attn.norm_k.weight` is a Wan DiT; its layer count is
  one more than the highest `blocks.N.`, and the runtime builds only 30 layers (Wan 2.1 1.3B,
  Wan 2.2 TI2V 5B) or 40 (the 14B models): any other count ends the process
  (GGML_ABORT "invalid num_layers"), so `check_header` refuses it before any load;
- `img_emb.*` makes it image-to-video (Wan 2.1 I2V, with `img_emb.emb_pos` first-last-frame),
  `vace_blocks.*` a VACE model, the patch embedding's channels (product of all but the three
  kernel dims) 147456 the Wan 2.2 TI2V 5B and 184320 the Wan 2.2 I2V 14B.

What the runtime reads of a job's images (prepare_video_generation_latents):
- Wan 2.2 TI2V 5B: init_image (the first frame); end_image is ignored;
- Wan 2.2 I2V 14B: init_image and end_image (first and last frame);
- VACE: init_image as the reference image;
- Wan 2.1 I2V and FLF2V (a DiT with `img_emb.*`; FLF2V-14B also has `img_emb.emb_pos`, the
  first-last-frame position embedding): init_image and end_image. The runtime pins both as
  the first and last frames of the conditioning latent (with their mask) and encodes the
  init image (FLF2V-14B also the end image) through a CLIP vision encoder, the model's
  clip_vision file. It builds that encoder for every Wan2.1 I2V DiT and fails to load one
  without it (`check_clip_vision` refuses it first; a clip_vision file beside any other
  model would be read and ignored, so it is refused too). A 30-layer DiT with emb_pos ends
  the process at its first step (MLPProj slices 514 CLIP tokens out of the one image's 257
  that the runtime gives a DiT it names Wan2.1-I2V-1.3B), so `check_header` refuses it;
- text-to-video (Wan 2.1 T2V 1.3B, Wan 2.x T2V 14B): neither.
The SVD UNet, which the runtime also runs through generate_video, is not offered (no sdfarm
test loads one).

Wan 2.2's A14B models are pairs of DiTs (MoE experts of one variant): the runtime loads the
second as `high_noise_diffusion_model` (master-596 new_sd_ctx), keeps both loaded, samples the
first steps with it, until the schedule's sigma falls below `moe_boundary` (or for
`high_noise_steps` steps), and the rest with the diffusion_model (generate_video). A
high-noise file that is not a Wan DiT gives a Wan runner of 0 layers, which ends the process
(GGML_ABORT "invalid num_layers"), so `check_pair` refuses it before any load.

A Wan model without a umT5-XXL file loads and generates: the runtime conditions on zeros and
the prompt does nothing (measured with sdfarm's test model: "a cat" and "a dog" give the same
bytes); the result's warnings say so.
"""

from __future__ import annotations

import io
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from PIL import Image

from sdfarm.native import logs, memory, videofile
from sdfarm.native.errors import (
    GenerationError,
    InvalidParameterError,
    ModelLoadError,
    ModelTooLargeError,
)
from sdfarm.native.headers import FileHeader
from sdfarm.native.roles import CLIP_VISION, HIGH_NOISE
from sdfarm.native.video_params import SAME_AS_LOW, VideoParams, validate

if TYPE_CHECKING:
    from sdfarm.native.engine import Engine, LogConfig
    from sdfarm.native.model import Model

WAN_LAYERS = (30, 40)
"""The layer counts the runtime's Wan DiT builds (any other aborts the process)."""
_PREFIX = re.compile(r"^(?:model\.diffusion_model\.)")
_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")
_VACE_BLOCK = re.compile(r"(?:^|\.)vace_blocks\.(\d+)\.")
WAN_MARKER = "blocks.0.cross_attn.norm_k.weight"
TI2V_CHANNELS = 147456
I2V_22_CHANNELS = 184320
CLIP_VISION_NEEDED = ("Wan2.1-I2V-14B", "Wan2.1-I2V-1.3B", "Wan2.1-FLF2V-14B")
"""The DiTs the runtime builds a CLIP vision encoder for (new_sd_ctx of master-596)."""
FLF_MARKER = "img_emb.emb_pos"
ADD_CLIP_VISION = (
    f"add a {CLIP_VISION} file (OpenCLIP ViT-H/14's vision tower, e.g. clip_vision_h) to the "
    f'model folder, named in model.json as "files": {{"{CLIP_VISION}": "FILE"}} or found by '
    "its tensor names"
)
READERS = {
    "init_image": "Wan2.2-TI2V-5B, Wan2.2-I2V-14B, a VACE model or a Wan2.1 I2V / FLF2V "
    "model with a clip_vision file",
    "end_image": "Wan2.2-I2V-14B or a Wan2.1 I2V / FLF2V model with a clip_vision file",
}
NO_PROMPT_WARNING = (
    "the model has no text encoder (umT5-XXL): the runtime conditions on nothing and the "
    "prompt has no effect"
)


@dataclass(frozen=True)
class VideoModel:
    """What the runtime makes of a Wan DiT: its name in the runtime's log (`desc`), its layer
    count, which input images it reads, and whether the model has its text encoder."""

    desc: str
    layers: int
    init_image: bool
    end_image: bool
    text_encoder: bool
    moe: bool = False
    """Whether it has a high-noise expert (a Wan 2.2 pair): the high-noise parameters apply."""
    first_last: bool = False
    """A Wan2.1 DiT with img_emb.emb_pos: trained on a first and a last frame (FLF2V)."""
    clip_vision: bool = False
    """Whether the model holds a clip_vision file (a Wan2.1 I2V / FLF2V DiT needs one)."""

    @property
    def needs_clip_vision(self) -> bool:
        """Whether the runtime reads this DiT's images through a CLIP vision encoder."""
        return self.desc in CLIP_VISION_NEEDED

    def refuse_images(self, params: VideoParams) -> None:
        """InvalidParameterError naming an input image this model does not read, or reads
        only through a CLIP vision encoder the model lacks."""
        for name, takes in (("init_image", self.init_image), ("end_image", self.end_image)):
            if getattr(params, name) is None:
                continue
            if takes and not (self.needs_clip_vision and not self.clip_vision):
                continue
            if takes:
                why = (
                    "the runtime conditions on it through a CLIP vision encoder, which this "
                    f"model lacks: {ADD_CLIP_VISION}"
                )
            else:
                why = "the runtime ignores it for this model"
            raise InvalidParameterError(
                name, f"{self.desc} takes no {name}: {why} (use {READERS[name]})"
            )

    def check(self, params: VideoParams) -> None:
        """InvalidParameterError naming an input image or a high-noise parameter this model
        does not read (the runtime would ignore it silently)."""
        self.refuse_images(params)
        given = params.moe_given
        if given and not self.moe:
            raise InvalidParameterError(
                given[0],
                f"{self.desc} without a high-noise expert takes no {given[0]}: the runtime "
                f"reads it only for a Wan 2.2 pair (a model with a {HIGH_NOISE} file)",
            )


def _names(header: FileHeader) -> list[str]:
    return [_PREFIX.sub("", n, count=1) for n in header.tensors]


def is_wan(header: FileHeader) -> bool:
    """Whether the runtime would take this diffusion model (or checkpoint) for a Wan DiT."""
    return any(n == WAN_MARKER for n in _names(header))


def wan_layers(header: FileHeader) -> int:
    """The layer count the runtime reads from a Wan DiT's tensor names (VACE blocks apart)."""
    most = 0
    for n in _names(header):
        if _VACE_BLOCK.search(n):
            continue
        m = _BLOCK.search(n)
        if m:
            most = max(most, int(m.group(1)) + 1)
    return most


def check_header(header: FileHeader, what: str) -> None:
    """ModelLoadError for a Wan DiT the runtime would abort on (a layer count it does not
    build); nothing for any other file. `what` names the file in the message."""
    if not is_wan(header):
        return
    layers = wan_layers(header)
    if layers not in WAN_LAYERS:
        raise ModelLoadError(
            f"{what}: a Wan diffusion model with {layers} layers; the runtime builds only "
            f"{' or '.join(map(str, WAN_LAYERS))} (Wan 2.1 1.3B / Wan 2.2 5B, or the 14B models) "
            "and ends the process on any other count, so it is not loaded",
            role="diffusion_model",
        )
    if layers == 30 and any(FLF_MARKER in n for n in _names(header)):
        raise ModelLoadError(
            f"{what}: a 30-layer Wan diffusion model with {FLF_MARKER} (first-last-frame at "
            "the 1.3B width): the runtime gives it one image's 257 CLIP vision tokens where "
            "emb_pos takes 514 and ends the process at the first step (it runs first-last-"
            "frame only for the 40-layer Wan2.1-FLF2V-14B), so it is not loaded",
            role="diffusion_model",
        )


def _patch_channels(header: FileHeader) -> int:
    for name, info in header.tensors.items():
        if _PREFIX.sub("", name, count=1) == "patch_embedding.weight" and len(info.shape) >= 4:
            channels = 1
            for d in info.shape[:-3]:
                channels *= d
            return channels
    return 0


def describe(header: FileHeader, text_encoder: bool) -> VideoModel | None:
    """The runtime's reading of a Wan DiT's header (None for any other file)."""
    if not is_wan(header):
        return None
    names = _names(header)
    layers = wan_layers(header)
    i2v = any("img_emb" in n for n in names)
    flf = any(FLF_MARKER in n for n in names)
    vace = any(_VACE_BLOCK.search(n) for n in names)
    channels = _patch_channels(header)
    if layers == 30:
        if channels == TI2V_CHANNELS and not i2v:
            return VideoModel("Wan2.2-TI2V-5B", layers, True, False, text_encoder)
        if vace:
            return VideoModel("Wan2.1-VACE-1.3B", layers, True, False, text_encoder)
        if i2v:  # the runtime's name whether or not it has emb_pos (check_header)
            return VideoModel("Wan2.1-I2V-1.3B", layers, True, True, text_encoder, first_last=flf)
        return VideoModel("Wan2.1-T2V-1.3B", layers, False, False, text_encoder)
    if not i2v:
        if channels == I2V_22_CHANNELS:
            return VideoModel("Wan2.2-I2V-14B", layers, True, True, text_encoder)
        if vace:
            return VideoModel("Wan2.x-VACE-14B", layers, True, False, text_encoder)
        return VideoModel("Wan2.x-T2V-14B", layers, False, False, text_encoder)
    desc = "Wan2.1-FLF2V-14B" if flf else "Wan2.1-I2V-14B"
    return VideoModel(desc, layers, True, True, text_encoder, first_last=flf)


def check_pair(files: Mapping[str, tuple[FileHeader, str]], name: str) -> None:
    """ModelLoadError for a high_noise_diffusion_model the runtime would abort on or misuse;
    `files` maps roles to (header, file name). It must be a Wan DiT (any other file gives the
    runtime a Wan runner of 0 layers: GGML_ABORT), beside a Wan diffusion model (elsewhere
    the runtime never reads it), of the same variant (the experts of one model share its
    version, input channels and images)."""
    high = files.get(HIGH_NOISE)
    if high is None:
        return
    main = files.get("diffusion_model") or files.get("checkpoint")
    high_vm = describe(high[0], False)
    what = f"{HIGH_NOISE} file {high[1]} of model {name}"
    if high_vm is None:
        raise ModelLoadError(
            f"{what} is not a Wan diffusion model (no {WAN_MARKER}): the runtime would build a "
            "Wan runner of 0 layers and end the process, so it is not loaded",
            role=HIGH_NOISE,
        )
    main_vm = describe(main[0], False) if main is not None else None
    if main_vm is None:
        raise ModelLoadError(
            f"{what}: a high-noise expert belongs beside a Wan diffusion_model (a Wan 2.2 "
            "pair); the runtime ignores it for any other model",
            role=HIGH_NOISE,
        )
    if main_vm.desc != high_vm.desc:
        raise ModelLoadError(
            f"{what} is {high_vm.desc}, its diffusion_model {main[1]} is {main_vm.desc}: the "
            "two experts of a pair must be the same Wan variant",
            role=HIGH_NOISE,
        )


def check_clip_vision(files: Mapping[str, tuple[FileHeader, str]], name: str) -> None:
    """ModelLoadError for a Wan2.1 image-to-video DiT without a clip_vision file (the runtime
    builds its CLIP vision encoder and fails the load on the missing tensors, hundreds of
    error records) and for a clip_vision file beside any other model (the runtime reads it
    only for those DiTs: it would lie unused). `files` maps roles to (header, file name)."""
    main = files.get("diffusion_model") or files.get("checkpoint")
    vm = describe(main[0], False) if main is not None else None
    needs = vm is not None and vm.needs_clip_vision
    vision = files.get(CLIP_VISION)
    if vision is None and vm is not None and main is not None and needs:
        raise ModelLoadError(
            f"model {name}: its diffusion model {main[1]} is {vm.desc}"
            f"{' (first-last-frame)' if vm.first_last else ''}, which the runtime loads only "
            f"with a CLIP vision encoder for its input images; {ADD_CLIP_VISION}",
            role=CLIP_VISION,
        )
    if vision is not None and not needs:
        what = vm.desc if vm is not None else "not a Wan2.1 image-to-video model"
        raise ModelLoadError(
            f"{CLIP_VISION} file {vision[1]} of model {name}: the runtime reads a CLIP vision "
            f"encoder only for a Wan2.1 I2V / FLF2V diffusion model (img_emb.*), and this "
            f"model's is {what}; remove the file or name it in another model",
            role=CLIP_VISION,
        )


def video_model(model: Model) -> VideoModel | None:
    """The video model `model` is (its diffusion model's or checkpoint's reading), or None for
    an image model. Read once per Model object and kept in its `__dict__` (a frozen
    dataclass's cache, as functools.cached_property keeps one): the worker asks for every job
    and the catalog hands it the same Model until a file changes."""
    memo = getattr(model, "__dict__", None)
    if memo is not None and "_video_model" in memo:
        return memo["_video_model"]
    found = _read_video_model(model)
    if memo is not None:
        memo["_video_model"] = found
    return found


def _read_video_model(model: Model) -> VideoModel | None:
    main = model.files.get("diffusion_model") or model.files.get("checkpoint")
    header = getattr(main, "header", None)
    if not isinstance(header, FileHeader):
        return None
    text = "t5xxl" in model.files or any(
        n.startswith("text_encoders.t5xxl.")
        for f in model.files.values()
        for n in getattr(getattr(f, "header", None), "tensors", ())
    )
    found = describe(header, text)
    if found is not None and HIGH_NOISE in model.files:
        found = replace(found, moe=True)
    if found is not None and CLIP_VISION in model.files:
        found = replace(found, clip_vision=True)
    return found


def require_video_model(model: Model) -> VideoModel:
    """`model`'s VideoModel; InvalidParameterError (parameter "model") for an image model."""
    found = video_model(model)
    if found is None:
        raise InvalidParameterError(
            "model",
            f"{model.name!r} is not a video model: video jobs need a Wan diffusion model "
            "(generate_video of the runtime); submit an image job for it instead",
        )
    return found


def is_video_model(model: Model) -> bool:
    """Whether `model` makes video only (the runtime has no image generation for it)."""
    return video_model(model) is not None


def refuse_video_model(model: Model) -> None:
    """InvalidParameterError for an image job on a video model: the runtime's generate_image
    does not run Wan models (sd_ctx_supports_image_generation is false for them)."""
    found = video_model(model)
    if found is not None:
        raise InvalidParameterError(
            "model",
            f"{model.name!r} is a video model ({found.desc}): submit a video job "
            "(sdfarm video, Farm.video, POST /v1/videos)",
        )


# -- results -----------------------------------------------------------------------------------


@dataclass
class VideoResult:
    """A video job's frames (PIL images, in order), the video file made of them (an animated
    WebP, or an MP4 when the job asked: `params.format`), and everything needed to reproduce
    and explain them. `images` and `extra` are what the worker stores: the frames as PNGs,
    then the video file."""

    images: list[Image.Image]
    video: bytes
    params: VideoParams
    metadata: dict[str, Any]
    records: list[logs.LogRecord] = field(default_factory=list)

    @property
    def extra(self) -> list[bytes]:
        return [self.video]

    @property
    def webp(self) -> bytes | None:
        """The animated WebP, when the job asked for one (the default)."""
        return self.video if self.params.format == "webp" else None

    @property
    def frames(self) -> list[Image.Image]:
        return self.images


def animated_webp(frames: list[Image.Image], fps: int) -> bytes:
    """The frames as one animated WebP (lossless, looping; each frame 1000/fps ms)."""
    buf = io.BytesIO()
    frames[0].save(
        buf,
        format="WEBP",
        save_all=True,
        append_images=frames[1:],
        duration=max(1, round(1000 / fps)),
        loop=0,
        lossless=True,
        method=0,
    )
    return buf.getvalue()


# -- the native call ---------------------------------------------------------------------------


def generate_video(
    engine: Engine,
    params: VideoParams,
    *,
    progress: Callable[[int, int, float], None] | None = None,
    log: LogConfig | None = None,
    estimate: int | None = None,
) -> VideoResult:
    """Run `params` on `engine` (a loaded Wan model). Everything is checked first: the
    parameters, that the model makes video and reads the images given, the estimate against
    the host. InvalidParameterError / ModelTooLargeError before any native call,
    GenerationError quoting the runtime's errors when it returns no frames."""
    engine._check_usable()
    params = validate(params)
    videofile.check_format(params.format)  # mp4 without its library here: before the call
    vm = require_video_model(engine.model)
    vm.check(params)
    if params.encodes and not engine.model.can_encode:
        raise InvalidParameterError(
            "init_image", f"model {engine.model.name!r} has no VAE encoder for an input image"
        )
    need = estimate or engine.facts.video_estimate(
        params.width, params.height, params.frames, params.encodes
    )
    verdict = engine._verdict
    limit = verdict.refuse_figure
    if verdict.action != "skip" and limit is not None and need > limit:
        raise ModelTooLargeError(
            f"{params.frames} frames of {params.width}x{params.height} need an estimated "
            f"{memory.format_bytes(need)} for {engine.model.name!r}; this host has "
            f"{memory.format_bytes(limit)}",
            need,
            verdict.figures,
        )
    lib = engine._lib
    if not lib.sd_ctx_supports_video_generation(engine._ctx):
        raise InvalidParameterError(
            "model", f"the runtime loaded {engine.model.name!r} as a model without video"
        )
    cfg = log or engine._log
    scrub = logs.Scrubber(
        engine._path_roles, (params.prompt, params.negative_prompt), log_prompts=cfg.log_prompts
    )
    started = time.monotonic()
    with engine._native_lock:
        if log is not None:
            engine._ring.configure(cfg.ring_bytes, cfg.native)
        frames = _run(engine, params, progress)
        raw = engine._drain_raw(scrub)
    seconds = time.monotonic() - started
    records = engine._take_records(raw, cfg)
    if len(frames) != params.frames:
        errors = [r.message for r in raw if r.level == "error"]
        raise GenerationError(
            f"the runtime returned {len(frames)} frames of {params.frames}"
            + (": " + "; ".join(errors) if errors else " and logged no error"),
            records=errors,
        )
    t = time.monotonic()
    if params.format == "mp4":
        video = videofile.mp4(frames, params.fps)
    else:
        video = animated_webp(frames, params.fps)
    encode_s = time.monotonic() - t
    warnings = [r.message for r in raw if r.level == "warn"]
    if not vm.text_encoder:
        warnings = [w for w in warnings if "No text encoders provided" not in w]
        warnings.append(NO_PROMPT_WARNING)
    if verdict.action == "warn":
        warnings.insert(0, verdict.message)
    metadata = {
        **params.as_dict(),
        "kind": "video",
        "model": engine.model.name,
        "video_model": vm.desc,
        "experts": 2 if vm.moe else 1,
        "backend": engine.capabilities.backend,
        "device": engine.capabilities.device,
        "sd_version": engine.capabilities.sd_version,
        "seeds": None,
        "estimate": need,
        "webp_index": len(frames),  # the video file's index, whatever its format
        "video_index": len(frames),
        "warnings": warnings,
        "timings": {"generate_s": round(seconds, 4), f"{params.format}_s": round(encode_s, 4)},
    }
    return VideoResult(frames, video, params, metadata, records)


def _run(
    engine: Engine, params: VideoParams, progress: Callable[[int, int, float], None] | None
) -> list[Image.Image]:
    from sdfarm.native.engine import _enum_index
    from sdfarm.native.images import pixels

    ffi, lib = engine._ffi, engine._lib
    g = ffi.new("sd_vid_gen_params_t*")
    lib.sd_vid_gen_params_init(g)
    prompt = ffi.new("char[]", params.prompt.encode())
    negative = ffi.new("char[]", params.negative_prompt.encode())
    g.prompt, g.negative_prompt = prompt, negative
    g.width, g.height = params.width, params.height
    g.seed = params.seed
    g.video_frames = params.frames
    g.sample_params.sample_steps = params.steps
    g.sample_params.guidance.txt_cfg = params.cfg_scale
    if params.sampler != "default":
        g.sample_params.sample_method = _enum_index(
            lib.sd_sample_method_name, params.sampler, lib.SAMPLE_METHOD_COUNT, ffi
        )
    # Read by the runtime only with a high-noise expert loaded (refused otherwise, above).
    high = g.high_noise_sample_params
    high.sample_steps = params.high_noise_steps
    high.guidance.txt_cfg = (
        params.cfg_scale
        if params.high_noise_cfg_scale == SAME_AS_LOW
        else params.high_noise_cfg_scale
    )
    if params.high_noise_sampler != "default":
        high.sample_method = _enum_index(
            lib.sd_sample_method_name, params.high_noise_sampler, lib.SAMPLE_METHOD_COUNT, ffi
        )
    g.moe_boundary = params.moe_boundary
    if params.scheduler != "default":
        g.sample_params.scheduler = _enum_index(
            lib.sd_scheduler_name, params.scheduler, lib.SCHEDULER_COUNT, ffi
        )
    keep: list[Any] = []
    for name in ("init_image", "end_image"):
        data = getattr(params, name)
        if data is None:
            continue
        raw, _resized = pixels(data, params.width, params.height, False)
        buf = ffi.new("uint8_t[]", raw)
        keep.append(buf)
        setattr(
            g, name, {"width": params.width, "height": params.height, "channel": 3, "data": buf}
        )
    engine.last_call = {
        "kind": "video",
        "prompt": ffi.string(g.prompt).decode(),
        "width": g.width,
        "height": g.height,
        "frames": g.video_frames,
        "steps": g.sample_params.sample_steps,
        "seed": g.seed,
        "cfg_scale": g.sample_params.guidance.txt_cfg,
        "high_noise_steps": high.sample_steps,
        "high_noise_cfg_scale": high.guidance.txt_cfg,
        "moe_boundary": g.moe_boundary,
    }
    lib.sdf_progress_reset()
    done = threading.Event()
    watcher = None
    if progress is not None:
        watcher = threading.Thread(
            target=engine._watch_progress, args=(progress, None, done), daemon=True
        )
        watcher.start()
    count = ffi.new("int*")
    engine.native_calls += 1
    try:
        out = lib.generate_video(engine._ctx, g, count)
    finally:
        done.set()
        if watcher is not None:
            watcher.join()
    if out == ffi.NULL:
        return []
    frames: list[Image.Image] = []
    n = int(count[0])
    try:
        for i in range(n):
            img = out[i]
            if img.data == ffi.NULL or img.width == 0 or img.height == 0:
                continue
            size = img.width * img.height * img.channel
            mode = {3: "RGB", 4: "RGBA", 1: "L"}.get(img.channel, "RGB")
            frames.append(
                Image.frombytes(mode, (img.width, img.height), bytes(ffi.buffer(img.data, size)))
            )
    finally:
        # Each frame's pixels and the array are malloc'd apart (decode_video_outputs and
        # tensor_to_sd_image in master-596).
        _free_frames(ffi, lib, out, n)
    return frames


def _free_frames(ffi: Any, lib: Any, out: Any, n: int) -> None:
    for i in range(n):
        if out[i].data != ffi.NULL:
            lib.free(out[i].data)
    lib.free(out)
