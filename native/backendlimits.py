"""Sizes the GPU builds of the pinned runtime cannot draw: refused (or, where tiling avoids
them, tiled) before the native call, since the runtime aborts the whole process on them
(docs/crashers.md).

CUDA:

Measured on the H200 (bench/cuda_size_limit.py, bench/results/gpu/cuda-size-limit.json): the
SD 2.x UNet with flash attention (which the engine always sets) draws 1024, 1280, 1536 and
1792 square and aborts at 2048 (`ggml_cuda_compute_forward: CONCAT failed`, `CUDA error:
invalid argument`, SIGABRT); without flash attention 2048 passes. The cause, read in the
source: the UNet's cross-attention pads the 77 text tokens to 256 with a mask of one row per
image token of the first level ((w/8) x (h/8); ggml_extend.hpp), and ggml's CUDA concat puts
that row count in a grid dimension that CUDA caps at 65,535 (concat.cu). 2048x2048 is 65,536
rows. The rule covers the UNets (SD 1.x, 2.x, XL), whose cross-attention always pads; a DiT's
joint attention pads only when its token count is not a multiple of 256 and was not measured.

A second limit, measured on the H200 on 2026-12-03 (bench/results/gpu/log-batchbig*.txt):
1984x1984 (61,504 rows) aborts too (`ggml-cuda.cu:98: CUDA error`, SIGABRT, 1 step, with and
without cuDNN, VAE tiled or not), where 1920x1920 (57,600) draws. 61,504 is not a multiple
of 256, so the first level's self-attention pads its keys as well, with a mask of
pad256(rows) x rows values built by the same CONCAT, whose kernel computes its offsets in 32
bits (concat.cu: `blockIdx.y * ne0` into an int): past 2,147,483,647 values it reads and writes
outside its tensors. 57,600 = 225 x 256 needs no mask. So where rows is not a multiple of 256,
rows x pad256(rows) must stay within an int (about 46,300 rows).
"""

from __future__ import annotations

import math

GRID_ROWS = 65_535
"""CUDA's limit on a grid's y and z dimensions, where ggml's concat puts the mask's rows."""

KV_STRIDE = 256
"""The multiple the runtime pads flash attention's keys to (ggml_extend.hpp), with a mask."""

CONCAT_MAX_VALUES = 2**31 - 1
"""The most values ggml's CUDA concat can index (32-bit offsets, concat.cu)."""

UNET_ARCHITECTURES = frozenset({"sd1", "sd2", "sdxl"})


def attention_rows(width: int, height: int) -> int:
    """The query rows of a UNet's first-level attention: one per latent pixel (the VAE
    downsamples by 8; the runtime rounds sizes up)."""
    return math.ceil(width / 8) * math.ceil(height / 8)


def self_attention_mask_values(width: int, height: int) -> int:
    """The values of the mask the runtime builds for a UNet's first-level self-attention at
    `width` x `height` (0 where its token count is a multiple of KV_STRIDE: no padding)."""
    rows = attention_rows(width, height)
    if rows % KV_STRIDE == 0:
        return 0
    return rows * (math.ceil(rows / KV_STRIDE) * KV_STRIDE)


def cuda_size_error(architecture: str, device: str, width: int, height: int) -> str | None:
    """Why `width` x `height` cannot run on `device` with this architecture, or None."""
    if not device.startswith("CUDA") or architecture not in UNET_ARCHITECTURES:
        return None
    rows = attention_rows(width, height)
    if rows > GRID_ROWS:
        return (
            f"{width}x{height} is {rows:,} attention rows ((width/8) x (height/8)) for this "
            f"{architecture} UNet, over the {GRID_ROWS:,} the runtime's CUDA build can take: it "
            "aborts the process there (docs/crashers.md). Ask at most 65,535 rows (2040x2040 "
            "square, or 1792x2304), or run the job on a CPU or Vulkan device"
        )
    mask = self_attention_mask_values(width, height)
    if mask > CONCAT_MAX_VALUES:
        return (
            f"{width}x{height} is {rows:,} attention rows ((width/8) x (height/8)), not a "
            f"multiple of {KV_STRIDE}: this {architecture} UNet's self-attention pads its keys "
            f"with a mask of {mask:,} values, past the {CONCAT_MAX_VALUES:,} the runtime's CUDA "
            "build can index, and it aborts the process there (1984x1984 did; "
            "docs/crashers.md). Ask a size whose rows are a multiple of 256 (1920x1920, "
            "2048x1536) or at most about 46,300 rows (1600x1600), or run the job on a CPU or "
            "Vulkan device"
        )
    return None


VULKAN_MAX_ELEMENTS = 2**32 - 1
"""The most elements ggml's Vulkan backend takes in one elementwise operation: its push
constants count them in 32 bits (`vk_op_unary_push_constants_init`, ggml-vulkan.cpp:
`GGML_ASSERT(ne <= UINT32_MAX)`, which aborts the process)."""


def vulkan_attention_error(
    device: str, width: int, height: int, heads: int, what: str
) -> str | None:
    """Why an attention the runtime computes without flash attention (the full VAE's middle
    block: one head; a ControlNet's: its heads) cannot run on `device` at `width` x `height`,
    or None. Its scores are one tensor of heads x cells x cells elements, cells the latent's
    ((w/8) x (h/8)); past VULKAN_MAX_ELEMENTS the Vulkan build aborts. Measured on the H200
    (2026-12-01, bench/results/gpu/vulkan-coopmat-vae-tiling-2048-attention.json): the
    SD-Turbo-class VAE decoded 1024x1024 whole (2^28 elements) and aborted at 2048x2048
    (65,536 cells: 2^32 elements) with that assert. A tiled decode's tiles stay far below it."""
    if heads <= 0 or not device.upper().startswith("VULKAN"):
        return None
    cells = attention_rows(width, height)
    elements = heads * cells * cells
    if elements <= VULKAN_MAX_ELEMENTS:
        return None
    return (
        f"{width}x{height} gives the {what}'s attention scores {elements:,} elements "
        f"({heads} head(s) x {cells:,}^2 latent cells, without flash attention), over the "
        f"{VULKAN_MAX_ELEMENTS:,} ggml's Vulkan backend takes in one operation: it aborts the "
        "process there"
    )
