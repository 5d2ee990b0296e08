"""One loaded image-generation engine: `Engine.load`, `generate`, `dispose`, `capabilities`.

The engine keeps weights loaded (`free_params_immediately` off, so the same seed gives the same
image every time) and runs with the settings under which the memory estimate was measured:
flash attention in the diffusion model and direct VAE convolution. It validates everything
before each native call, because the runtime aborts the process on some inputs; an abort
costs the process, so the worker runs engines in a process that owns nothing else.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from PIL import Image

from sdfarm.native import cudnn, images, logs, memory
from sdfarm.native.backendlimits import cuda_size_error, vulkan_attention_error
from sdfarm.native.controlnets import (
    ARCH_CONTEXT,
    CONTROL_HEADS,
    ControlNetFile,
    unet_refusal,
)
from sdfarm.native.decoders import ctx_settings
from sdfarm.native.decoders import resolve as resolve_decoder
from sdfarm.native.devices import (
    Device,
    HostFigures,
    backend_name,
    choose_compute_device,
    gpu_figure,
)
from sdfarm.native.drawsize import Canvas
from sdfarm.native.embeddings import TABLE_BYTES, EmbeddingFile
from sdfarm.native.errors import (
    EnginePoisonedError,
    GenerationError,
    InvalidParameterError,
    ModelLoadError,
    ModelTooLargeError,
)
from sdfarm.native.estimate import (
    VAE_TILE_LATENT,
    ModelFacts,
    model_facts,
    upscaler_facts,
    use_diffusion_conv_direct,
    use_vae_conv_direct,
)
from sdfarm.native.filehash import lora_hash, model_hash
from sdfarm.native.fitplan import FitPlan, plan_fit
from sdfarm.native.gate import GATE
from sdfarm.native.loras import LoraFile
from sdfarm.native.model import Model
from sdfarm.native.params import STEP_CACHES, GenerationParams, validate
from sdfarm.native.preview import Preview, PreviewSlot, mode_for
from sdfarm.native.ring import NATIVE_LOCK, LogRing
from sdfarm.native.roles import ROLE_PARAMS, guess_architecture
from sdfarm.native.tiling import TilingPlan, plan_tiling
from sdfarm.native.upscalers import UpscalerFile
from sdfarm.native.video import (
    VideoResult,
    generate_video,
    is_video_model,
    refuse_video_model,
)
from sdfarm.native.video_params import VideoParams

Watch = tuple[Callable[[int, int, float], None], threading.Event]
"""One call for the progress watcher: the progress callback, and the event set when the call
returns."""

WARMUP = GenerationParams(prompt="warm-up", width=64, height=64, steps=1, seed=1)


@dataclass(frozen=True)
class Capabilities:
    """What this engine runs on and the figures its memory check used."""

    backend: str  # the runtime's backend name, e.g. "CPU" or "Vulkan0"
    device: str  # the compute device, e.g. "CPU", "Vulkan1"
    device_type: str  # cpu / gpu / igpu / accel
    sd_version: str
    estimate: int  # bytes at the model's native size
    native_size: tuple[int, int]
    memory_check: str  # ok / warn / skip (refuse never loads)
    figures: dict[str, int | None]
    fit_plan: dict[str, Any]
    threads: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class GenerationResult:
    """Images (one per batch item) plus everything needed to reproduce and explain them."""

    images: list[Image.Image]
    params: GenerationParams
    metadata: dict[str, Any]
    records: list[logs.LogRecord] = field(default_factory=list)

    @property
    def image(self) -> Image.Image:
        return self.images[0]


@dataclass(frozen=True)
class PreparedGeneration:
    """A generation checked and ready for its native call (`Engine.prepare`): everything the
    call needs, worked out before it. A worker prepares the next job while the current one
    generates and starts it the moment the runtime is free (sdfarm.worker.chain); so a
    preparation holds nothing in the engine's own state, and never changes a call in
    progress."""

    params: GenerationParams  # validated
    canvas: Canvas
    tiling: TilingPlan
    estimate: int
    lora_paths: Mapping[str, Path]
    lora_hashes: Mapping[str, str]
    hires_path: Path | None
    log: LogConfig | None  # this call's log settings, when they override the engine's
    scrub: logs.Scrubber
    progress: Callable[[int, int, float], None] | None = None
    preview: Callable[[Preview], None] | None = None


@dataclass
class NativeOutput:
    """What one generation's native call returned (`Engine.run_prepared`), before its result
    is built (`finish`): the worker builds it on another thread, beside the next native
    call."""

    engine: Engine
    prepared: PreparedGeneration
    images: list[Image.Image]  # as the runtime drew them, uncropped
    raw: list[logs.LogRecord]  # every record of the call (its warnings come from here)
    records: list[logs.LogRecord]  # the ones the caller sees
    notes: list[str]  # what was done to the input images
    seconds: float

    def finish(self) -> GenerationResult:
        return self.engine._result(self)


@dataclass(frozen=True)
class LogConfig:
    """A record reaches the caller when it passes both `level` and `native_level` (default
    none: nothing). Prompt text is redacted from records unless `log_prompts` is set."""

    level: str = "none"
    native_level: str | None = None
    log_prompts: bool = False
    ring_bytes: int = logs.RING_BYTES

    @property
    def native(self) -> str:
        return self.native_level or self.level


@dataclass(frozen=True)
class ModelWith:
    """A model with what its engine's context is made with beside its files: a ControlNet,
    textual-inversion embeddings and the decoder a job asked for ("": the model's own;
    sdfarm.native.enginekey names such an engine). A worker hands this to `Engine.load` as
    the model."""

    model: Model
    control_net: ControlNetFile | None = None
    embeddings: tuple[EmbeddingFile, ...] = ()
    decoder: str = ""


def extras_bytes(
    control_net: ControlNetFile | None, embeddings: tuple[EmbeddingFile, ...] | list
) -> int:
    """What a ControlNet (as the runtime holds it) and embeddings (their files and the f32
    token table they make the runtime keep) add to an engine's bytes; the scheduler adds the
    same from heartbeats (sdfarm.native.enginekey.extra_bytes)."""
    total = control_net.resident_bytes if control_net is not None else 0
    if embeddings:
        total += sum(e.size for e in embeddings) + TABLE_BYTES
    return total


def check_extras(
    model: Model, control_net: ControlNetFile | None, embeddings: tuple[EmbeddingFile, ...]
) -> None:
    """InvalidParameterError naming the field when `model` cannot take the ControlNet or the
    embeddings: the runtime applies ControlNet to SD 1.x/2.x/XL UNets only (of the model's
    text width) and embeddings to CLIP text encoders only (of their widths)."""
    if control_net is None and not embeddings:
        return
    main = model.files.get("checkpoint") or model.files.get("diffusion_model")
    arch = guess_architecture(main.header) if main is not None else "unknown"
    if control_net is not None:
        why = unet_refusal(main.header, arch) if main is not None else "it has no UNet"
        if why is not None:
            raise InvalidParameterError(
                "control_net", f"model {model.name!r} cannot use a ControlNet: {why}"
            )
        want = ARCH_CONTEXT[arch]
        if control_net.context_dim != want:
            raise InvalidParameterError(
                "control_net",
                f"ControlNet {control_net.name!r} is for a text width of "
                f"{control_net.context_dim}, model {model.name!r} ({arch}) has {want}",
            )
    if embeddings:
        widths = {"sd1": (768,), "sd2": (1024,), "sdxl": (768, 1280)}.get(arch)
        if widths is None:
            raise InvalidParameterError(
                "embeddings",
                f"model {model.name!r} ({arch}) has no CLIP text encoder: the runtime reads "
                "embeddings into CLIP only (SD 1.x, 2.x, XL)",
            )
        for e in embeddings:
            if e.width not in widths:
                raise InvalidParameterError(
                    "embeddings",
                    f"embedding {e.name!r} is {e.width} wide; model {model.name!r} ({arch}) "
                    f"takes {' or '.join(map(str, widths))}",
                )


def _resolve_model(model: Model | str | os.PathLike[str] | Mapping[str, str]) -> Model:
    if isinstance(model, Model):
        return model
    if isinstance(model, Mapping):
        return Model.from_files(dict(model))
    return Model.from_dir(Path(model))


class Engine:
    """A model loaded into the runtime. Not thread-safe: one caller at a time (the worker
    gives each engine its own process)."""

    _native_lock = NATIVE_LOCK  # the runtime's callbacks and log ring are process-wide

    def __init__(self) -> None:
        raise TypeError("use Engine.load(model, ...)")

    @classmethod
    def load(
        cls,
        model: Model | str | os.PathLike[str] | Mapping[str, str],
        *,
        device: str = "auto",
        check_memory: bool = True,
        log: LogConfig | None = None,
        threads: int | None = None,
        figures: HostFigures | Callable[[], HostFigures] | None = None,
        pinned: str | None = None,
        warm_up: bool | None = None,
        backend: str | None = None,
        control_net: ControlNetFile | None = None,
        embeddings: Iterable[EmbeddingFile] = (),
        decoder: str = "default",
    ) -> Engine:
        """Check memory, plan the fit, load. `control_net` and `embeddings` (checked files,
        sdfarm.native.controlnets and .embeddings) are made part of the context (a
        `ModelWith` as the model carries them too); the estimate counts them. `decoder` is
        what the engine decodes with (sdfarm.native.decoders: default, vae, taesd; a model
        that lacks it is refused before any native call), fixed for its life. `figures`
        injects the host's figures (or a probe returning them); by default they are read in a
        short-lived subprocess. `pinned` names the device sdfarm pinned this process to (the
        check then runs on its figures).
        `warm_up` (default: on for GPUs) runs one tiny generation so the first job does not
        pay for pipeline compilation."""
        self = object.__new__(cls)
        if isinstance(model, ModelWith):
            control_net = control_net or model.control_net
            embeddings = tuple(embeddings) or model.embeddings
            decoder = model.decoder or decoder
            model = model.model
        self._log = log or LogConfig()
        logs.level_number(self._log.level)
        logs.level_number(self._log.native)
        self.model = _resolve_model(model)
        self.control_net: ControlNetFile | None = control_net
        self.embeddings: dict[str, EmbeddingFile] = {e.name: e for e in embeddings}
        check_extras(self.model, control_net, tuple(self.embeddings.values()))
        self.decoder = resolve_decoder(decoder, self.model.decoders, self.model.name)
        self._ctx = None
        self._poisoned: str | None = None
        self._pending: list[logs.LogRecord] = []
        self.native_calls = 0  # generate/load calls into the runtime (tests assert on it)
        self._watcher: queue.SimpleQueue[Watch | None] | None = None
        self.last_call: dict[str, Any] = {}  # the last generation's parameters, read back
        self.model_hash: str | None = None  # set once the runtime has loaded the model

        figs, planned = host_device(figures, backend, device, pinned)
        w, h = self.model.native_size
        facts = model_facts(self.model, planned, self.decoder)
        extra = extras_bytes(control_net, tuple(self.embeddings.values()))
        self.facts: ModelFacts = facts.with_extras(extra, CONTROL_HEADS if control_net else 0)
        estimate = self.facts.resident()
        verdict = memory.check_memory(estimate, figs, device, pinned=pinned, enabled=check_memory)
        memory.raise_if_refused(verdict)
        self._verdict = verdict
        compute = verdict.compute_device or planned
        work = memory.SEED_OVERHEAD
        self.fit: FitPlan = plan_fit(
            self.model.component_bytes(),
            compute,
            gpu_figure(compute) if compute.type != "cpu" else None,
            work,
        )

        from sdfarm.native.binding import load as load_binding

        self._ffi, self._lib = load_binding(backend)
        self._ring = LogRing(self._ffi, self._lib)
        self._previews = PreviewSlot(self._ffi, self._lib)
        # The kind of preview a job's preview_every gets (sdfarm.native.preview); a caller
        # may change it between generations (bench/preview_cost.py compares them).
        encodes = self.model.can_encode_with(self.decoder)
        self._taesd, self._tae_preview_only = ctx_settings(
            self.model.decoders, self.decoder, self.model.can_encode_with("taesd"), encodes
        )
        self.preview_mode = mode_for({"taesd"} if self._taesd else set())
        self._threads = threads or max(1, (os.cpu_count() or 2))
        self._path_roles = self.model.path_roles()
        if control_net is not None:
            self._path_roles[str(control_net.path)] = f"<control_net {control_net.name} file>"
        for e in self.embeddings.values():
            self._path_roles[str(e.path)] = f"<embedding {e.name} file>"
        self._scrub = logs.Scrubber(self._path_roles, log_prompts=self._log.log_prompts)
        if verdict.action == "warn":
            self._pending.append(self._engine_record("warn", verdict.message))
        self._pending.append(self._engine_record("info", f"fit plan: {self.fit.summary()}"))
        self._env_device(compute, figs, pinned)
        self.capabilities_device = compute.name
        self.architecture = self.model.architecture  # sizes a GPU build cannot draw

        started = time.monotonic()
        with Engine._native_lock:
            self._ring.configure(self._log.ring_bytes, self._log.native)
            self._ctx = self._new_ctx()
            raw = self._drain_raw()
        load_s = time.monotonic() - started
        if self._ctx == self._ffi.NULL:
            self._ctx = None
            errors = [r.message for r in raw if r.level == "error"]
            raise ModelLoadError(
                f"the runtime could not load model {self.model.name!r}: "
                + ("; ".join(errors) if errors else "no error was logged"),
                records=errors,
            )
        self._pending.extend(raw)
        # Once per file version on this host (sdfarm.native.filehash), never per job, and only
        # for a model that loaded: a refused or broken file is never read through.
        main = self.model.files.get("diffusion_model") or self.model.files.get("checkpoint")
        self.model_hash = model_hash(main.path) if main is not None else None
        self.capabilities = Capabilities(
            backend=backend_name(figs),
            device=compute.name,
            device_type=compute.type,
            sd_version=self.sd_version(),
            estimate=estimate,
            native_size=(w, h),
            memory_check=verdict.action,
            figures=verdict.figures,
            fit_plan=self.fit.as_dict(),
            threads=self._threads,
        )
        self.load_seconds = load_s
        self.warmup_seconds = 0.0
        # A video model has no image generation to warm up with (sdfarm.native.video).
        if is_video_model(self.model):
            warm_up = False
        if warm_up if warm_up is not None else compute.type in ("gpu", "igpu"):
            t = time.monotonic()
            self._run(validate(WARMUP), progress=None)
            self.warmup_seconds = time.monotonic() - t
        return self

    # -- native calls --------------------------------------------------------------------

    def _new_ctx(self) -> Any:
        ffi, lib = self._ffi, self._lib
        p = ffi.new("sd_ctx_params_t*")
        lib.sd_ctx_params_init(p)
        keep = []
        for role, mf in self.model.files.items():
            if role == "taesd" and not self._taesd:
                continue
            s = ffi.new("char[]", str(mf.path).encode())
            keep.append(s)
            setattr(p, ROLE_PARAMS[role], s)
        # The encoder too when the model has one (img2img, inpainting); its weights are in the
        # model's files, which the estimate counts whole.
        if self.control_net is not None:
            s = ffi.new("char[]", str(self.control_net.path).encode())
            keep.append(s)
            p.control_net_path = s
        if self.embeddings:
            arr = ffi.new("sd_embedding_t[]", len(self.embeddings))
            keep.append(arr)
            for i, e in enumerate(self.embeddings.values()):
                name = ffi.new("char[]", e.name.encode())
                path = ffi.new("char[]", str(e.path).encode())
                keep += [name, path]
                arr[i] = {"name": name, "path": path}
            p.embeddings, p.embedding_count = arr, len(self.embeddings)
        # The decoder is fixed here (sdfarm.native.decoders): with tae_preview_only the VAE
        # decodes and the TAESD draws only previews; without it the TAESD decodes.
        p.tae_preview_only = self._tae_preview_only
        # Read back from the struct the context is made with: the decoder it fixes.
        taesd_given = p.taesd_path != ffi.NULL and bool(ffi.string(p.taesd_path))
        self._ctx_decoder = "taesd" if taesd_given and not p.tae_preview_only else "vae"
        p.vae_decode_only = not self.model.can_encode_with(self.decoder)
        p.free_params_immediately = False
        p.n_threads = self._threads
        p.diffusion_flash_attn = True
        p.vae_conv_direct = use_vae_conv_direct(self.decoder, self.capabilities_device)
        p.diffusion_conv_direct = use_diffusion_conv_direct(self.capabilities_device)
        p.keep_clip_on_cpu = self.fit.keep_clip_on_cpu
        p.keep_vae_on_cpu = self.fit.keep_vae_on_cpu
        p.offload_params_to_cpu = self.fit.offload_params_to_cpu
        p.max_vram = float(self.fit.max_vram)
        p.lora_apply_mode = lora_apply_mode()
        lib.sdf_progress_reset()
        self.native_calls += 1
        return lib.new_sd_ctx(p)

    def _env_device(self, compute: Device, figs: HostFigures, pinned: str | None) -> None:
        """master-596 selects devices only through environment variables: point SD_VK_DEVICE
        at the chosen Vulkan device unless the user or the worker already pinned one. On CUDA
        name the cuDNN the estimate counted on to our build's convolution (SDFARM_CUDNN: a
        path, or 0), so the runtime never opens another."""
        if compute.name.startswith("CUDA"):
            cudnn.export()
        if pinned or "SD_VK_DEVICE" in figs.env:
            return
        if compute.name.startswith("Vulkan"):
            os.environ["SD_VK_DEVICE"] = compute.name[len("Vulkan") :]

    def _run(
        self,
        params: GenerationParams,
        progress: Callable[[int, int, float], None] | None,
        tiled: bool = False,
        preview: Callable[[Preview], None] | None = None,
        canvas: Canvas | None = None,
        lora_paths: Mapping[str, Path] | None = None,
        hires_path: Path | None = None,
        notes: list[str] | None = None,
    ) -> list[Image.Image]:
        """Call the runtime for `params` at the sizes it draws (`canvas`, by default the job's
        own sizes): the images as it returns them, uncropped. `lora_paths` and `hires_path`
        are the checked files of its LoRAs and hires upscaler; what was done to its input
        images is appended to `notes`."""
        ffi, lib = self._ffi, self._lib
        if canvas is None:
            canvas = Canvas.of((params.width, params.height), params.final_size, 1)
        g = ffi.new("sd_img_gen_params_t*")
        lib.sd_img_gen_params_init(g)
        prompt = ffi.new("char[]", params.prompt.encode())
        negative = ffi.new("char[]", params.negative_prompt.encode())
        g.prompt = prompt
        g.negative_prompt = negative
        g.width, g.height = canvas.drawn
        g.seed = params.seed
        g.batch_count = params.batch_count
        g.clip_skip = params.clip_skip
        g.sample_params.sample_steps = params.steps
        g.sample_params.guidance.txt_cfg = params.cfg_scale
        keep = self._set_images(g, params, canvas, [] if notes is None else notes)
        g.cache.mode = STEP_CACHES.index(params.step_cache)  # the runtime's enum order
        if params.hires_scale > 1.0:
            g.hires.enabled = True
            g.hires.upscaler = lib.SD_HIRES_UPSCALER_LATENT
            g.hires.scale = params.hires_scale
            g.hires.target_width, g.hires.target_height = canvas.final_drawn
            g.hires.steps = params.hires_steps
            g.hires.denoising_strength = params.hires_strength
            if hires_path is not None:
                path = self._ffi.new("char[]", str(hires_path).encode())
                keep.append(path)
                g.hires.upscaler = lib.SD_HIRES_UPSCALER_MODEL
                g.hires.model_path = path
        g.hires.upscale_tile_size = params.hires_tile_size
        keep += self._set_loras(g, params, lora_paths or {})
        if tiled:
            # A tile of VAE_TILE_LATENT latent cells a side, the runtime's own overlap.
            g.vae_tiling_params.enabled = True
            g.vae_tiling_params.tile_size_x = VAE_TILE_LATENT
            g.vae_tiling_params.tile_size_y = VAE_TILE_LATENT
        if params.sampler != "default":
            g.sample_params.sample_method = _enum_index(
                lib.sd_sample_method_name, params.sampler, lib.SAMPLE_METHOD_COUNT, ffi
            )
        if params.scheduler != "default":
            g.sample_params.scheduler = _enum_index(
                lib.sd_scheduler_name, params.scheduler, lib.SCHEDULER_COUNT, ffi
            )
        # Previews are armed only for a caller that takes them: each costs a decode.
        self._previews.configure(self.preview_mode, params.preview_every if preview else 0)
        self.last_call = self._read_back(g)
        lib.sdf_progress_reset()
        assert keep is not None  # the input pixels live until the call returns
        done = threading.Event()
        watcher = None
        if preview is not None:  # its last preview must be handed over before the result
            watcher = threading.Thread(
                target=self._watch_progress, args=(progress, preview, done), daemon=True
            )
            watcher.start()
        elif progress is not None:  # the engine's one watcher thread: no thread start here
            self._progress_watcher().put((progress, done))
        self.native_calls += 1
        try:
            GATE.open()
            out = lib.generate_image(self._ctx, g)
        finally:
            GATE.close()
            done.set()
            if watcher is not None:
                watcher.join()
            self._previews.configure("none", 0)
        if out == ffi.NULL:
            return []
        images = []
        try:
            for i in range(params.batch_count):
                img = out[i]
                if img.data == ffi.NULL or img.width == 0 or img.height == 0:
                    continue
                n = img.width * img.height * img.channel
                mode = {3: "RGB", 4: "RGBA", 1: "L"}.get(img.channel, "RGB")
                images.append(
                    Image.frombytes(mode, (img.width, img.height), bytes(ffi.buffer(img.data, n)))
                )
        finally:
            for i in range(params.batch_count):
                if out[i].data != ffi.NULL:
                    lib.free(out[i].data)
            lib.free(out)
        return images

    def _set_images(
        self, g: Any, params: GenerationParams, canvas: Canvas, notes: list[str]
    ) -> list[Any]:
        """Put the job's input images into the call as the runtime reads them (8-bit RGB, a
        mask single-channel, init and mask at the job's size, padded to the size the runtime
        draws: sdfarm.native.drawsize); returns the buffers, which must live until the call
        returns. A resize is noted in `notes`, for the job's warnings."""
        ffi = self._ffi
        keep: list[Any] = []

        def image(data: bytes, size: tuple[int, int] | None, mask: bool, what: str) -> Any:
            w, h = size or _image_size(data)
            raw, resized = images.pixels(data, w, h, mask)
            if resized:
                notes.append(f"{what} was resized to {w}x{h}, the job's size")
            if size is not None:
                raw = canvas.pad(raw, 1 if mask else 3, mask)
                w, h = canvas.drawn
            buf = ffi.new("uint8_t[]", raw)
            keep.append(buf)
            return {"width": w, "height": h, "channel": 1 if mask else 3, "data": buf}

        size = (params.width, params.height)
        if params.init_image is not None:
            g.init_image = image(params.init_image, size, False, "init_image")
            g.strength = params.strength
        if params.mask_image is not None:
            g.mask_image = image(params.mask_image, size, True, "mask_image")
        if params.control_image is not None:
            g.control_image = image(params.control_image, size, False, "control_image")
            g.control_strength = params.control_strength
        if params.ref_images:
            refs = ffi.new("sd_image_t[]", len(params.ref_images))
            for i, data in enumerate(params.ref_images):
                refs[i] = image(data, None, False, f"ref_images[{i}]")
            keep.append(refs)
            g.ref_images, g.ref_images_count = refs, len(params.ref_images)
        return keep

    def _set_loras(self, g: Any, params: GenerationParams, paths: Mapping[str, Path]) -> list[Any]:
        """Put the job's LoRAs into the call (their files resolved by `prepare`)."""
        if not params.loras:
            return []
        ffi = self._ffi
        arr = ffi.new("sd_lora_t[]", len(params.loras))
        keep: list[Any] = [arr]
        for i, (name, weight) in enumerate(params.loras):
            path = ffi.new("char[]", str(paths[name]).encode())
            keep.append(path)
            arr[i] = {"is_high_noise": False, "multiplier": weight, "path": path}
        g.loras, g.lora_count = arr, len(params.loras)
        return keep

    def _read_back(self, g: Any) -> dict[str, Any]:
        """Every job parameter as the native call receives it, read back from its struct (a
        test walks each parameter through every door to here)."""
        ffi, lib = self._ffi, self._lib
        sp = g.sample_params

        def name(of: Callable[[int], Any], index: int, count: int) -> str:
            return ffi.string(of(index)).decode() if 0 <= index < count else "default"

        return {
            "prompt": ffi.string(g.prompt).decode(),
            "negative_prompt": ffi.string(g.negative_prompt).decode(),
            "width": g.width,
            "height": g.height,
            "steps": sp.sample_steps,
            "seed": g.seed,
            "cfg_scale": sp.guidance.txt_cfg,
            "sampler": name(lib.sd_sample_method_name, sp.sample_method, lib.SAMPLE_METHOD_COUNT),
            "scheduler": name(lib.sd_scheduler_name, sp.scheduler, lib.SCHEDULER_COUNT),
            "batch_count": g.batch_count,
            "clip_skip": g.clip_skip,
            "init_image": _shape(g.init_image, ffi),
            "strength": g.strength,
            "mask_image": _shape(g.mask_image, ffi),
            "control_image": _shape(g.control_image, ffi),
            "control_strength": g.control_strength if g.control_image.data != ffi.NULL else None,
            "control_net": self.control_net.name if self.control_net is not None else "",
            "embeddings": ",".join(sorted(self.embeddings)),
            "decoder": self._ctx_decoder,  # the context's (sdfarm.native.decoders)
            "ref_images": [_shape(g.ref_images[i], ffi) for i in range(g.ref_images_count)],
            "loras": [
                [Path(ffi.string(g.loras[i].path).decode()).stem, g.loras[i].multiplier]
                for i in range(g.lora_count)
            ],
            "hires_scale": g.hires.scale if g.hires.enabled else 1.0,
            "hires_steps": g.hires.steps,
            "hires_strength": g.hires.denoising_strength,
            "hires_size": f"{g.hires.target_width}x{g.hires.target_height}",
            "hires_upscaler": Path(ffi.string(g.hires.model_path).decode()).stem
            if g.hires.upscaler == lib.SD_HIRES_UPSCALER_MODEL
            else "",
            "hires_tile_size": g.hires.upscale_tile_size,
            "step_cache": STEP_CACHES[g.cache.mode],
            "vae_tiling": "on" if g.vae_tiling_params.enabled else "off",
            "vae_tile_size": [g.vae_tiling_params.tile_size_x, g.vae_tiling_params.tile_size_y],
            "preview_every": self._previews.config()[1],
            "preview_mode": self._previews.config()[0],
        }

    def _progress_watcher(self) -> queue.SimpleQueue[Watch | None]:
        """The queue of this engine's progress watcher: one thread for the engine's life
        (until `dispose`), which watches each call's progress in turn (a thread started and
        joined per call cost its time on the path of every image)."""
        if self._watcher is None:
            calls: queue.SimpleQueue[Watch | None] = queue.SimpleQueue()

            def watch() -> None:
                while (call := calls.get()) is not None:
                    self._watch_progress(call[0], None, call[1])

            threading.Thread(target=watch, name="sdfarm-progress", daemon=True).start()
            self._watcher = calls
        return self._watcher

    def _watch_progress(
        self,
        progress: Callable[[int, int, float], None] | None,
        preview: Callable[[Preview], None] | None,
        done: threading.Event,
    ) -> None:
        """Polls the shim's latest progress and preview from a Python thread: the runtime's
        own thread never calls into Python. A preview the generation made just before it
        ended is still handed over."""
        ffi, lib = self._ffi, self._lib
        step, steps, t, n = (
            ffi.new("int*"),
            ffi.new("int*"),
            ffi.new("float*"),
            ffi.new("uint64_t*"),
        )
        last = -1
        while True:
            finished = done.wait(0.05)
            if finished and preview is None:
                return  # nothing more to hand over
            if progress is not None:
                lib.sdf_progress_get(step, steps, t, n)
                if n[0] != last and steps[0] > 0 and not finished:
                    last = n[0]
                    progress(step[0], steps[0], t[0])
            if preview is not None:
                frame = self._previews.take()
                if frame is not None:
                    preview(frame)
            if finished:
                return

    # -- public API ----------------------------------------------------------------------

    def generate(
        self,
        params: GenerationParams | None = None,
        *,
        progress: Callable[[int, int, float], None] | None = None,
        preview: Callable[[Preview], None] | None = None,
        log: LogConfig | None = None,
        estimate: int | None = None,
        loras: Mapping[str, LoraFile] | None = None,
        tiling: TilingPlan | None = None,
        upscalers: Mapping[str, UpscalerFile] | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        """Generate `params` (or keyword arguments of GenerationParams): `prepare`, then
        `run_prepared`, then the result. `log` overrides the
        engine's log settings for this call (a farm's jobs each choose their level and whether
        prompts stay in records). `estimate` is the job's estimate as the scheduler placed it
        (sdfarm.native.estimate); without it the engine makes it from its own facts. `loras`
        are the checked files (sdfarm.native.loras) of the LoRAs `params` names, `upscalers`
        that of its hires_upscaler (sdfarm.native.upscalers). `tiling` is the plan the
        scheduler placed the job with (sdfarm.native.tiling); without it the engine plans from
        its own figure (`tiling_plan`). With `params.preview_every` set, `preview` gets each
        new preview (sdfarm.native.preview) from the same watcher thread as `progress`, never
        from the runtime's; without a `preview` callback none is made (each costs a decode).
        Raises
        InvalidParameterError before any native call, ModelTooLargeError when the estimate
        at the requested size exceeds what refuses a load, GenerationError quoting the
        runtime's error records."""
        if params is None:
            params = GenerationParams(**kwargs)
        elif kwargs:
            raise TypeError("pass GenerationParams or keyword arguments, not both")
        prepared = self.prepare(
            params, progress=progress, preview=preview, log=log, estimate=estimate,
            loras=loras, tiling=tiling, upscalers=upscalers,
        )  # fmt: skip
        return self.run_prepared(prepared).finish()

    def prepare(
        self,
        params: GenerationParams,
        *,
        progress: Callable[[int, int, float], None] | None = None,
        preview: Callable[[Preview], None] | None = None,
        log: LogConfig | None = None,
        estimate: int | None = None,
        loras: Mapping[str, LoraFile] | None = None,
        tiling: TilingPlan | None = None,
        upscalers: Mapping[str, UpscalerFile] | None = None,
    ) -> PreparedGeneration:
        """Every check of `generate` (its arguments as there), before any native call and
        without touching the runtime: the call, ready to run. Safe on another thread while
        this engine generates (it reads the engine, never changes it)."""
        self._check_usable()
        params = validate(params)
        refuse_video_model(self.model)
        self._check_decoder(params)
        hires_bytes, hires_path = self._hires_upscaler(params, upscalers or {})
        if params.init_image is not None and not self.model.can_encode_with(self.decoder):
            raise InvalidParameterError(
                "init_image",
                f"model {self.model.name!r} cannot encode an image (img2img, inpainting) with "
                f"its {self.decoder}: it has no encoder, only a decoder",
            )
        multiple = self.facts.size_multiple
        canvas = Canvas.of((params.width, params.height), params.final_size, multiple)
        device, heads = self.capabilities_device, self.facts.control_heads
        for w, h in {canvas.drawn, canvas.final_drawn}:
            if why := cuda_size_error(self.architecture, device, w, h):
                raise InvalidParameterError("width", why)
            if why := vulkan_attention_error(device, w, h, heads, "ControlNet"):
                raise InvalidParameterError("width", why)
        self._check_engine_extras(params)
        files = loras or {}
        missing = [name for name, _ in params.loras if name not in files]
        if missing:
            raise InvalidParameterError("loras", f"unknown LoRA {missing[0]!r}")
        lora_paths = {name: files[name].path for name, _ in params.loras}
        lora_hashes = {
            name: lora_hash(files[name].path, {"sshs_model_hash": files[name].stored_hash})
            for name, _ in params.loras
        }
        lora_bytes = sum(files[name].size for name, _ in params.loras)
        if tiling is None:
            tiling = self.tiling_plan(params, lora_bytes + hires_bytes)
        tiling = self._vulkan_decode(params, tiling, canvas.final_drawn, lora_bytes + hires_bytes)
        size_estimate = estimate or tiling.estimate
        limit = self._verdict.refuse_figure
        if self._verdict.action != "skip" and limit is not None and size_estimate > limit:
            tiled = self.estimate_for(
                *params.final_size, params.encodes, lora_bytes + hires_bytes, tiled=True,
                batch=params.batch_count,
            )  # fmt: skip
            hint = (
                f". Decoded in tiles (vae_tiling auto or on) it would need "
                f"{memory.format_bytes(tiled)}"
                if not tiling.tiled and tiled < size_estimate
                else ""
            )
            raise ModelTooLargeError(
                f"{params.width}x{params.height} needs an estimated "
                f"{memory.format_bytes(size_estimate)} for {self.model.name!r} (the estimate "
                f"grows above the native {self.capabilities.native_size[0]}x"
                f"{self.capabilities.native_size[1]}"
                f"{', decoded in tiles' if tiling.tiled else ''}); this host has "
                f"{memory.format_bytes(limit)}{hint}",
                size_estimate,
                self._verdict.figures,
            )
        cfg = log or self._log
        lora_labels = {str(path): f"<lora {name} file>" for name, path in lora_paths.items()}
        if hires_path is not None:
            lora_labels[str(hires_path)] = f"<upscaler {params.hires_upscaler} file>"
        scrub = logs.Scrubber(
            {**self._path_roles, **lora_labels},
            (params.prompt, params.negative_prompt),
            log_prompts=cfg.log_prompts,
        )
        return PreparedGeneration(
            params, canvas, tiling, size_estimate, lora_paths, lora_hashes, hires_path, log,
            scrub, progress, preview,
        )  # fmt: skip

    def run_prepared(self, prepared: PreparedGeneration) -> NativeOutput:
        """The native call of a prepared generation, and nothing else that can wait: what it
        returned, whose result `NativeOutput.finish` builds. GenerationError (quoting the
        runtime's error records) when it made no image."""
        self._check_usable()
        p, log = prepared, prepared.log
        cfg = log or self._log
        notes: list[str] = []
        started = time.monotonic()
        with Engine._native_lock:
            if log is not None:
                self._ring.configure(cfg.ring_bytes, cfg.native)
            images = self._run(
                p.params, p.progress, p.tiling.tiled, p.preview, p.canvas, p.lora_paths,
                p.hires_path, notes,
            )  # fmt: skip
            raw = self._drain_raw(p.scrub)
        seconds = time.monotonic() - started
        records = self._take_records(raw, cfg)
        if not images:
            errors = [r.message for r in raw if r.level == "error"]
            self._poisoned = poison_reason(errors)
            raise GenerationError(
                "the runtime returned no image"
                + (": " + "; ".join(errors) if errors else " and logged no error"),
                records=errors,
            )
        return NativeOutput(self, prepared, images, raw, records, notes, seconds)

    def _result(self, out: NativeOutput) -> GenerationResult:
        """The result of a generation's native call: its images cropped to the job's size,
        its warnings and its metadata (`NativeOutput.finish`; reads the engine only)."""
        p = out.prepared
        params, canvas, tiling, raw = p.params, p.canvas, p.tiling, out.raw
        multiple = self.facts.size_multiple
        warnings = [r.message for r in raw if r.level == "warn"] + out.notes
        drawn = out.images[0].size  # what the runtime really drew, before the crop
        images = [canvas.crop(im) for im in out.images]
        if drawn != images[0].size:
            warnings.append(canvas.warning(self.model.name, multiple, drawn))
        if tiling.warning:
            warnings.append(tiling.warning)
        if self._verdict.action == "warn":
            warnings.insert(0, self._verdict.message)
        # The result and the PNG say which decoder made the image, not "default".
        params = replace(params, decoder=self.decoder)
        metadata = {
            **params.as_dict(),
            "model": self.model.name,
            **({"model_hash": self.model_hash} if self.model_hash else {}),
            **({"lora_hashes": dict(p.lora_hashes)} if p.lora_hashes else {}),
            "backend": self.capabilities.backend,
            "device": self.capabilities.device,
            "sd_version": self.capabilities.sd_version,
            "seeds": [params.seed + i for i in range(len(images))],
            **({"drawn_size": list(drawn)} if drawn != images[0].size else {}),
            "estimate": p.estimate,
            "vae_tiled": tiling.tiled,
            "fit_plan": self.fit.as_dict(),
            "warnings": warnings,
            "timings": {"generate_s": round(out.seconds, 4)},
        }
        return GenerationResult(images, params, metadata, out.records)

    def video(
        self,
        params: VideoParams | None = None,
        *,
        progress: Callable[[int, int, float], None] | None = None,
        log: LogConfig | None = None,
        estimate: int | None = None,
        **kwargs: Any,
    ) -> VideoResult:
        """Make a video of `params` (or keyword arguments of VideoParams) with this engine's
        Wan model: frames plus an animated WebP (sdfarm.native.video.generate_video, which
        checks everything before the native call)."""
        if params is None:
            params = VideoParams(**kwargs)
        elif kwargs:
            raise TypeError("pass VideoParams or keyword arguments, not both")
        return generate_video(self, params, progress=progress, log=log, estimate=estimate)

    def _check_decoder(self, params: GenerationParams) -> None:
        """A job's decoder must be this engine's (its context has one; sdfarm.native.decoders);
        InvalidParameterError naming `decoder` otherwise."""
        want = resolve_decoder(params.decoder, self.model.decoders, self.model.name)
        if want != self.decoder:
            raise InvalidParameterError(
                "decoder",
                f"the job decodes with {want}"
                + (f" (decoder {params.decoder})" if params.decoder != want else "")
                + f", this engine of "
                f"{self.model.name!r} was loaded with {self.decoder} (the decoder is part of "
                "the engine: load one with it)",
            )

    def _check_engine_extras(self, params: GenerationParams) -> None:
        """A job's ControlNet must be this engine's (its context holds one ControlNet, or
        none) and its embeddings among this engine's; InvalidParameterError naming the field
        otherwise."""
        have = self.control_net.name if self.control_net is not None else ""
        if params.control_net != have:
            raise InvalidParameterError(
                "control_net",
                f"the job asks for ControlNet {params.control_net or 'none'!r}, this engine of "
                f"{self.model.name!r} was loaded with {have or 'none'!r} (a ControlNet is part "
                "of the engine: load one with it)",
            )
        for name in filter(None, params.embeddings.split(",")):
            if name not in self.embeddings:
                raise InvalidParameterError(
                    "embeddings",
                    f"embedding {name!r} is not loaded in this engine of {self.model.name!r} "
                    f"(it has: {', '.join(sorted(self.embeddings)) or 'none'})",
                )

    def _hires_upscaler(
        self, params: GenerationParams, files: Mapping[str, UpscalerFile]
    ) -> tuple[int, Path | None]:
        """Check the hires pass's model upscaler: (the bytes it adds to the estimate,
        `UpscalerFacts.working`; its file for the call). The runtime decodes the first pass,
        upscales the image and encodes it again, so the model needs its encoder."""
        if not params.hires_upscaler:
            return 0, None
        if not self.model.can_encode_with(self.decoder):
            raise InvalidParameterError(
                "hires_upscaler",
                f"model {self.model.name!r} cannot encode the upscaled image: its VAE or TAESD "
                "has no encoder (use the latent upscale: no hires_upscaler)",
            )
        file = files.get(params.hires_upscaler)
        if file is None:
            raise InvalidParameterError(
                "hires_upscaler", f"unknown upscaler {params.hires_upscaler!r}"
            )
        facts = upscaler_facts(file.size, file.scale, self.capabilities_device)
        return facts.working(params.width, params.height, params.hires_tile_size), file.path

    def estimate_for(
        self,
        width: int,
        height: int,
        encodes: bool = False,
        extra_bytes: int = 0,
        tiled: bool = False,
        batch: int = 1,
    ) -> int:
        """This engine's estimate of a width x height job of `batch` images
        (`ModelFacts.estimate`)."""
        return self.facts.estimate(width, height, encodes, extra_bytes, tiled, batch)

    def _vulkan_decode(
        self, params: GenerationParams, plan: TilingPlan, drawn: tuple[int, int], extra: int
    ) -> TilingPlan:
        """`plan`, tiled when an untiled decode would abort the Vulkan build (the full VAE's
        attention past its element limit: sdfarm.native.backendlimits), with a warning that
        says why; InvalidParameterError naming `vae_tiling` when the job forbids tiling."""
        if plan.tiled or not self.facts.decode_attention:
            return plan
        why = vulkan_attention_error(self.capabilities_device, *drawn, 1, "VAE")
        if why is None:
            return plan
        if params.vae_tiling == "off":
            raise InvalidParameterError("vae_tiling", f"{why}; decode it in tiles (auto or on)")
        tiled = self.estimate_for(
            *params.final_size, params.encodes, extra, tiled=True, batch=params.batch_count
        )
        return TilingPlan(True, tiled, f"decoded in tiles: {why}")

    def tiling_plan(self, params: GenerationParams, extra_bytes: int = 0) -> TilingPlan:
        """How this engine decodes `params` when no farm planned it: `plan_tiling` against
        the compute device's figure its memory check read (the GPU's for a GPU, whose
        compute buffers cannot spill; MemAvailable for the CPU), none when unchecked."""
        size = params.final_size
        batch = params.batch_count
        untiled = self.estimate_for(*size, params.encodes, extra_bytes, batch=batch)
        tiled = self.estimate_for(*size, params.encodes, extra_bytes, tiled=True, batch=batch)
        checked = self._verdict.action != "skip"
        figure = self._verdict.compute_figure if checked else None
        return plan_tiling(untiled, tiled, params.vae_tiling, figure)

    def drain_load_records(self) -> list[logs.LogRecord]:
        """Records of the load (and warm-up), once."""
        return self._take_records([])

    def dispose(self) -> list[logs.LogRecord]:
        """Free the context (and end the progress watcher); returns the records logged since
        the last drain."""
        if self._watcher is not None:
            self._watcher.put(None)
            self._watcher = None
        if self._ctx is not None:
            with Engine._native_lock:
                self._lib.free_sd_ctx(self._ctx)
                self._ctx = None
                raw = self._drain_raw()
            self._poisoned = self._poisoned or "disposed"
            return self._take_records(raw)
        return self._take_records([])

    @property
    def poisoned(self) -> str | None:
        """Why this engine refuses work (a GPU error state, or disposed), else None."""
        return self._poisoned

    def sd_version(self) -> str:
        return self._ffi.string(self._lib.sd_version()).decode()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.dispose()

    # -- logs ----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._ctx is None or self._poisoned:
            raise EnginePoisonedError(
                f"engine for {self.model.name!r} cannot generate ({self._poisoned or 'not loaded'})"
                "; load the model again"
            )

    def _engine_record(self, level: str, text: str) -> logs.LogRecord:
        return logs.LogRecord(0, level, logs.PREFIX + text, "engine")

    def _drain_raw(self, scrub: logs.Scrubber | None = None) -> list[logs.LogRecord]:
        return self._ring.drain(scrub or self._scrub)

    def _take_records(
        self, raw: list[logs.LogRecord], cfg: LogConfig | None = None
    ) -> list[logs.LogRecord]:
        cfg = cfg or self._log
        out = logs.visible(self._pending + raw, cfg.level, cfg.native)
        self._pending = []
        return out


LORA_APPLY_MODES = ("auto", "immediately", "at_runtime")


def lora_apply_mode() -> int:
    """How the runtime applies a job's LoRAs: at run time, beside the weights, never merged
    into them. Merged ("immediately", the runtime's choice for f16 weights) a LoRA leaves the
    weights changed after it is taken off again (f16 rounding): measured with the tiny model,
    a job without LoRA after LoRA jobs gave other bytes than before them, and a LoRA job after
    another LoRA set gave other bytes than the first time (bench/lora_cost.py). At run time
    every job gets the same bytes whatever ran before it, so an engine holds no LoRA state and
    placement need not follow LoRA sets. `SDFARM_LORA_APPLY` overrides, for measurements."""
    forced = os.environ.get("SDFARM_LORA_APPLY", "at_runtime")
    return LORA_APPLY_MODES.index(forced) if forced in LORA_APPLY_MODES else 2


def poison_reason(errors: list[str]) -> str | None:
    """Why a failed native call leaves the runtime unusable (out of memory, a lost device:
    the backend's state is not to be trusted), or None when the next call may run."""
    if any("out of memory" in e.lower() or "device lost" in e.lower() for e in errors):
        return "; ".join(errors)
    return None


def _shape(img: Any, ffi: Any) -> str | None:
    """An sd_image_t as the native call sees it: "WxHxC", or None without pixels."""
    return None if img.data == ffi.NULL else f"{img.width}x{img.height}x{img.channel}"


def _image_size(data: bytes) -> tuple[int, int]:
    import io

    with Image.open(io.BytesIO(data), formats=images.FORMATS) as im:
        return im.size


def host_device(
    figures: HostFigures | Callable[[], HostFigures] | None,
    backend: str | None,
    device: str,
    pinned: str | None,
) -> tuple[HostFigures, Device]:
    """The host's figures (injected, or read in a short-lived subprocess) and the device a
    load plans for: the pinned one, else the choice `device`, else the CPU."""
    if figures is None:
        from sdfarm.native.probe import read_host_figures

        figs = read_host_figures(backend)
    else:
        figs = figures() if callable(figures) else figures
    try:
        return figs, choose_compute_device(figs, pinned or device)
    except ValueError:
        return figs, _fallback_device(figs)


def _fallback_device(figs: HostFigures) -> Device:
    for d in figs.devices:
        if d.type == "cpu":
            return d
    return Device(0, "CPU", "CPU", "cpu", figs.mem_available or 0, figs.mem_available or 0)


def _enum_index(name_of: Callable[[int], Any], name: str, count: int, ffi: Any) -> int:
    for i in range(count):
        if ffi.string(name_of(i)).decode() == name:
            return i
    raise GenerationError(f"the runtime has no {name!r}")
