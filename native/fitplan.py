"""Where the diffusion model, the text encoders and the VAE go when a model loads.

master-596 has no automatic fit (the seed's runtime has one): placement there is manual, through
`keep_clip_on_cpu`, `keep_vae_on_cpu`, `offload_params_to_cpu` and `max_vram` (a GiB budget for
segmented parameter offload). So the engine plans it the way the seed describes the automatic
fit: each part on the compute GPU when it fits its free memory with room to compute, otherwise
in system memory. Pure: the figure comes in from the memory rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .devices import Device, GiB, format_bytes

PARTS = ("diffusion", "text_encoders", "vae")
"""The parts in planning order: the diffusion model runs every step, so it gets the GPU first."""

MIN_MAX_VRAM_GIB = 0.1
"""The smallest max_vram the plan sets when it offloads. In master-596 a max_vram of 0 means no
budget at all (src/stable-diffusion.cpp: `max_vram <= 0.f ? 0`; ggml_extend.hpp then skips the
segmented compute), so the whole diffusion model would go to the GPU for each step: with no
room left, the smallest budget is the safe one, never 0."""

Placement = Literal["gpu", "cpu", "gpu+offload"]


@dataclass(frozen=True)
class FitPlan:
    """A placement and the runtime flags that realise it.

    placement: part -> "gpu", "cpu", or "gpu+offload" (diffusion only: weights in system
    memory, compute on the GPU, streamed in segments of at most `max_vram` GiB).
    max_vram: GiB, 0 = no cap. budget: the bytes left for weights after the room to compute
    (None when the device reports no memory or is the CPU).
    """

    device: str
    placement: dict[str, Placement]
    keep_clip_on_cpu: bool = False
    keep_vae_on_cpu: bool = False
    offload_params_to_cpu: bool = False
    max_vram: float = 0.0
    budget: int | None = None
    notes: tuple[str, ...] = field(default=())

    def summary(self) -> str:
        """One line for logs and capabilities, such as
        "Vulkan0: diffusion gpu, text_encoders cpu, vae gpu (budget 10.0 GiB)"."""
        parts = ", ".join(f"{part} {self.placement[part]}" for part in PARTS)
        extras = []
        if self.budget is not None:
            extras.append(f"budget {_gib(self.budget)}")
        if self.offload_params_to_cpu:
            extras.append(f"max_vram {self.max_vram:.1f} GiB")
        tail = f" ({', '.join(extras)})" if extras else ""
        return f"{self.device}: {parts}{tail}"

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (capabilities, heartbeats)."""
        return {
            "device": self.device,
            "placement": dict(self.placement),
            "keep_clip_on_cpu": self.keep_clip_on_cpu,
            "keep_vae_on_cpu": self.keep_vae_on_cpu,
            "offload_params_to_cpu": self.offload_params_to_cpu,
            "max_vram": self.max_vram,
            "budget": self.budget,
            "summary": self.summary(),
        }


def _gib(n: int) -> str:
    """GiB with one decimal, rounded down so a budget never reads larger than it is."""
    sign = "-" if n < 0 else ""
    tenths = (abs(n) * 10) // GiB
    return f"{sign}{tenths // 10}.{tenths % 10} GiB"


def _with_room(weights: int) -> int:
    """A part's weights plus a quarter: the seed's allowance for the buffers around them."""
    return weights + weights // 4


def plan_fit(
    components: dict[str, int], device: Device, figure: int | None, work_bytes: int
) -> FitPlan:
    """Plan where each part goes on `device`, whose memory figure is `figure` (see
    `gpu_figure`), keeping `work_bytes` free for compute buffers.

    components: weight bytes per part ("diffusion", "text_encoders", "vae"; missing = 0).
    On the CPU everything is on the CPU with no flags. With no figure (the GPU reports no
    memory) everything goes to the GPU: there is nothing to plan with, as with the seed.
    Otherwise, in the order diffusion, text encoders, VAE, a part goes to the GPU when its
    weights plus a quarter fit the budget left; else the diffusion model is offloaded
    (weights in system memory, segmented compute on the GPU within the budget left), and the
    text encoders or the VAE stay on the CPU.

    In master-596 offload_params_to_cpu applies to every part's weights, not only the
    diffusion model's: parts placed "gpu" then keep their weights in system memory too and
    copy them to the GPU to compute. The placement still says where each part computes.
    """
    unknown = set(components) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown model parts {sorted(unknown)}: expected {list(PARTS)}")
    if any(v < 0 for v in components.values()) or work_bytes < 0:
        raise ValueError("plan_fit takes non-negative sizes")

    if device.type not in ("gpu", "igpu"):
        return FitPlan(device.name, dict.fromkeys(PARTS, "cpu"))
    if figure is None:
        return FitPlan(
            device.name,
            dict.fromkeys(PARTS, "gpu"),
            notes=(f"{device.name} reports no memory: nothing to plan with",),
        )

    budget = figure - work_bytes
    remaining = budget
    placement: dict[str, Placement] = {}
    flags = {"keep_clip_on_cpu": False, "keep_vae_on_cpu": False, "offload": False}
    max_vram = 0.0
    notes: list[str] = []
    for part in PARTS:
        weights = components.get(part, 0)
        need = _with_room(weights)
        if weights == 0 or need <= remaining:  # an absent part has nothing to place
            placement[part] = "gpu"
            remaining -= need
            continue
        if part == "diffusion":
            placement[part] = "gpu+offload"
            flags["offload"] = True
            tenths = (max(0, remaining) * 10) // GiB
            max_vram = max(tenths / 10, MIN_MAX_VRAM_GIB)
            notes.append(
                f"diffusion {format_bytes(need)} with room exceeds the budget left "
                f"{format_bytes(max(0, remaining))}: offloaded, max_vram {max_vram:.1f} GiB"
            )
            remaining = 0  # the segmented offload uses the whole budget left
        else:
            placement[part] = "cpu"
            flags["keep_clip_on_cpu" if part == "text_encoders" else "keep_vae_on_cpu"] = True
            notes.append(
                f"{part} {format_bytes(need)} with room exceeds the budget left "
                f"{format_bytes(max(0, remaining))}: kept on the CPU"
            )
    return FitPlan(
        device.name,
        placement,
        keep_clip_on_cpu=flags["keep_clip_on_cpu"],
        keep_vae_on_cpu=flags["keep_vae_on_cpu"],
        offload_params_to_cpu=flags["offload"],
        max_vram=max_vram,
        budget=budget,
        notes=tuple(notes),
    )
