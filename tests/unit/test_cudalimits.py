"""The sizes the runtime's CUDA build aborts on (native/cudalimits.py): a table of
architecture x device x size against what the H200 run measured (1792 passes, 2048 aborts
with the SD 2.x UNet), and the engine's use of the model's architecture."""

from __future__ import annotations

import pytest

from sdfarm.native.cudalimits import GRID_ROWS, attention_rows, cuda_size_error

CASES = [
    # (architecture, device, width, height, refused)
    ("sd2", "CUDA0", 1792, 1792, False),  # measured: draws
    ("sd2", "CUDA0", 2048, 2048, True),  # measured: aborts (65,536 rows)
    ("sd2", "CUDA0", 2040, 2040, False),  # 255 x 255 = 65,025 rows
    ("sd2", "CUDA0", 2048, 2040, False),  # 256 x 255 = 65,280 rows
    ("sd1", "CUDA1", 4096, 4096, True),
    ("sdxl", "CUDA0", 2304, 2048, True),
    ("sdxl", "CUDA0", 1792, 2304, False),  # 224 x 288 = 64,512 rows
    ("sd2", "CPU", 4096, 4096, False),  # the CPU build has no grid limit
    ("sd2", "Vulkan0", 4096, 4096, False),
    ("dit", "CUDA0", 4096, 4096, False),  # not measured for DiTs: not refused
    ("flux", "CUDA0", 2048, 2048, False),
]


@pytest.mark.parametrize(("arch", "device", "width", "height", "refused"), CASES)
def test_the_cuda_limit_table(arch: str, device: str, width: int, height: int, refused: bool):
    why = cuda_size_error(arch, device, width, height)
    assert (why is not None) == refused, why
    if refused:
        assert f"{width}x{height}" in why and "65,535" in why and "CPU or Vulkan" in why


def test_rows_round_up_as_the_runtime_aligns_sizes() -> None:
    assert attention_rows(2048, 2048) == GRID_ROWS + 1
    assert attention_rows(2041, 2040) == 256 * 255
