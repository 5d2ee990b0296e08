"""Devices and their memory figures, as the runtime (ggml) reports them.

Pure data and rules: the figures come from `probe.py` in a short-lived subprocess, or from a
test's table, so every rule is checked on reported figures without the hardware.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MiB = 1024 * 1024
GiB = 1024 * MiB

# ggml_backend_dev_type values.
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


@dataclass(frozen=True)
class Device:
    """One ggml device: `name` is ggml's (`CPU`, `Vulkan0`, `CUDA0`), `type` is one of
    cpu / gpu (discrete) / igpu / accel, `free` and `total` are the bytes ggml reports."""

    index: int
    name: str
    description: str
    type: str
    free: int
    total: int


@dataclass(frozen=True)
class HostFigures:
    """Everything the memory rules read about a host: ggml's devices, MemAvailable (None
    when the OS does not tell), the OS (`linux`, `darwin`, `windows`) and the environment
    variables that select a device (SD_VK_DEVICE, GGML_VK_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES).
    """

    devices: tuple[Device, ...]
    mem_available: int | None
    os: str = "linux"
    env: dict[str, str] = field(default_factory=dict)


# --- figure rules -------------------------------------------------------------------------------


def gpu_figure(dev: Device) -> int | None:
    """The bytes that count for a GPU, as the seed defines them.

    - None when the GPU reports no memory (total 0): nothing can be checked against it.
    - total when the driver reports no budget: without VK_EXT_memory_budget ggml reports the
      total as free (free == total), and a free above the total is no budget either.
    - 0 when free is 0 against a positive total: the process is over its budget, so the GPU
      has no free memory (every model warns, and the GPU adds nothing to the refusal sum).
    - free otherwise: the budget, which accounts for other processes and models loaded.
    """
    if dev.total <= 0:
        return None
    if dev.free >= dev.total:
        return dev.total
    if dev.free <= 0:
        return 0
    return dev.free


def discrete_gpus(figs: HostFigures) -> tuple[Device, ...]:
    """The discrete GPUs (type "gpu") in listing order; integrated GPUs use host memory and
    never count as GPU memory."""
    return tuple(d for d in figs.devices if d.type == "gpu")


def _cpu_device(figs: HostFigures) -> Device | None:
    return next((d for d in figs.devices if d.type == "cpu"), None)


def _figure_key(dev: Device) -> int:
    figure = gpu_figure(dev)
    return -1 if figure is None else figure


def choose_compute_device(figs: HostFigures, choice: str) -> Device:
    """The device that computes, following the runtime's own choice so the warning names it.

    `choice`: "auto" = the discrete GPU with the most free memory (by `gpu_figure`) wherever it
    is listed (ties: the first listed); "gpu" = the first discrete GPU; "cpu" = the CPU device;
    anything else is a device name such as "Vulkan1" (case-insensitive). With no discrete GPU,
    auto and gpu fall back to the first integrated GPU, then the CPU: the runtime's order.
    Integrated GPUs are never chosen by auto or gpu while a discrete one exists.

    Raises ValueError naming the available devices when the choice matches nothing.
    """
    key = choice.strip()
    lowered = key.lower()
    gpus = discrete_gpus(figs)
    picked: Device | None
    if lowered in ("auto", "gpu"):
        if gpus:
            picked = max(gpus, key=_figure_key) if lowered == "auto" else gpus[0]
        else:
            igpus = [d for d in figs.devices if d.type == "igpu"]
            picked = igpus[0] if igpus else _cpu_device(figs)
    elif lowered == "cpu":
        picked = _cpu_device(figs)
    else:
        picked = next((d for d in figs.devices if d.name == key), None) or next(
            (d for d in figs.devices if d.name.lower() == lowered), None
        )
    if picked is None:
        available = ", ".join(d.name for d in figs.devices) or "none"
        raise ValueError(
            f"unknown device {choice!r}: choose auto, gpu, cpu or one of the devices "
            f"listed ({available})"
        )
    return picked


def backend_name(figs: HostFigures) -> str:
    """The name capabilities report as the backend: the first GPU listed (discrete or
    integrated), else "CPU". The seed keeps this even when auto computes on another GPU."""
    first = next((d for d in figs.devices if d.type in ("gpu", "igpu")), None)
    return first.name if first is not None else "CPU"


def device_label(dev: Device) -> str:
    """A human label for a device, such as "Vulkan0 (NVIDIA H200)"."""
    return f"{dev.name} ({dev.description})" if dev.description else dev.name


def device_figure(dev: Device, os: str) -> int | None:
    """The figure a discrete GPU contributes on this OS: on macOS the Metal working set (the
    device's total; Metal's free counts only this process's allocations), else `gpu_figure`."""
    if os == "darwin":
        return dev.total if dev.total > 0 else None
    return gpu_figure(dev)


def figures_summary(
    figs: HostFigures, devices: Sequence[Device] | None = None
) -> dict[str, int | None]:
    """The figures the memory rules use, by human label, for error messages and JSON.

    One entry per discrete GPU (`devices` restricts them, e.g. to the device a worker is
    pinned to) with its figure (None: reports no memory), then "MemAvailable". Integrated
    GPUs and the CPU device are left out: their own figures never count.
    """
    listed = discrete_gpus(figs) if devices is None else tuple(devices)
    summary: dict[str, int | None] = {
        device_label(d): device_figure(d, figs.os) for d in listed if d.type == "gpu"
    }
    summary["MemAvailable"] = figs.mem_available
    return summary


def format_bytes(n: int | None) -> str:
    """Bytes for people: "3.54 GiB", "512 MiB", "1.5 KiB", "12 B"; "unknown" for None."""
    if n is None:
        return "unknown"
    sign = "-" if n < 0 else ""
    size = abs(n)
    for unit, factor in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if size >= factor:
            if unit == "GiB":
                return f"{sign}{size / factor:.2f} {unit}"
            if size % factor == 0:
                return f"{sign}{size // factor} {unit}"
            return f"{sign}{size / factor:.1f} {unit}"
    return f"{sign}{size} B"
