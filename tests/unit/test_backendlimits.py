"""The sizes the runtime's GPU builds abort on (native/backendlimits.py): a table of
architecture x device x size against what the H200 runs measured on CUDA (1792 and 1920 pass,
2048 and 1984 abort with the SD 2.x UNet), the Vulkan build's element limit on an attention
without flash attention (the VAE decoded 1024 whole and aborted at 2048), and the engine's use
of them."""

from __future__ import annotations

import pytest

from sdfarm.native.backendlimits import (
    CONCAT_MAX_VALUES,
    GRID_ROWS,
    VULKAN_MAX_ELEMENTS,
    attention_rows,
    cuda_size_error,
    self_attention_mask_values,
    vulkan_attention_error,
)

CASES = [
    # (architecture, device, width, height, refused: "" or the limit that refuses it)
    ("sd2", "CUDA0", 1792, 1792, ""),  # measured: draws
    ("sd2", "CUDA0", 1920, 1920, ""),  # measured: draws (57,600 = 225 x 256 rows: no mask)
    ("sd2", "CUDA0", 2048, 2048, "rows"),  # measured: aborts (65,536 rows)
    ("sd2", "CUDA0", 1984, 1984, "mask"),  # measured: aborts (61,504 rows, a 3.8e9-value mask)
    ("sd2", "CUDA0", 1728, 1728, "mask"),  # 46,656 rows: a 2.19e9-value mask
    ("sd2", "CUDA0", 1600, 1600, ""),  # 40,000 rows: a 1.61e9-value mask
    ("sd2", "CUDA0", 2040, 2040, "mask"),  # 255 x 255 = 65,025 rows, padded
    ("sd2", "CUDA0", 2048, 2040, ""),  # 256 x 255 = 65,280 rows, a multiple of 256
    ("sd1", "CUDA1", 4096, 4096, "rows"),
    ("sdxl", "CUDA0", 2304, 2048, "rows"),
    ("sdxl", "CUDA0", 1792, 2304, ""),  # 224 x 288 = 64,512 rows
    ("sd2", "CPU", 4096, 4096, ""),  # the CPU build has no grid limit
    ("sd2", "Vulkan0", 4096, 4096, ""),
    ("sd2", "Vulkan0", 1984, 1984, ""),
    ("dit", "CUDA0", 4096, 4096, ""),  # not measured for DiTs: not refused
    ("flux", "CUDA0", 2048, 2048, ""),
]


@pytest.mark.parametrize(("arch", "device", "width", "height", "refused"), CASES)
def test_the_cuda_limit_table(arch: str, device: str, width: int, height: int, refused: str):
    why = cuda_size_error(arch, device, width, height)
    assert (why is not None) == bool(refused), why
    if refused:
        assert f"{width}x{height}" in why and "CPU or Vulkan" in why
        limit = "65,535" if refused == "rows" else f"{CONCAT_MAX_VALUES:,}"
        assert limit in why


def test_the_self_attention_mask_is_built_only_for_rows_off_the_key_stride() -> None:
    assert self_attention_mask_values(1920, 1920) == 0
    assert self_attention_mask_values(1984, 1984) == 61_504 * 61_696
    assert self_attention_mask_values(1600, 1600) == 40_000 * 40_192 <= CONCAT_MAX_VALUES


def test_rows_round_up_as_the_runtime_aligns_sizes() -> None:
    assert attention_rows(2048, 2048) == GRID_ROWS + 1
    assert attention_rows(2041, 2040) == 256 * 255


VULKAN_CASES = [
    # (device, width, height, heads, refused)
    ("Vulkan0", 1024, 1024, 1, False),  # measured: the VAE decodes it whole (2^28 elements)
    ("Vulkan0", 2048, 2048, 1, True),  # measured: aborts (65,536^2 = 2^32 elements)
    ("Vulkan0", 2040, 2048, 1, False),  # 255 x 256 cells: 65,280^2 < 2^32
    ("Vulkan1", 4096, 4096, 1, True),
    ("Vulkan0", 1024, 1024, 8, False),  # a ControlNet's 8 heads: 2^31 elements
    ("Vulkan0", 1280, 1280, 8, True),  # 8 x 25,600^2 = 5.2e9
    ("Vulkan0", 4096, 4096, 0, False),  # no attention without flash attention (TAESD)
    ("CUDA0", 4096, 4096, 1, False),  # CUDA's own limits are cuda_size_error's
    ("CPU", 4096, 4096, 1, False),
]


@pytest.mark.parametrize(("device", "width", "height", "heads", "refused"), VULKAN_CASES)
def test_the_vulkan_attention_limit(
    device: str, width: int, height: int, heads: int, refused: bool
) -> None:
    why = vulkan_attention_error(device, width, height, heads, "VAE")
    assert (why is not None) == refused, why
    if refused:
        assert f"{width}x{height}" in why and f"{VULKAN_MAX_ELEMENTS:,}" in why and "VAE" in why
