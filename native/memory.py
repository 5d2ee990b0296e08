"""The memory check before a load: the seed's estimate and its warn / refuse / skip rules.

Pure: the figures come in as a `HostFigures` (read by `probe.py` in a short-lived subprocess,
or a test's table), so every rule is tested on reported figures without the hardware. The rules
are the seed's ("Memory check" and "Vulkan GPUs" in
../shared/seed/image-generation-memory-logs-limits.txt), plus one of ours: the estimate grows
with the image size above the model's native size, because the seed's does not hold there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .devices import (
    Device,
    HostFigures,
    MiB,
    choose_compute_device,
    device_figure,
    device_label,
    discrete_gpus,
    figures_summary,
    format_bytes,
)
from .errors import ModelTooLargeError

SEED_OVERHEAD = 512 * MiB
"""The seed's fixed term: estimate = file sizes + a quarter + 512 MiB."""

GROWTH_BYTES_PER_PIXEL = 3 * 1024
"""Bytes the peak grows per output pixel above the model's native size.

Measured (../shared/facts/runtime.md, "A full-size model on the CPU"): an SD-Turbo-class model
on the CPU with weights kept loaded, flash attention and direct VAE convolution peaked at
5.23 GiB at 1024x1024 against the seed's 3.535 GiB estimate, i.e. 1.695 GiB over
1024*1024 - 512*512 = 786,432 extra pixels = 2.26 KiB per pixel. 3 KiB leaves a margin for
run-to-run noise and other architectures until bench/estimate_growth.py re-measures it.
"""

DEFAULT_ESTIMATE_HOW = "model files + a quarter + 512 MiB"
"""How an estimate was made, when the caller does not say (see `describe_estimate`)."""

Action = Literal["ok", "warn", "refuse", "skip"]


def estimate_bytes(
    model_bytes: int,
    width: int,
    height: int,
    native_pixels: int,
    growth_per_pixel: int = GROWTH_BYTES_PER_PIXEL,
    decode_per_pixel: int = 0,
) -> int:
    """The peak memory estimate of a loaded model generating width x height images.

    `decode_per_pixel` adds working memory per output pixel at every size, for a decode the
    seed never measured: the full VAE through im2col on CUDA (IM2COL_DECODE_BYTES_PER_PIXEL).

    The seed's estimate (files + a quarter + 512 MiB) covers the measured peaks at each model's
    native size; above it the peak grows with the pixel count (the VAE decode and attention
    working memory), so pixels above `native_pixels` add `growth_per_pixel` each. Sizes at or
    below the native size add nothing: the seed's estimate already covers them.
    """
    if model_bytes < 0 or width < 0 or height < 0 or native_pixels < 0 or growth_per_pixel < 0:
        raise ValueError("estimate_bytes takes non-negative sizes")
    seed = model_bytes + model_bytes // 4 + SEED_OVERHEAD
    grown = max(0, width * height - native_pixels) * growth_per_pixel
    return seed + grown + width * height * decode_per_pixel


IM2COL_DECODE_BYTES_PER_PIXEL = 10 * 1024
"""The full VAE's decode without direct convolution (CUDA, where direct convolution made
generation 10x slower): on the H200 the SD-Turbo-class model peaked at 4.76 GiB of GPU memory
at 512x512 and 10.01 GiB at 1024x1024 against seed estimates of 3.54 and 5.79 GiB
(bench/results/gpu/cuda-gpu-memory-recheck.json): about 9.9 and 7.9 KiB per output pixel of
decode working memory beyond the weights. 10 KiB per pixel covers both."""


TILED_GROWTH_BYTES_PER_PIXEL = 1024
"""Bytes the peak still grows per output pixel above the native size when the VAE decodes
in tiles: what grows with the image besides the decode's working memory.

A tiled decode bounds the decode's working memory (convolutions over the full-resolution
image, the largest term of GROWTH_BYTES_PER_PIXEL: ../shared/facts/runtime.md) by one tile,
but not the rest: the diffusion model's activations over the latent (with flash attention
about 0.5 GB more at 1024x1024 than at 512x512 for the SD-Turbo-class model on the CPU, facts
file: 0.67 KiB per pixel above native), the latent itself, and the full-size image the tiles
are stitched into (float RGB, 12 bytes per pixel) with its 8-bit copies (3 bytes each: the
runtime's, ours, PIL's). 1 KiB per pixel covers those; the tiny model measures it in
bench/vae_tiling.py (docs/memory.md, "VAE tiling")."""


def tiled_estimate_bytes(
    model_bytes: int,
    width: int,
    height: int,
    native_pixels: int,
    tile_side: int,
    decode_per_pixel: int = 0,
) -> int:
    """`estimate_bytes` for a VAE that decodes (and encodes) in tiles of at most
    `tile_side` x `tile_side` output pixels.

    The terms a tiled decode bounds take the tile's pixels instead of the image's: the
    decode's share of the growth (GROWTH_BYTES_PER_PIXEL - TILED_GROWTH_BYTES_PER_PIXEL, for
    the tile's pixels above the native size) and `decode_per_pixel`. What grows with the
    image whatever the decode does keeps growing with every pixel above the native size
    (TILED_GROWTH_BYTES_PER_PIXEL). An image no larger than a tile gets the untiled estimate.
    """
    if min(model_bytes, width, height, native_pixels, tile_side, decode_per_pixel) < 0:
        raise ValueError("tiled_estimate_bytes takes non-negative sizes")
    pixels = width * height
    tile = min(width, tile_side) * min(height, tile_side)
    seed = model_bytes + model_bytes // 4 + SEED_OVERHEAD
    rest = max(0, pixels - native_pixels) * TILED_GROWTH_BYTES_PER_PIXEL
    decode_growth = GROWTH_BYTES_PER_PIXEL - TILED_GROWTH_BYTES_PER_PIXEL
    decode = max(0, tile - native_pixels) * decode_growth + tile * decode_per_pixel
    return seed + rest + decode


def describe_estimate(
    model_bytes: int,
    width: int,
    height: int,
    native_pixels: int,
    growth_per_pixel: int = GROWTH_BYTES_PER_PIXEL,
) -> str:
    """How `estimate_bytes` made its figure, term by term, for the refusal message."""
    quarter = model_bytes // 4
    text = (
        f"model files {format_bytes(model_bytes)} + a quarter {format_bytes(quarter)} "
        f"+ {format_bytes(SEED_OVERHEAD)}"
    )
    extra = max(0, width * height - native_pixels)
    if extra:
        text += (
            f" + size growth {format_bytes(extra * growth_per_pixel)} ({width}x{height} is "
            f"{extra} pixels above the native {native_pixels}, {growth_per_pixel} bytes each)"
        )
    return text


@dataclass(frozen=True)
class MemoryVerdict:
    """What the check decided and why.

    action: "ok", "warn" (load, log `message` at warn), "refuse" (raise, see
    `raise_if_refused`) or "skip" (not checked; `reason` says why, `message` is empty).
    compute_figure: the compute device's figure the warning compares with; refuse_figure: the
    limit whose excess refuses (None when nothing can be refused here); figures: every figure by
    label plus "estimate", as ModelTooLargeError carries them.
    """

    action: Action
    estimate: int
    compute_device: Device | None = None
    compute_figure: int | None = None
    refuse_figure: int | None = None
    reason: str = ""
    message: str = ""
    figures: dict[str, int | None] = field(default_factory=dict)


def _amount(n: int | None) -> str:
    return f"{format_bytes(n)} ({n} bytes)" if n is not None else "unknown"


def warning_message(estimate: int, dev: Device, figure: int) -> str:
    """The one warn record the engine logs when a model exceeds the compute GPU's figure."""
    return (
        f"model estimate {_amount(estimate)} exceeds the free memory of {dev.name} "
        f"({dev.description}): {_amount(figure)}; part of the model stays in system memory "
        "and generation will be slower"
    )


def _refusal_message(
    estimate: int, how: str, terms: list[tuple[str, int]], limit: int, what: str
) -> str:
    parts = " + ".join(f"{label} {_amount(value)}" for label, value in terms)
    total = f" = {_amount(limit)}" if len(terms) > 1 else ""
    return (
        f"model too large: estimate {_amount(estimate)} ({how}) exceeds {what}: "
        f"{parts}{total}. Free memory, use a smaller or quantized model, or load anyway with "
        "check_memory=False (--no-check-memory)"
    )


def check_memory(
    estimate: int,
    figs: HostFigures,
    choice: str = "auto",
    *,
    pinned: str | None = None,
    enabled: bool = True,
    how: str = DEFAULT_ESTIMATE_HOW,
) -> MemoryVerdict:
    """Decide whether a model of `estimate` bytes loads, loads with a warning, or is refused.

    `choice` is the device choice (auto / gpu / cpu / a device name). `pinned` is the device
    name sdfarm itself pinned this worker to through SD_VK_DEVICE, GGML_VK_VISIBLE_DEVICES or
    CUDA_VISIBLE_DEVICES: sdfarm knows that device, so the check runs on its figures alone
    (the other GPUs belong to other workers) despite those variables. `enabled` False is
    check_memory=False: no check and no warning. `how` says how the estimate was made (see
    `describe_estimate`); the refusal quotes it.

    The rules, from the seed: a discrete GPU that computes warns above its figure; on Linux a
    model above the sum of the discrete GPUs' figures + MemAvailable is refused; Windows never
    refuses a GPU model; macOS compares a Metal GPU with its working set (its total); the CPU
    and integrated GPUs compare with MemAvailable (Linux, macOS) and are not checked on
    Windows; nothing is checked when a GPU reports no memory or the user set SD_VK_DEVICE.
    """
    if not enabled:
        return MemoryVerdict("skip", estimate, reason="check_memory off")
    if "SD_VK_DEVICE" in figs.env and pinned is None:
        return MemoryVerdict(
            "skip",
            estimate,
            reason="SD_VK_DEVICE is set: the engine cannot know which device computes",
        )

    dev = choose_compute_device(figs, pinned or choice)
    if figs.os not in ("linux", "darwin", "windows"):
        return MemoryVerdict(
            "skip", estimate, dev, reason=f"the OS {figs.os!r} is not memory-checked"
        )
    if dev.type == "gpu":
        # Pinned: only that GPU is this worker's; the other GPUs belong to other workers.
        counted = (dev,) if pinned is not None else discrete_gpus(figs)
        return _check_discrete(estimate, figs, dev, counted, how)
    return _check_system(estimate, figs, dev, how)


def _check_discrete(
    estimate: int, figs: HostFigures, dev: Device, counted: tuple[Device, ...], how: str
) -> MemoryVerdict:
    """A discrete GPU computes: warn above its figure, refuse above the sum (Linux) or the
    Metal working set (macOS); Windows only warns."""
    silent = [d for d in counted if device_figure(d, figs.os) is None]
    if silent:
        names = ", ".join(d.name for d in silent)
        return MemoryVerdict("skip", estimate, dev, reason=f"GPU {names} reports no memory")
    figure = device_figure(dev, figs.os)
    assert figure is not None  # dev is one of the counted GPUs, none of which is silent

    if figs.os == "darwin":
        # Metal: unified memory bounded by the working set (the device's total); no sum.
        label = f"{device_label(dev)} Metal working set"
        figures: dict[str, int | None] = {label: figure, "estimate": estimate}
        if estimate > figure:
            message = _refusal_message(
                estimate, how, [(label, figure)], figure, f"the Metal working set of {dev.name}"
            )
            return MemoryVerdict(
                "refuse",
                estimate,
                dev,
                compute_figure=figure,
                refuse_figure=figure,
                reason=f"estimate above the Metal working set of {dev.name}",
                message=message,
                figures=figures,
            )
        return MemoryVerdict(
            "ok", estimate, dev, compute_figure=figure, refuse_figure=figure, figures=figures
        )

    figures = figures_summary(figs, counted)
    figures["estimate"] = estimate
    limit: int | None = None
    if figs.os == "linux" and figs.mem_available is not None:
        # An over-budget GPU (figure 0) adds nothing; integrated GPUs are not counted at all.
        terms = [(device_label(d), device_figure(d, figs.os) or 0) for d in counted]
        terms.append(("MemAvailable", figs.mem_available))
        limit = sum(value for _, value in terms)
        if estimate > limit:
            gpus = "the GPU" if len(counted) == 1 else "the GPUs"
            message = _refusal_message(
                estimate, how, terms, limit, f"the memory of {gpus} plus system memory"
            )
            return MemoryVerdict(
                "refuse",
                estimate,
                dev,
                compute_figure=figure,
                refuse_figure=limit,
                reason="estimate above the discrete GPUs' figures plus MemAvailable",
                message=message,
                figures=figures,
            )
    if estimate > figure:
        return MemoryVerdict(
            "warn",
            estimate,
            dev,
            compute_figure=figure,
            refuse_figure=limit,
            reason=f"estimate above the figure of {dev.name}",
            message=warning_message(estimate, dev, figure),
            figures=figures,
        )
    return MemoryVerdict(
        "ok", estimate, dev, compute_figure=figure, refuse_figure=limit, figures=figures
    )


def _check_system(estimate: int, figs: HostFigures, dev: Device, how: str) -> MemoryVerdict:
    """The CPU or an integrated GPU computes (host memory; an integrated GPU's own figures
    may count it several times): only MemAvailable counts, on Linux and macOS."""
    if figs.os == "windows":
        return MemoryVerdict(
            "skip",
            estimate,
            dev,
            reason="the Windows CPU and integrated GPUs are not memory-checked",
        )
    available = figs.mem_available
    if available is None:
        return MemoryVerdict("skip", estimate, dev, reason="the OS reports no MemAvailable")
    figures: dict[str, int | None] = {"MemAvailable": available, "estimate": estimate}
    if estimate > available:
        message = _refusal_message(
            estimate, how, [("MemAvailable", available)], available, "system memory"
        )
        return MemoryVerdict(
            "refuse",
            estimate,
            dev,
            compute_figure=available,
            refuse_figure=available,
            reason=f"estimate above MemAvailable ({dev.name} uses system memory)",
            message=message,
            figures=figures,
        )
    return MemoryVerdict(
        "ok", estimate, dev, compute_figure=available, refuse_figure=available, figures=figures
    )


def raise_if_refused(verdict: MemoryVerdict) -> None:
    """Raise ModelTooLargeError for a refusal, carrying the estimate and every figure."""
    if verdict.action == "refuse":
        raise ModelTooLargeError(verdict.message, verdict.estimate, dict(verdict.figures))
