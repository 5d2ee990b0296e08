"""The fit plan: where each part of a model goes, on reported figures only."""

from __future__ import annotations

import json

import pytest

from sdfarm.native.devices import Device, GiB, MiB
from sdfarm.native.fitplan import FitPlan, plan_fit

CPU = Device(0, "CPU", "AMD EPYC", "cpu", 64 * GiB, 64 * GiB)
GPU = Device(1, "Vulkan0", "NVIDIA L4", "gpu", 12 * GiB, 22 * GiB)

# An SDXL-like model: UNet 5 GiB, text encoders 1.6 GiB, VAE 160 MiB.
SDXL = {"diffusion": 5 * GiB, "text_encoders": 1600 * MiB, "vae": 160 * MiB}
WORK = 2 * GiB


@pytest.mark.parametrize(
    ("components", "device", "figure", "placement", "clip", "vae", "offload", "max_vram"),
    [
        pytest.param(SDXL, CPU, 64 * GiB, ("cpu", "cpu", "cpu"), 0, 0, 0, 0.0, id="cpu"),
        pytest.param(SDXL, GPU, 12 * GiB, ("gpu", "gpu", "gpu"), 0, 0, 0, 0.0, id="all-fit"),
        # Budget 8 GiB - 6.25 GiB diffusion = 1.75 GiB < 2 GiB text encoders; VAE 200 MiB fits.
        pytest.param(
            SDXL, GPU, 10 * GiB, ("gpu", "cpu", "gpu"), 1, 0, 0, 0.0, id="text-encoders-to-cpu"
        ),
        # Budget 6.4 GiB - 6.25 GiB = 0.15 GiB: neither the text encoders nor the VAE fit.
        pytest.param(
            SDXL, GPU, int(8.4 * GiB), ("gpu", "cpu", "cpu"), 1, 1, 0, 0.0, id="only-diffusion"
        ),
        # Budget 5.55 GiB < 6.25 GiB: offload within 5.5 GiB (rounded down), the rest on CPU.
        pytest.param(
            SDXL,
            GPU,
            int(7.55 * GiB),
            ("gpu+offload", "cpu", "cpu"),
            1,
            1,
            1,
            5.5,
            id="nothing-fits-offload",
        ),
        # Over budget (figure 0): no room at all; the smallest cap, never 0 (= no cap).
        pytest.param(
            SDXL, GPU, 0, ("gpu+offload", "cpu", "cpu"), 1, 1, 1, 0.1, id="over-budget-min-cap"
        ),
        pytest.param(SDXL, GPU, None, ("gpu", "gpu", "gpu"), 0, 0, 0, 0.0, id="figure-none"),
        # Missing parts count 0 and have nothing to place.
        pytest.param(
            {"diffusion": 1 * GiB}, GPU, 4 * GiB, ("gpu", "gpu", "gpu"), 0, 0, 0, 0.0, id="missing"
        ),
        pytest.param(
            {"diffusion": 8 * GiB, "vae": 100 * MiB},
            GPU,
            4 * GiB,
            ("gpu+offload", "gpu", "cpu"),
            0,
            1,
            1,
            2.0,
            id="offload-missing-text-encoders",
        ),
    ],
)
def test_plan_fit(
    components: dict[str, int],
    device: Device,
    figure: int | None,
    placement: tuple[str, str, str],
    clip: int,
    vae: int,
    offload: int,
    max_vram: float,
) -> None:
    plan = plan_fit(components, device, figure, WORK)
    assert (
        plan.placement["diffusion"],
        plan.placement["text_encoders"],
        plan.placement["vae"],
    ) == placement
    assert plan.keep_clip_on_cpu is bool(clip)
    assert plan.keep_vae_on_cpu is bool(vae)
    assert plan.offload_params_to_cpu is bool(offload)
    assert plan.max_vram == max_vram
    assert plan.device == device.name


def test_summary_and_dict() -> None:
    plan = plan_fit(SDXL, GPU, 12 * GiB, WORK)
    assert plan.summary() == "Vulkan0: diffusion gpu, text_encoders gpu, vae gpu (budget 10.0 GiB)"
    data = json.loads(json.dumps(plan.as_dict()))
    assert data["placement"] == {"diffusion": "gpu", "text_encoders": "gpu", "vae": "gpu"}
    assert data["max_vram"] == 0.0
    assert data["budget"] == 10 * GiB
    assert data["summary"] == plan.summary()


def test_summary_mixed_and_offload() -> None:
    assert (
        plan_fit(SDXL, GPU, 10 * GiB, WORK).summary()
        == "Vulkan0: diffusion gpu, text_encoders cpu, vae gpu (budget 8.0 GiB)"
    )
    assert plan_fit(SDXL, GPU, int(7.55 * GiB), WORK).summary() == (
        "Vulkan0: diffusion gpu+offload, text_encoders cpu, vae cpu "
        "(budget 5.5 GiB, max_vram 5.5 GiB)"
    )
    assert plan_fit(SDXL, CPU, None, WORK).summary() == (
        "CPU: diffusion cpu, text_encoders cpu, vae cpu"
    )


def test_negative_budget_reads_negative() -> None:
    plan = plan_fit(SDXL, GPU, 1 * GiB, WORK)
    assert plan.budget == -1 * GiB
    assert "(budget -1.0 GiB, max_vram 0.1 GiB)" in plan.summary()


def test_unknown_part_is_an_error() -> None:
    with pytest.raises(ValueError, match="unet"):
        plan_fit({"unet": GiB}, GPU, 12 * GiB, WORK)


def test_plan_is_frozen() -> None:
    plan = plan_fit(SDXL, GPU, 12 * GiB, WORK)
    assert isinstance(plan, FitPlan)
    with pytest.raises(AttributeError):
        plan.max_vram = 1.0  # type: ignore[misc]
