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
from dataclasses import dataclass
from typing import Any

from sdfarm.native import memory
from sdfarm.native.devices import Device

VAE_TILE_LATENT = 32
"""A tiled decode's tile side in latent cells: the runtime's own default (vae.hpp
get_tile_sizes), 256 output pixels for a VAE that scales by 8, 512 for one that scales by 16."""

VAE_TILE_PIXELS = VAE_TILE_LATENT * 16
"""The tile side in output pixels the tiled estimate assumes: the larger of the two scales,
since a model's facts do not say which its VAE has (cautious by 4x in area for SD, SDXL, Flux
and the tiny model, whose VAEs scale by 8)."""


@dataclass(frozen=True)
class ModelFacts:
    """What a model's estimate needs: its files' total bytes, its native size and what this
    device's decode adds per output pixel."""

    bytes: int
    native_size: tuple[int, int]
    decode_per_pixel: int = 0

    def estimate(
        self,
        width: int,
        height: int,
        encodes: bool = False,
        extra_bytes: int = 0,
        tiled: bool = False,
    ) -> int:
        """The peak memory estimate of this model generating width x height images; an image
        to encode first (img2img, inpainting) adds the encoder's working memory, which is the
        decoder's per pixel (the same convolutions run the other way); `extra_bytes` are the
        files a job adds (its LoRAs), counted like the model's (the seed's quarter on top).
        `tiled`: the VAE decodes (and encodes) in tiles of VAE_TILE_PIXELS a side, which
        bounds the decode's terms by a tile (memory.tiled_estimate_bytes says which)."""
        nw, nh = self.native_size
        per_pixel = self.decode_per_pixel * (2 if encodes else 1)
        if tiled:
            return memory.tiled_estimate_bytes(
                self.bytes + extra_bytes,
                int(width),
                int(height),
                nw * nh,
                VAE_TILE_PIXELS,
                decode_per_pixel=per_pixel,
            )
        return memory.estimate_bytes(
            self.bytes + extra_bytes,
            int(width),
            int(height),
            nw * nh,
            decode_per_pixel=per_pixel,
        )

    def resident(self) -> int:
        """The estimate at the native size: what a loaded engine of this model holds."""
        return self.estimate(*self.native_size)

    def as_json(self) -> dict[str, Any]:
        """The heartbeat's form: {bytes, native_size: [w, h], decode_per_pixel}."""
        return {
            "bytes": self.bytes,
            "native_size": list(self.native_size),
            "decode_per_pixel": self.decode_per_pixel,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ModelFacts:
        """The facts of a heartbeat's `models` entry (ValueError when malformed)."""
        w, h = doc["native_size"]
        return cls(int(doc["bytes"]), (int(w), int(h)), int(doc.get("decode_per_pixel") or 0))

    @classmethod
    def cautious(cls, facts: list[ModelFacts]) -> ModelFacts:
        """One set of facts valid on every device that reported one: hosts whose copies or
        decode paths differ give the largest file size and decode term and the smallest
        native size, so one estimate per job covers every device that may get it."""
        native = min((f.native_size for f in facts), key=lambda s: s[0] * s[1])
        return cls(max(f.bytes for f in facts), native, max(f.decode_per_pixel for f in facts))


def model_facts(model: Any, device: Device) -> ModelFacts:
    """The facts of a loaded or loadable `Model` (sdfarm.native.model) on `device`."""
    return ModelFacts(
        model.total_bytes, tuple(model.native_size), decode_bytes_per_pixel(model.files, device)
    )


def use_vae_conv_direct(roles: Mapping[str, object], device: str) -> bool:
    """Direct VAE convolution keeps the full VAE's decode inside the estimate on the CPU
    (facts: 3.14 vs 4.06 GiB at 512x512) and costs nothing on Vulkan (0.30 s per 512x512
    image on the H200), but ggml's CUDA direct convolution made the full-size model's
    512x512 image take 2.02 s against 0.28 s without it (bench/results/gpu), so CUDA uses the
    im2col path. TAESD's decode is small either way and runs 2x slower with it on the CPU.
    `SDFARM_VAE_CONV_DIRECT=0|1` overrides, for measurements."""
    forced = os.environ.get("SDFARM_VAE_CONV_DIRECT")
    if forced in ("0", "1"):
        return forced == "1"
    return "taesd" not in roles and not device.startswith("CUDA")


def decode_bytes_per_pixel(roles: Mapping[str, object], device: Device) -> int:
    """Decode working memory per output pixel beyond the seed's estimate: the full VAE
    without direct convolution on a GPU (memory.IM2COL_DECODE_BYTES_PER_PIXEL), else 0."""
    if device.type == "cpu" or "taesd" in roles or use_vae_conv_direct(roles, device.name):
        return 0
    return memory.IM2COL_DECODE_BYTES_PER_PIXEL
