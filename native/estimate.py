"""The one estimate of a job's peak memory, and the facts of a model it is made from.

The scheduler places a job by its estimate, the worker's engine cache makes room for it, and
the engine refuses a size that does not fit: all three must judge a job by the same number,
so it is computed here and nowhere else. A worker reports each model's `ModelFacts` (from
`model_facts`, in its heartbeat); the scheduler makes the job's estimate from them with
`ModelFacts.estimate`; the figure travels with the job (the job record's `estimate`) to the
worker, whose cache and engine use it as it is. An engine run in-process makes it the same way
from its own facts.

The terms: the seed's rule (model files + a quarter + 512 MiB), growth with the pixels above
the model's native size, and the decode's working memory per output pixel where the engine
decodes without direct convolution (the full VAE through im2col on CUDA), twice when an input
image is encoded first. A tiled decode (sdfarm.native.tiling decides when) bounds the decode's
terms by a tile (`estimate(..., tiled=True)`). Later terms (the extra files of a LoRA or a
ControlNet) join here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from sdfarm.native import cudnn, memory
from sdfarm.native.backendlimits import self_attention_mask_values
from sdfarm.native.devices import Device
from sdfarm.native.drawsize import UNET_ARCHITECTURES, UNET_MULTIPLE, round_up, size_multiple
from sdfarm.native.params import SIZE_STEP

VAE_TILE_LATENT = 32
"""A tiled decode's tile side in latent cells: the runtime's own default (vae.hpp
get_tile_sizes), 256 output pixels for a VAE that scales by 8, 512 for one that scales by 16."""

VAE_TILE_PIXELS = VAE_TILE_LATENT * 16
"""The tile side in output pixels the tiled estimate assumes: the larger of the two scales,
since a model's facts do not say which its VAE has (cautious by 4x in area for SD, SDXL, Flux
and the tiny model, whose VAEs scale by 8)."""


VIDEO_CHUNK_BYTES_PER_PIXEL = 48 * 1024
"""The Wan VAE's working memory per frame pixel while it decodes one latent frame into four
frames (bench/video_memory.py on the CPU; see ModelFacts.video_estimate)."""
VIDEO_FRAME_BYTES_PER_PIXEL = 1024
"""What every frame adds per pixel (bench/video_memory.py on the CPU)."""
MASK_BYTES_PER_VALUE = 6
"""What the UNet's self-attention key mask costs per value, where the latent's token count is
not a multiple of 256 and the runtime pads the keys with a mask of pad256(tokens) x tokens
(backendlimits.self_attention_mask_values). Measured on the CPU with the SD 1.x test model at
1 step (2026-12-03, bench/mask_memory.py): the UNet's compute buffer was 123.07 MB at 512x512
(4,096 tokens, no mask), 257.07 MB at 576x576 (5,184 tokens: a mask of 27.9 M values) and
192.17 MB at 640x640 (6,400 tokens, no mask): 101 MB above the line through the other two,
3.6 bytes a value (the f32 mask). 6 leaves room for its f16 copy beside it. At 1600x1600 that
is 9.6 GB the growth term never saw: it was measured at 1024x1024, a multiple."""

BATCH_BYTES_PER_PIXEL = 640
"""What each image beyond the first adds per output pixel where a UNet samples a job's images
together (native/patches/batch_sample.hpp): the UNet's working memory for one more latent.
On the CPU the runtime's log gave a UNet compute buffer of 123.14 MB at 512x512 for one image
of the SD-Turbo-class model (470 bytes per pixel; the VAE's was 704 MB). On the H200 (CUDA,
cuDNN, the fusions; bench/results/gpu/cuda-farm-engines-batch-mps-*.json, 8 engines under
MPS) 4-image jobs peaked 0.35 GiB an engine above 1-image jobs at 512x512 and 1.64 GiB at
1024x1024: 478 and 558 bytes per pixel for the 3 more images. 640 covers both; counted in full
although the decode, one image at a time, often peaks higher (which stage peaks depends on the
backend and the decoder)."""
CLIP_VISION_COMPUTE_BYTES = 32 * memory.MiB
"""The working memory of a video job whose input image runs through the model's CLIP vision
encoder (a Wan2.1 I2V model's clip_vision file; its weights count with the model's files).
The runtime resizes every image to 224x224 first (get_clip_vision_output), so it does not grow
with the frames: its compute buffer was 10.9 MB on the CPU (bench/video_memory.py --variant
i2v prints it), and this covers it threefold, with the DiT's 257 image tokens beside."""


@dataclass(frozen=True)
class ModelFacts:
    """What a model's estimate needs: its files' total bytes, its native size and what this
    device's decode adds per output pixel."""

    bytes: int
    native_size: tuple[int, int]
    decode_per_pixel: int = 0
    video: str = ""
    """The video model it is, as the runtime names it (e.g. "Wan2.1-T2V-1.3B"; "": an image
    model): so a client refuses an image job for a video model, and the reverse, at submit."""
    control_heads: int = 0
    """The attention heads of a ControlNet the engine holds (0: none), whose attention runs
    without flash attention (`control_working`)."""
    context: int = 0
    """What the device's backend holds per engine process beyond the model's terms
    (CUDA_CONTEXT_BYTES on CUDA, 0 elsewhere): every slot is a process with its own."""
    decoders: tuple[str, ...] = ()
    """The decoders the model has (sdfarm.native.decoders: "vae", "taesd"), so a client
    refuses a job's `decoder` the model lacks before it is queued. `decode_per_pixel` is
    that of the model's own decoder; `with_decoder` gives a TAESD engine's."""
    size_multiple: int = SIZE_STEP
    """The multiple the runtime rounds a size up to for this model (64 for a UNet,
    sdfarm.native.drawsize): it draws, and holds, the rounded size."""
    decode_attention: bool = False
    """The engine decodes with a full VAE, whose middle block attends over every latent cell
    (`decode_attention_bytes`); TAESD has no attention."""
    vision: int = 0
    """What a video job's input image adds through the model's CLIP vision encoder
    (CLIP_VISION_COMPUTE_BYTES for a model with a clip_vision file, else 0)."""
    batch_per_pixel: int = 0
    """What each image of a job beyond its first adds per output pixel, for a model whose
    UNet samples a job's images together (BATCH_BYTES_PER_PIXEL; 0: one by one)."""

    def estimate(
        self,
        width: int,
        height: int,
        encodes: bool = False,
        extra_bytes: int = 0,
        tiled: bool = False,
        batch: int = 1,
    ) -> int:
        """The peak memory estimate of this model generating width x height images, `batch`
        of them in one job (`batch_beyond`); an image
        to encode first (img2img, inpainting) adds the encoder's working memory, which is the
        decoder's per pixel (the same convolutions run the other way); `extra_bytes` are the
        files a job adds (its LoRAs), counted like the model's (the seed's quarter on top).
        `tiled`: the VAE decodes (and encodes) in tiles of VAE_TILE_PIXELS a side, which
        bounds the decode's terms by a tile (memory.tiled_estimate_bytes says which). The
        size counts as the runtime draws it, rounded up to `size_multiple`."""
        width, height = round_up(width, self.size_multiple), round_up(height, self.size_multiple)
        nw, nh = self.native_size
        per_pixel = self.decode_per_pixel * (2 if encodes else 1)
        # Beside the decode: a ControlNet's attention scores, the UNet's further latents and
        # its self-attention's key mask.
        beside = (
            self.control_working(int(width), int(height))
            + self.batch_beyond(int(width), int(height), batch)
            + self.mask_bytes(int(width), int(height))
        )
        if tiled:
            side_w, side_h = min(int(width), VAE_TILE_PIXELS), min(int(height), VAE_TILE_PIXELS)
            return (
                self.context
                + beside
                + self.attention_beyond(side_w, side_h)
                + memory.tiled_estimate_bytes(
                    self.bytes + extra_bytes,
                    int(width),
                    int(height),
                    nw * nh,
                    VAE_TILE_PIXELS,
                    decode_per_pixel=per_pixel,
                )
            )
        return (
            self.context
            + beside
            + self.attention_beyond(int(width), int(height))
            + memory.estimate_bytes(
                self.bytes + extra_bytes,
                int(width),
                int(height),
                nw * nh,
                decode_per_pixel=per_pixel,
            )
        )

    def mask_bytes(self, width: int, height: int) -> int:
        """A UNet's self-attention key mask at `width` x `height` (MASK_BYTES_PER_VALUE for
        each value; 0 where the latent's token count is a multiple of 256, and for a DiT,
        whose size multiple is not a UNet's). A tiled decode does not bound it."""
        if self.size_multiple != UNET_MULTIPLE:
            return 0
        return self_attention_mask_values(width, height) * MASK_BYTES_PER_VALUE

    def batch_beyond(self, width: int, height: int, batch: int) -> int:
        """What a job of `batch` images adds over one image where the UNet samples them
        together: the UNet's working memory for every latent beyond the first. The decode
        stays one image at a time, so the decode's terms do not grow; a tiled decode does not
        bound this term."""
        return max(0, batch - 1) * width * height * self.batch_per_pixel

    def attention_beyond(self, width: int, height: int) -> int:
        """What the VAE's attention at `width` x `height` needs beyond the decode's per-pixel
        term (`decode_attention_bytes` less `decode_per_pixel` x pixels: the runtime's
        compute buffer is reused, so the larger of the two stages sets the peak)."""
        if not self.decode_attention:
            return 0
        return max(
            0, decode_attention_bytes(width, height) - width * height * self.decode_per_pixel
        )

    def video_estimate(self, width: int, height: int, frames: int, encodes: bool = False) -> int:
        """The peak memory estimate of a video job (sdfarm.native.video): what the engine
        holds at its native size, plus the Wan VAE's decode of one chunk of frames (it
        decodes a latent frame at a time, four frames a chunk: per frame pixel, not per
        video pixel), plus what grows with every frame (the latent video, the decoded
        frames as floats and 8-bit, the frames' images and the WebP encoder's copies). An
        input image is encoded by the same VAE first (its encoder's working memory, counted
        like a chunk), and, for a model with a CLIP vision encoder, runs through it
        (`vision`). Measured on the CPU by bench/video_memory.py."""
        pixels = int(width) * int(height)
        chunks = 2 if encodes else 1
        return (
            self.resident()
            + pixels * VIDEO_CHUNK_BYTES_PER_PIXEL * chunks
            + pixels * int(frames) * VIDEO_FRAME_BYTES_PER_PIXEL
            + (self.vision if encodes else 0)
        )

    def control_working(self, width: int, height: int) -> int:
        """A ControlNet's attention scores at `width` x `height`: the runtime turns flash
        attention on for the diffusion model only, so the ControlNet's first attention layers
        hold heads x tokens x tokens f32 scores, tokens the latent's cells (1/8 of each side):
        512 MiB at 512x512 with 8 heads, 8 GiB at 1024x1024 (bench/controlnet_memory.py
        measured the peak against it). 0 without a ControlNet."""
        tokens = (width // 8) * (height // 8)
        return self.control_heads * tokens * tokens * 4

    def resident(self) -> int:
        """The estimate at the native size: what a loaded engine of this model holds."""
        return self.estimate(*self.native_size)

    def as_json(self) -> dict[str, Any]:
        """The heartbeat's form: {bytes, native_size: [w, h], decode_per_pixel}, and `video`
        for a video model."""
        doc: dict[str, Any] = {
            "bytes": self.bytes,
            "native_size": list(self.native_size),
            "decode_per_pixel": self.decode_per_pixel,
            **({"control_heads": self.control_heads} if self.control_heads else {}),
            **({"context": self.context} if self.context else {}),
            **({"decoders": list(self.decoders)} if self.decoders else {}),
            **({"size_multiple": self.size_multiple} if self.size_multiple != SIZE_STEP else {}),
            **({"decode_attention": True} if self.decode_attention else {}),
            **({"vision": self.vision} if self.vision else {}),
            **({"batch_per_pixel": self.batch_per_pixel} if self.batch_per_pixel else {}),
        }
        if self.video:
            doc["video"] = self.video
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ModelFacts:
        """The facts of a heartbeat's `models` entry (ValueError when malformed)."""
        w, h = doc["native_size"]
        return cls(
            int(doc["bytes"]),
            (int(w), int(h)),
            int(doc.get("decode_per_pixel") or 0),
            str(doc.get("video") or ""),
            int(doc.get("control_heads") or 0),
            int(doc.get("context") or 0),
            tuple(str(d) for d in doc.get("decoders") or ()),
            int(doc.get("size_multiple") or SIZE_STEP),
            bool(doc.get("decode_attention")),
            int(doc.get("vision") or 0),
            int(doc.get("batch_per_pixel") or 0),
        )

    @classmethod
    def cautious(cls, facts: list[ModelFacts]) -> ModelFacts:
        """One set of facts valid on every device that reported one: hosts whose copies or
        decode paths differ give the largest file size and decode term and the smallest
        native size, so one estimate per job covers every device that may get it; the
        decoders every copy has."""
        native = min((f.native_size for f in facts), key=lambda s: s[0] * s[1])
        video = max(f.video for f in facts)  # copies of one name should agree
        return cls(
            max(f.bytes for f in facts),
            native,
            max(f.decode_per_pixel for f in facts),
            video,
            max(f.control_heads for f in facts),
            max(f.context for f in facts),
            tuple(d for d in facts[0].decoders if all(d in f.decoders for f in facts)),
            max(f.size_multiple for f in facts),
            any(f.decode_attention for f in facts),
            max(f.vision for f in facts),
            max(f.batch_per_pixel for f in facts),
        )

    def with_extras(self, extra_bytes: int, control_heads: int = 0) -> ModelFacts:
        """These facts for an engine that also holds `extra_bytes` of a ControlNet and
        embeddings (sdfarm.native.enginekey), with the ControlNet's attention heads."""
        return replace(
            self,
            bytes=self.bytes + extra_bytes,
            control_heads=max(self.control_heads, control_heads),
        )

    def with_decoder(self, decoder: str) -> ModelFacts:
        """These facts for an engine of the model decoding with `decoder` ("taesd": the
        TAESD's decode term, TAESD_DECODE_BYTES_PER_PIXEL; else as they are, the model's own
        decoder's)."""
        if decoder != "taesd":
            return self
        return replace(self, decode_per_pixel=TAESD_DECODE_BYTES_PER_PIXEL, decode_attention=False)


def model_facts(model: Any, device: Device, decoder: str = "") -> ModelFacts:
    """The facts of a loaded or loadable `Model` (sdfarm.native.model) on `device`, for an
    engine decoding with `decoder` (vae or taesd; "": the model's own,
    sdfarm.native.decoders); a model that names no architecture is taken as drawn at the size
    asked."""
    from sdfarm.native.decoders import own
    from sdfarm.native.video import video_model

    found = video_model(model)
    decoders = tuple(model.decoders)
    facts = ModelFacts(
        model.total_bytes,
        tuple(model.native_size),
        decode_bytes_per_pixel(own(decoders), device),
        found.desc if found else "",
        context=context_bytes(device),
        decoders=decoders,
        size_multiple=size_multiple(getattr(model, "architecture", "")),
        decode_attention="vae" in decoders and own(decoders) == "vae",
        vision=CLIP_VISION_COMPUTE_BYTES if "clip_vision" in model.files else 0,
        batch_per_pixel=BATCH_BYTES_PER_PIXEL
        if getattr(model, "architecture", "") in UNET_ARCHITECTURES
        else 0,
    )
    return facts.with_decoder(decoder)


CUDA_CONTEXT_BYTES = 512 * memory.MiB
"""What an engine's process holds on a CUDA device beyond the seed's estimate: the CUDA
context with ggml's kernels and cuBLAS's workspace, which nvidia-smi counts against the card.
Measured on the H200 (bench/controlnet_memory.py --device CUDA0, 2026-12-01,
bench/results/gpu/cuda-controlnet-memory*.json): the random-weight SD 1.x model (q4_0, TAESD,
1.46 GB of files) peaked at 2,073 MiB at 64x64, 680 MiB beyond its files, and at 2,575 MiB at
512x512, 321 MiB over the seed's estimate (2,254 MiB): a quantized file's quarter is too small
a margin for a context the file's size does not change. The full-size f16 model's larger
quarter had hidden it (4.83 GiB peak against 6.04). Vulkan's is not measured: 0 there."""


CUDNN_WORKSPACE_FIXED_BYTES = 64 * memory.MiB
"""The fixed part of the workspace our cuDNN patch lets one convolution take
(native/patches/conv2d_cudnn.cuh, sdfarm_cudnn_max_workspace: half again its f16 input and
output, which CUDNN_DECODE_BYTES_PER_PIXEL counts, plus this): once per process, beside its
context, where a cuDNN is named."""


def context_bytes(device: Device) -> int:
    """The per-process backend term of `device`'s estimates: on CUDA, CUDA_CONTEXT_BYTES, and
    CUDNN_WORKSPACE_FIXED_BYTES more where the operator named a cuDNN; 0 elsewhere."""
    if not device.name.upper().startswith("CUDA"):
        return 0
    return CUDA_CONTEXT_BYTES + (CUDNN_WORKSPACE_FIXED_BYTES if cudnn.library() is not None else 0)


def use_conv_direct(device: str) -> bool:
    """Direct convolution (no im2col buffer): everywhere but CUDA, and on CUDA where the
    operator named a cuDNN (sdfarm.native.cudnn), which our CUDA build runs it
    through. ggml's own CUDA direct convolution is 27x slower than im2col (see
    use_vae_conv_direct), so a CUDA engine without cuDNN keeps im2col.
    `SDFARM_VAE_CONV_DIRECT=0|1` overrides, for measurements."""
    forced = os.environ.get("SDFARM_VAE_CONV_DIRECT")
    if forced in ("0", "1"):
        return forced == "1"
    return not device.startswith("CUDA") or cudnn.library() is not None


def use_vae_conv_direct(decoder: str, device: str) -> bool:
    """Direct VAE convolution keeps the full VAE's decode inside the estimate on the CPU
    (facts: 3.14 vs 4.06 GiB at 512x512) and costs nothing on Vulkan (0.30 s per 512x512
    image on the H200). On CUDA it runs through cuDNN when one is named (use_conv_direct);
    ggml's own CUDA direct convolution made the full-size model's 512x512 image take 2.02 s
    against 0.28 s without it (bench/results/gpu). TAESD's decode (`decoder` taesd) is small
    either way and runs 2x slower with it on the CPU. `SDFARM_VAE_CONV_DIRECT=0|1` overrides,
    for measurements."""
    forced = os.environ.get("SDFARM_VAE_CONV_DIRECT")
    if forced in ("0", "1"):
        return forced == "1"
    return decoder != "taesd" and use_conv_direct(device)


def use_diffusion_conv_direct(device: str) -> bool:
    """Direct convolution in the diffusion model: only on CUDA with a named cuDNN (our
    build's convolution there, 3x3 and 1x1 alike, reads its input once where im2col writes it
    nine times). Elsewhere the diffusion model keeps the runtime's im2col, as it always has (the
    CPU's direct convolution is the slower one there). `SDFARM_UNET_CONV_DIRECT=0|1`
    overrides, for measurements."""
    forced = os.environ.get("SDFARM_UNET_CONV_DIRECT")
    if forced in ("0", "1"):
        return forced == "1"
    return device.startswith("CUDA") and cudnn.library() is not None


def decode_attention_bytes(width: int, height: int) -> int:
    """The f32 scores of the full VAE's middle-block self-attention decoding `width` x `height`
    at once: one head over every latent cell, (cells)² x 4 bytes, cells = (w/8) x (h/8) (a VAE
    that scales by 16 has a quarter of the cells: cautious there). The runtime runs it without
    flash attention, so it grows with the square of the pixels: 64 MiB at 512x512, 1 GiB at
    1024x1024, 16 GiB at 2048x2048, 256 GiB at 4096x4096. Measured on the H200 through Vulkan
    (2026-12-01, bench/results/gpu/vulkan-coopmat-vae-tiling-4096-off.json): the untiled decode
    of 4096x4096 by the SD-Turbo-class VAE asked for a compute buffer of 277,570,650,144 bytes
    (this term is 274,877,906,944 of it) and failed, where the estimate without it said 50.8 GiB.
    A tiled decode holds one tile's."""
    cells = (-(-int(width) // 8)) * (-(-int(height) // 8))
    return cells * cells * 4


TAESD_DECODE_BYTES_PER_PIXEL = 0
"""A TAESD decode's working memory per output pixel beyond the seed's estimate: none
measured. On the H200 the SD-Turbo-class model decoding with TAESD (im2col, CUDA) peaked at
3.42 / 4.92 GiB of GPU memory at 512 / 1024 against seed estimates of 3.54 / 5.79 GiB
(bench/results/gpu/cuda-gpu-memory-recheck.json, docs/gpu.md), where the full VAE's decode
needed 10 KiB a pixel more (memory.IM2COL_DECODE_BYTES_PER_PIXEL)."""


CUDNN_DECODE_BYTES_PER_PIXEL = 3072
"""A full-VAE decode's working memory per output pixel beyond the seed's estimate when its
convolutions run through cuDNN (native/patches/conv2d_cudnn.cuh, an operator's switch), from ggml's
memory pool beside the compute graph: each convolution's f16 copy of its input, its f16
output and cuDNN's workspace, which the patch caps at half again those two plus 64 MiB (its
fastest algorithms transpose both to NHWC). The largest, the SD VAE's 256-channel
upsampling convolution at the output size, is 512 + 512 + 1,536 bytes a pixel (the 64 MiB is
CUDNN_WORKSPACE_FIXED_BYTES, in the context term); the rest covers ggml's direct path, which
peaked up to 5% over the seed's estimate on CUDA. Measured on the H200 (2026-12-02,
bench/results/gpu/cuda-cudnn-gpu-memory.json): the SD-Turbo-class model peaked at 4.27 /
7.83 GiB at 512 / 1024 against estimates of 4.79 / 9.29, made before the fixed 64 MiB
joined the context term (docs/gpu.md)."""


def decode_bytes_per_pixel(decoder: str, device: Device) -> int:
    """Decode working memory per output pixel beyond the seed's estimate of an engine
    decoding with `decoder` (vae or taesd): TAESD_DECODE_BYTES_PER_PIXEL for TAESD; on a GPU
    the full VAE through im2col (memory.IM2COL_DECODE_BYTES_PER_PIXEL) or, on CUDA, through
    cuDNN (CUDNN_DECODE_BYTES_PER_PIXEL); else 0."""
    if decoder == "taesd":
        return TAESD_DECODE_BYTES_PER_PIXEL
    if device.type == "cpu":
        return 0
    if use_vae_conv_direct(decoder, device.name):
        return CUDNN_DECODE_BYTES_PER_PIXEL if device.name.startswith("CUDA") else 0
    return memory.IM2COL_DECODE_BYTES_PER_PIXEL


# -- upscalers (sdfarm.native.upscale) ---------------------------------------------------------

UPSCALE_OVERHEAD = 128 * memory.MiB
"""What an upscaler process holds beside weights and working memory on the CPU (Python, the
runtime, the compute graph): a process that loaded the tiny upscaler peaks at about 70 MiB
RSS. On a GPU the backend's context comes on top (hundreds of MiB on CUDA), unmeasured for
the upscaler: there the seed's 512 MiB term counts instead, as for a model."""
UPSCALE_TILE_BYTES_PER_PIXEL = {"direct": 1024, "im2col": 2048}
"""The runtime's working memory per output pixel of one tile, by convolution path: RRDBNet's
64-feature maps and concatenations at the output size, plus im2col's 9x unrolled copy without
direct convolution (bench/upscale_memory.py measured about 0.7 and 1.5 KiB on the CPU)."""
UPSCALE_IMAGE_BYTES_PER_PIXEL = 64
"""Per output pixel of the whole image: the runtime's float output tensor (12 bytes), its
8-bit image, Python's copy, Pillow's image and the PNG encoder's buffers."""


@dataclass(frozen=True)
class UpscalerFacts:
    """What an upscaler job's estimate needs: the file's bytes, the model's scale and the
    working memory per tile output pixel on this device."""

    bytes: int
    scale: int
    tile_per_pixel: int = UPSCALE_TILE_BYTES_PER_PIXEL["im2col"]
    overhead: int = memory.SEED_OVERHEAD

    def estimate(self, width: int, height: int, tile_size: int) -> int:
        """The peak memory of upscaling a width x height image in tiles of `tile_size` input
        pixels a side (0: the whole image in one go). The runtime runs the network on one
        tile at a time and keeps the whole output as floats: a tile's working memory plus
        the output's. When the image exceeds a tile on either side the runtime works in
        full tiles, so a tile counts tile_size squared."""
        w, h, s = int(width), int(height), self.scale
        tiled = tile_size > 0 and (w > tile_size or h > tile_size)
        tile_pixels = (tile_size * tile_size if tiled else w * h) * s * s
        return (
            self.resident()
            + tile_pixels * self.tile_per_pixel
            + w * h * s * s * UPSCALE_IMAGE_BYTES_PER_PIXEL
        )

    def working(self, width: int, height: int, tile_size: int) -> int:
        """What this upscaler adds inside a generation (a hires pass's model upscaler, loaded
        by the runtime for the call, on the first pass's width x height image): the estimate
        without the process's share, which the generation's estimate already counts."""
        return self.estimate(width, height, tile_size) - self.overhead

    def resident(self) -> int:
        """What a loaded upscaler holds between jobs: its weights (the seed's quarter on top,
        as for models) and the process's share."""
        return self.bytes + self.bytes // 4 + self.overhead

    def as_json(self) -> dict[str, Any]:
        """The heartbeat's form: {bytes, scale, tile_per_pixel, overhead}."""
        return {
            "bytes": self.bytes,
            "scale": self.scale,
            "tile_per_pixel": self.tile_per_pixel,
            "overhead": self.overhead,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> UpscalerFacts:
        """The facts of a heartbeat's `upscalers` entry (ValueError when malformed)."""
        return cls(
            int(doc["bytes"]),
            int(doc["scale"]),
            int(doc["tile_per_pixel"]),
            int(doc.get("overhead") or memory.SEED_OVERHEAD),
        )

    @classmethod
    def cautious(cls, facts: list[UpscalerFacts]) -> UpscalerFacts:
        """One set of facts valid on every device that reported one (largest of each). The
        scale of one name should agree everywhere; the largest counts when copies differ."""
        return cls(
            max(f.bytes for f in facts),
            max(f.scale for f in facts),
            max(f.tile_per_pixel for f in facts),
            max(f.overhead for f in facts),
        )


def upscaler_facts(size: int, scale: int, device: str) -> UpscalerFacts:
    """The facts of an upscaler file of `size` bytes and `scale` on `device` (its name)."""
    path = "direct" if use_conv_direct(device) else "im2col"
    overhead = UPSCALE_OVERHEAD if device == "CPU" else memory.SEED_OVERHEAD
    return UpscalerFacts(int(size), int(scale), UPSCALE_TILE_BYTES_PER_PIXEL[path], overhead)


Facts = ModelFacts | UpscalerFacts
"""What an engine's job estimates are made from: a model's facts or an upscaler's."""


def job_estimate(
    facts: Facts,
    width: int,
    height: int,
    *,
    encodes: bool = False,
    extra_bytes: int = 0,
    tile_size: int = 0,
    tiled: bool = False,
    frames: int = 0,
    batch: int = 1,
) -> int:
    """A job's estimate from its engine's facts: a generation's size (and input image and
    LoRA files; `tiled`: its VAE decoding in tiles; `batch`: its images), or an upscale's
    input size and tile size, or a video's frame size and `frames` (a video is never tiled).
    What the scheduler places by."""
    if isinstance(facts, UpscalerFacts):
        return facts.estimate(width, height, tile_size)
    if frames:
        return facts.video_estimate(width, height, frames, encodes)
    return facts.estimate(width, height, encodes, extra_bytes, tiled=tiled, batch=batch)
