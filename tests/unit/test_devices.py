"""Figure rules and device choice, on reported figures only (no hardware)."""

from __future__ import annotations

import pytest

from sdfarm.native.devices import (
    Device,
    GiB,
    HostFigures,
    MiB,
    backend_name,
    choose_compute_device,
    discrete_gpus,
    figures_summary,
    format_bytes,
    gpu_figure,
)


def dev(index: int, name: str, type_: str, free: int, total: int, desc: str = "") -> Device:
    return Device(index, name, desc or name, type_, free, total)


CPU = dev(0, "CPU", "cpu", 24 * GiB, 24 * GiB, "AMD EPYC")


def host(*devices: Device, mem: int | None = 16 * GiB, os: str = "linux") -> HostFigures:
    return HostFigures(devices=tuple(devices), mem_available=mem, os=os)


@pytest.mark.parametrize(
    ("free", "total", "expected"),
    [
        pytest.param(40 * GiB, 80 * GiB, 40 * GiB, id="budget-reported-free-below-total"),
        pytest.param(80 * GiB, 80 * GiB, 80 * GiB, id="no-budget-free-equals-total"),
        pytest.param(90 * GiB, 80 * GiB, 80 * GiB, id="no-budget-free-above-total"),
        pytest.param(0, 80 * GiB, 0, id="over-budget-free-0"),
        pytest.param(0, 0, None, id="reports-no-memory"),
        pytest.param(5 * GiB, 0, None, id="free-but-no-total-reports-no-memory"),
    ],
)
def test_gpu_figure(free: int, total: int, expected: int | None) -> None:
    assert gpu_figure(dev(1, "Vulkan0", "gpu", free, total)) == expected


V0 = dev(1, "Vulkan0", "gpu", 10 * GiB, 24 * GiB, "NVIDIA L4")
V1 = dev(2, "Vulkan1", "gpu", 70 * GiB, 80 * GiB, "NVIDIA H100")
IG = dev(3, "Vulkan2", "igpu", 60 * GiB, 64 * GiB, "AMD Radeon 780M")
IG_FIRST = dev(1, "Vulkan0", "igpu", 60 * GiB, 64 * GiB, "Intel Iris Xe")


@pytest.mark.parametrize(
    ("devices", "choice", "expected"),
    [
        pytest.param((CPU, V0, V1), "auto", "Vulkan1", id="auto-most-free-listed-second"),
        pytest.param((CPU, V1, V0), "auto", "Vulkan1", id="auto-most-free-listed-first"),
        pytest.param((CPU, V0, V1), "gpu", "Vulkan0", id="gpu-first-discrete"),
        pytest.param((CPU, V0, V1), "cpu", "CPU", id="cpu"),
        pytest.param((CPU, V0, V1), "Vulkan1", "Vulkan1", id="by-name"),
        pytest.param((CPU, V0, V1), "vulkan1", "Vulkan1", id="by-name-any-case"),
        pytest.param((CPU, IG_FIRST, V0), "auto", "Vulkan0", id="auto-skips-igpu-listed-first"),
        pytest.param((CPU, IG_FIRST, V0), "gpu", "Vulkan0", id="gpu-skips-igpu-listed-first"),
        pytest.param((CPU, IG), "auto", "Vulkan2", id="auto-igpu-only"),
        pytest.param((CPU, IG), "gpu", "Vulkan2", id="gpu-igpu-only"),
        pytest.param((CPU,), "auto", "CPU", id="auto-cpu-only"),
        pytest.param((CPU,), "gpu", "CPU", id="gpu-cpu-only"),
        pytest.param((CPU, IG_FIRST), "Vulkan0", "Vulkan0", id="igpu-by-name"),
    ],
)
def test_choose_compute_device(devices: tuple[Device, ...], choice: str, expected: str) -> None:
    assert choose_compute_device(host(*devices), choice).name == expected


def test_choose_unknown_device_names_available_ones() -> None:
    with pytest.raises(ValueError, match=r"Vulkan7.*CPU, Vulkan0, Vulkan1"):
        choose_compute_device(host(CPU, V0, V1), "Vulkan7")


def test_auto_tie_goes_to_first_listed() -> None:
    a = dev(1, "Vulkan0", "gpu", 8 * GiB, 8 * GiB)
    b = dev(2, "Vulkan1", "gpu", 8 * GiB, 8 * GiB)
    assert choose_compute_device(host(CPU, a, b), "auto").name == "Vulkan0"


def test_discrete_gpus_leave_out_igpu_and_cpu() -> None:
    assert discrete_gpus(host(CPU, IG_FIRST, V0, V1)) == (V0, V1)


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        pytest.param((CPU, V0, V1), "Vulkan0", id="first-discrete"),
        pytest.param((CPU, IG_FIRST, V0), "Vulkan0", id="igpu-listed-first"),
        pytest.param((CPU, IG), "Vulkan2", id="igpu-only"),
        pytest.param((CPU,), "CPU", id="cpu-only"),
    ],
)
def test_backend_name_is_first_gpu_listed(devices: tuple[Device, ...], expected: str) -> None:
    assert backend_name(host(*devices)) == expected


def test_figures_summary_labels_discrete_gpus_and_mem_available() -> None:
    silent = dev(4, "Vulkan3", "gpu", 0, 0, "Mystery GPU")
    summary = figures_summary(host(CPU, V0, IG, silent, mem=12 * GiB))
    assert summary == {
        "Vulkan0 (NVIDIA L4)": 10 * GiB,
        "Vulkan3 (Mystery GPU)": None,
        "MemAvailable": 12 * GiB,
    }


def test_figures_summary_darwin_uses_metal_working_set() -> None:
    metal = dev(1, "MTL0", "gpu", 1 * GiB, 48 * GiB, "Apple M4 Max")
    assert figures_summary(host(CPU, metal, os="darwin"))["MTL0 (Apple M4 Max)"] == 48 * GiB


@pytest.mark.parametrize(
    ("n", "text"),
    [
        pytest.param(3_796_070_932, "3.54 GiB", id="gib-sd-turbo-estimate"),
        pytest.param(GiB, "1.00 GiB", id="one-gib"),
        pytest.param(512 * MiB, "512 MiB", id="mib-whole"),
        pytest.param(1536 * 1024, "1.5 MiB", id="mib-fraction"),
        pytest.param(3 * 1024, "3 KiB", id="kib"),
        pytest.param(12, "12 B", id="bytes"),
        pytest.param(0, "0 B", id="zero"),
        pytest.param(None, "unknown", id="none"),
    ],
)
def test_format_bytes(n: int | None, text: str) -> None:
    assert format_bytes(n) == text
