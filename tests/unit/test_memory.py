"""The memory check's rules (seed: "Memory check", "Vulkan GPUs"), on reported figures only."""

from __future__ import annotations

import pytest

from sdfarm.native.devices import Device, GiB, HostFigures, MiB
from sdfarm.native.errors import ModelTooLargeError
from sdfarm.native.memory import (
    GROWTH_BYTES_PER_PIXEL,
    SEED_OVERHEAD,
    MemoryVerdict,
    check_memory,
    describe_estimate,
    estimate_bytes,
    raise_if_refused,
)


def dev(index: int, name: str, type_: str, free: int, total: int, desc: str) -> Device:
    return Device(index, name, desc, type_, free, total)


CPU = dev(0, "CPU", "cpu", 64 * GiB, 64 * GiB, "AMD EPYC")
L4 = dev(1, "Vulkan0", "gpu", 20 * GiB, 22 * GiB, "NVIDIA L4")  # budget reported
L4_NO_BUDGET = dev(1, "Vulkan0", "gpu", 22 * GiB, 22 * GiB, "NVIDIA L4")
L4_FREE_ABOVE = dev(1, "Vulkan0", "gpu", 30 * GiB, 22 * GiB, "NVIDIA L4")
L4_OVER = dev(1, "Vulkan0", "gpu", 0, 22 * GiB, "NVIDIA L4")  # over its budget
SILENT = dev(1, "Vulkan0", "gpu", 0, 0, "Mystery GPU")  # reports no memory
SMALL = dev(1, "Vulkan0", "gpu", 6 * GiB, 8 * GiB, "NVIDIA RTX 3070")
BIG = dev(2, "Vulkan1", "gpu", 40 * GiB, 80 * GiB, "NVIDIA H100")
IGPU = dev(3, "Vulkan2", "igpu", 60 * GiB, 64 * GiB, "AMD Radeon 780M")
IGPU_ONLY = dev(1, "Vulkan0", "igpu", 60 * GiB, 64 * GiB, "Intel Iris Xe")
METAL = dev(1, "MTL0", "gpu", 1 * GiB, 48 * GiB, "Apple M4 Max")


def host(
    *devices: Device,
    mem: int | None = 16 * GiB,
    os: str = "linux",
    env: dict[str, str] | None = None,
) -> HostFigures:
    return HostFigures(devices=tuple(devices), mem_available=mem, os=os, env=env or {})


# (host, estimate, choice, expected action, expected compute device name or None)
SCENARIOS = [
    # One discrete GPU on Linux: the figure is free (budget) or total (no budget).
    pytest.param(host(CPU, L4), 10 * GiB, "auto", "ok", "Vulkan0", id="linux-budget-fits"),
    pytest.param(host(CPU, L4), 21 * GiB, "auto", "warn", "Vulkan0", id="linux-budget-warn"),
    pytest.param(
        host(CPU, L4_NO_BUDGET), 21 * GiB, "auto", "ok", "Vulkan0", id="linux-no-budget-total"
    ),
    pytest.param(
        host(CPU, L4_FREE_ABOVE), 21 * GiB, "auto", "ok", "Vulkan0", id="linux-free-above-total"
    ),
    pytest.param(
        host(CPU, L4_FREE_ABOVE), 23 * GiB, "auto", "warn", "Vulkan0", id="linux-free-above-warn"
    ),
    # Sum = 20 GiB + MemAvailable 16 GiB = 36 GiB.
    pytest.param(host(CPU, L4), 36 * GiB, "auto", "warn", "Vulkan0", id="linux-sum-exactly"),
    pytest.param(host(CPU, L4), 37 * GiB, "auto", "refuse", "Vulkan0", id="linux-above-sum"),
    # Over budget: every model warns; the GPU adds nothing to the sum.
    pytest.param(host(CPU, L4_OVER), 1 * GiB, "auto", "warn", "Vulkan0", id="over-budget-warns"),
    pytest.param(
        host(CPU, L4_OVER), 17 * GiB, "auto", "refuse", "Vulkan0", id="over-budget-above-mem"
    ),
    # No MemAvailable on Linux: only the warning.
    pytest.param(
        host(CPU, L4, mem=None), 99 * GiB, "auto", "warn", "Vulkan0", id="linux-no-memavail"
    ),
    # Windows never refuses a GPU model; its CPU and integrated GPUs are not checked.
    pytest.param(
        host(CPU, L4, os="windows"), 999 * GiB, "auto", "warn", "Vulkan0", id="windows-warn-only"
    ),
    pytest.param(host(CPU, L4, os="windows"), 10 * GiB, "auto", "ok", "Vulkan0", id="windows-fits"),
    pytest.param(host(CPU, os="windows"), 999 * GiB, "auto", "skip", "CPU", id="windows-cpu-skip"),
    pytest.param(
        host(CPU, IGPU_ONLY, os="windows"), 999 * GiB, "auto", "skip", "Vulkan0", id="win-igpu"
    ),
    # Integrated GPUs: never counted beside a discrete GPU; alone, MemAvailable counts.
    pytest.param(
        host(CPU, L4, IGPU), 37 * GiB, "auto", "refuse", "Vulkan0", id="igpu-adds-nothing"
    ),
    pytest.param(host(CPU, IGPU_ONLY), 15 * GiB, "auto", "ok", "Vulkan0", id="igpu-only-fits"),
    pytest.param(
        host(CPU, IGPU_ONLY), 17 * GiB, "auto", "refuse", "Vulkan0", id="igpu-only-above-mem"
    ),
    # The CPU: MemAvailable, on Linux and macOS.
    pytest.param(host(CPU), 15 * GiB, "auto", "ok", "CPU", id="cpu-fits"),
    pytest.param(host(CPU), 17 * GiB, "auto", "refuse", "CPU", id="cpu-above-mem"),
    pytest.param(host(CPU, L4), 17 * GiB, "cpu", "refuse", "CPU", id="cpu-chosen-beside-gpu"),
    pytest.param(host(CPU, os="darwin"), 17 * GiB, "auto", "refuse", "CPU", id="darwin-cpu"),
    pytest.param(host(CPU, mem=None), 17 * GiB, "auto", "skip", "CPU", id="cpu-no-memavail"),
    # macOS Metal: the working set (the total), no sum, whatever Metal's free says.
    pytest.param(host(CPU, METAL, os="darwin"), 40 * GiB, "auto", "ok", "MTL0", id="metal-fits"),
    pytest.param(
        host(CPU, METAL, os="darwin", mem=64 * GiB),
        49 * GiB,
        "auto",
        "refuse",
        "MTL0",
        id="metal-above-working-set",
    ),
    # No GPU memory reported: no check at all.
    pytest.param(host(CPU, SILENT), 999 * GiB, "auto", "skip", "Vulkan0", id="silent-gpu-skip"),
    pytest.param(
        host(CPU, L4, dev(2, "Vulkan1", "gpu", 0, 0, "Mystery")),
        999 * GiB,
        "auto",
        "skip",
        "Vulkan0",
        id="any-silent-discrete-gpu-skips",
    ),
    # Several discrete GPUs: auto = most free (listed second), gpu = the first.
    pytest.param(host(CPU, SMALL, BIG), 10 * GiB, "auto", "ok", "Vulkan1", id="auto-most-free"),
    pytest.param(host(CPU, SMALL, BIG), 10 * GiB, "gpu", "warn", "Vulkan0", id="gpu-first"),
    # Sum = 6 + 40 + 16 = 62 GiB.
    pytest.param(host(CPU, SMALL, BIG), 62 * GiB, "auto", "warn", "Vulkan1", id="two-gpus-sum"),
    pytest.param(
        host(CPU, SMALL, BIG), 63 * GiB, "auto", "refuse", "Vulkan1", id="two-gpus-above-sum"
    ),
    # The user set SD_VK_DEVICE: the engine cannot know the device.
    pytest.param(
        host(CPU, L4, env={"SD_VK_DEVICE": "0"}), 999 * GiB, "auto", "skip", None, id="sd-vk-set"
    ),
    # A device OS we do not know: not checked.
    pytest.param(host(CPU, L4, os="freebsd"), 999 * GiB, "auto", "skip", "Vulkan0", id="os-unk"),
]


@pytest.mark.parametrize(("figs", "estimate", "choice", "action", "device"), SCENARIOS)
def test_check_memory_action(
    figs: HostFigures, estimate: int, choice: str, action: str, device: str | None
) -> None:
    verdict = check_memory(estimate, figs, choice)
    assert verdict.action == action, verdict
    assert (verdict.compute_device.name if verdict.compute_device else None) == device
    if action in ("ok", "skip"):
        assert verdict.message == ""
    else:
        assert verdict.message
    if action == "skip":
        assert verdict.reason


def test_disabled_skips_with_no_message() -> None:
    verdict = check_memory(999 * GiB, host(CPU, L4_OVER), enabled=False)
    assert (verdict.action, verdict.reason, verdict.message) == ("skip", "check_memory off", "")
    raise_if_refused(verdict)  # no error


def test_skip_reasons_name_the_cause() -> None:
    assert "SD_VK_DEVICE" in check_memory(1, host(CPU, L4, env={"SD_VK_DEVICE": "0"})).reason
    assert "Vulkan0" in check_memory(1, host(CPU, SILENT)).reason
    assert "reports no memory" in check_memory(1, host(CPU, SILENT)).reason
    reason = check_memory(1, host(CPU, os="windows")).reason
    assert reason == "the Windows CPU and integrated GPUs are not memory-checked"


@pytest.mark.parametrize(
    ("env", "pinned", "estimate", "action", "compute"),
    [
        # Pinned by sdfarm: checked on the pinned GPU's figures, whatever the variables say.
        pytest.param({"SD_VK_DEVICE": "0"}, "Vulkan0", 10 * GiB, "warn", "Vulkan0", id="pin-0"),
        pytest.param({"SD_VK_DEVICE": "1"}, "Vulkan1", 10 * GiB, "ok", "Vulkan1", id="pin-1"),
        pytest.param(
            {"GGML_VK_VISIBLE_DEVICES": "0", "SD_VK_DEVICE": "0"},
            "Vulkan0",
            10 * GiB,
            "warn",
            "Vulkan0",
            id="pin-visible-devices",
        ),
        pytest.param(
            {"CUDA_VISIBLE_DEVICES": "1"}, "Vulkan1", 10 * GiB, "ok", "Vulkan1", id="pin-cuda"
        ),
        # Pinned to the small GPU: its sum is its own figure + MemAvailable (6 + 16), the other
        # GPU belongs to another worker.
        pytest.param({"SD_VK_DEVICE": "0"}, "Vulkan0", 23 * GiB, "refuse", "Vulkan0", id="pin-sum"),
    ],
)
def test_pinned_device_is_checked(
    env: dict[str, str], pinned: str, estimate: int, action: str, compute: str
) -> None:
    figs = host(CPU, SMALL, BIG, env=env)
    verdict = check_memory(estimate, figs, pinned=pinned)
    assert verdict.action == action
    assert verdict.compute_device is not None and verdict.compute_device.name == compute


def test_pinned_refusal_counts_only_the_pinned_gpu() -> None:
    verdict = check_memory(23 * GiB, host(CPU, SMALL, BIG), pinned="Vulkan0")
    assert verdict.refuse_figure == 6 * GiB + 16 * GiB
    assert "Vulkan1" not in verdict.message
    assert set(verdict.figures) == {"Vulkan0 (NVIDIA RTX 3070)", "MemAvailable", "estimate"}


def test_warning_text_names_computing_gpu_and_both_numbers() -> None:
    verdict = check_memory(8 * GiB, host(CPU, SMALL, BIG), "gpu")
    assert verdict.message == (
        f"model estimate 8.00 GiB ({8 * GiB} bytes) exceeds the free memory of Vulkan0 "
        f"(NVIDIA RTX 3070): 6.00 GiB ({6 * GiB} bytes); part of the model stays in system "
        "memory and generation will be slower"
    )
    assert verdict.compute_figure == 6 * GiB


def test_auto_warning_names_the_gpu_listed_second() -> None:
    verdict = check_memory(45 * GiB, host(CPU, SMALL, BIG), "auto")
    assert verdict.action == "warn"
    assert "free memory of Vulkan1 (NVIDIA H100): 40.00 GiB" in verdict.message
    assert "Vulkan0" not in verdict.message


def test_over_budget_warning_says_zero() -> None:
    verdict = check_memory(1 * GiB, host(CPU, L4_OVER))
    assert verdict.compute_figure == 0
    assert "free memory of Vulkan0 (NVIDIA L4): 0 B (0 bytes)" in verdict.message


def test_refusal_message_names_estimate_and_every_figure() -> None:
    how = describe_estimate(40 * GiB, 1024, 1024, 1024 * 1024)
    estimate = estimate_bytes(40 * GiB, 1024, 1024, 1024 * 1024)
    figs = host(CPU, SMALL, BIG, IGPU, mem=3 * GiB)
    verdict = check_memory(estimate, figs, how=how)
    assert verdict.action == "refuse"
    assert verdict.refuse_figure == (6 + 40 + 3) * GiB
    message = verdict.message
    for part in (
        f"estimate 50.50 GiB ({estimate} bytes)",
        "model files 40.00 GiB + a quarter 10.00 GiB + 512 MiB",
        f"Vulkan0 (NVIDIA RTX 3070) 6.00 GiB ({6 * GiB} bytes)",
        f"Vulkan1 (NVIDIA H100) 40.00 GiB ({40 * GiB} bytes)",
        f"MemAvailable 3.00 GiB ({3 * GiB} bytes)",
        f"= 49.00 GiB ({49 * GiB} bytes)",
        "check_memory=False",
        "--no-check-memory",
    ):
        assert part in message, (part, message)
    assert "Vulkan2" not in message  # the integrated GPU is no figure here
    assert verdict.figures == {
        "Vulkan0 (NVIDIA RTX 3070)": 6 * GiB,
        "Vulkan1 (NVIDIA H100)": 40 * GiB,
        "MemAvailable": 3 * GiB,
        "estimate": estimate,
    }
    with pytest.raises(ModelTooLargeError) as caught:
        raise_if_refused(verdict)
    assert str(caught.value) == message
    assert caught.value.estimate == estimate
    assert caught.value.figures == verdict.figures


def test_refusal_default_how_and_over_budget_gpu_adds_zero() -> None:
    verdict = check_memory(17 * GiB, host(CPU, L4_OVER))
    assert verdict.action == "refuse"
    assert verdict.refuse_figure == 16 * GiB
    assert "(model files + a quarter + 512 MiB)" in verdict.message
    assert "Vulkan0 (NVIDIA L4) 0 B (0 bytes)" in verdict.message


def test_cpu_refusal_names_mem_available() -> None:
    verdict = check_memory(17 * GiB, host(CPU))
    assert f"MemAvailable 16.00 GiB ({16 * GiB} bytes)" in verdict.message
    assert verdict.figures == {"MemAvailable": 16 * GiB, "estimate": 17 * GiB}


def test_metal_refusal_names_working_set() -> None:
    verdict = check_memory(49 * GiB, host(CPU, METAL, os="darwin"))
    assert "MTL0 (Apple M4 Max) Metal working set 48.00 GiB" in verdict.message
    assert verdict.refuse_figure == 48 * GiB


def test_ok_and_warn_do_not_raise() -> None:
    for estimate in (1 * GiB, 21 * GiB):
        verdict: MemoryVerdict = check_memory(estimate, host(CPU, L4))
        raise_if_refused(verdict)


def test_unknown_device_choice_is_an_error() -> None:
    with pytest.raises(ValueError, match="Vulkan9"):
        check_memory(1, host(CPU, L4), "Vulkan9")


SD_TURBO_FILE = 2_607_360_016  # runtime.md: the SD-Turbo-class f16 safetensors


@pytest.mark.parametrize(
    ("model", "width", "height", "native", "growth", "expected"),
    [
        pytest.param(0, 512, 512, 512 * 512, None, SEED_OVERHEAD, id="empty-model-overhead-only"),
        pytest.param(
            4 * GiB, 512, 512, 512 * 512, None, 5 * GiB + 512 * MiB, id="files-quarter-overhead"
        ),
        pytest.param(
            SD_TURBO_FILE,
            512,
            512,
            512 * 512,
            None,
            3_796_070_932,
            id="sd-turbo-seed-estimate-3.535-gib",
        ),
        pytest.param(
            4 * GiB, 256, 256, 512 * 512, None, 5 * GiB + 512 * MiB, id="below-native-no-growth"
        ),
        pytest.param(
            4 * GiB,
            1024,
            1024,
            512 * 512,
            None,
            5 * GiB + 512 * MiB + 786_432 * 3 * 1024,
            id="above-native-grows",
        ),
        pytest.param(
            4 * GiB, 1024, 512, 512 * 512, 100, 5 * GiB + 512 * MiB + 262_144 * 100, id="growth-arg"
        ),
        pytest.param(
            3, 1024, 1024, 1024 * 1024, None, 3 + 0 + SEED_OVERHEAD, id="quarter-rounds-down"
        ),
    ],
)
def test_estimate_bytes(
    model: int, width: int, height: int, native: int, growth: int | None, expected: int
) -> None:
    if growth is None:
        assert estimate_bytes(model, width, height, native) == expected
    else:
        assert estimate_bytes(model, width, height, native, growth) == expected


def test_growth_constant_covers_the_measurement() -> None:
    # runtime.md: 5.23 GiB peak at 1024x1024 vs the 3.535 GiB estimate (kept, flash, direct VAE).
    estimate = estimate_bytes(SD_TURBO_FILE, 1024, 1024, 512 * 512)
    assert estimate >= 5.23 * GiB
    assert GROWTH_BYTES_PER_PIXEL == 3 * 1024


def test_estimate_rejects_negative_sizes() -> None:
    with pytest.raises(ValueError):
        estimate_bytes(-1, 512, 512, 512 * 512)


def test_describe_estimate_mentions_growth_only_above_native() -> None:
    assert "growth" not in describe_estimate(GiB, 512, 512, 512 * 512)
    text = describe_estimate(GiB, 1024, 1024, 512 * 512)
    assert "size growth 2.25 GiB" in text
    assert "786432 pixels above the native 262144" in text


def test_im2col_decode_term_covers_the_measured_cuda_peaks():
    """bench/results/gpu/cuda-gpu-memory-recheck.json: the SD-Turbo-class model without
    direct VAE convolution on the H200 peaked at 4.76 GiB (512x512) and 10.01 GiB (1024x1024)."""
    from sdfarm.native.memory import IM2COL_DECODE_BYTES_PER_PIXEL

    size = 2_607_360_040
    for side, peak_gib in ((512, 4.76), (1024, 10.01)):
        plain = estimate_bytes(size, side, side, 512 * 512)
        grown = estimate_bytes(
            size, side, side, 512 * 512, decode_per_pixel=IM2COL_DECODE_BYTES_PER_PIXEL
        )
        assert plain < peak_gib * GiB < grown


@pytest.mark.parametrize(
    ("decoder", "device", "cudnn", "expected", "unet"),
    [
        ("vae", "CPU", False, True, False),
        ("vae", "Vulkan0", False, True, False),
        ("vae", "CUDA0", False, False, False),
        ("vae", "CUDA0", True, True, True),
        ("taesd", "CUDA0", True, False, True),
        ("vae", "CPU", True, True, False),
        ("taesd", "CPU", False, False, False),
    ],
)
def test_direct_convolution_where_it_is_cheap(
    decoder, device, cudnn, expected, unet, monkeypatch, tmp_path
):
    """Direct convolution everywhere but CUDA, and on CUDA only with cuDNN (our build runs it
    there, in the VAE and the diffusion model alike); the diffusion model only on CUDA."""
    from sdfarm.native.estimate import use_diffusion_conv_direct, use_vae_conv_direct

    monkeypatch.delenv("SDFARM_VAE_CONV_DIRECT", raising=False)
    monkeypatch.delenv("SDFARM_UNET_CONV_DIRECT", raising=False)
    lib = tmp_path / "libcudnn.so.9"
    lib.write_bytes(b"")
    monkeypatch.setenv("SDFARM_CUDNN", str(lib) if cudnn else "0")
    assert use_vae_conv_direct(decoder, device) is expected
    assert use_diffusion_conv_direct(device) is unet
