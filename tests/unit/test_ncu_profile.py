"""bench/ncu_profile.py, the pure parts: ncu's CSV log read into (kernel, ms) in launch order,
kernel names grouped without templates and parameters, the phases cut at flash attention."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import ncu_profile  # noqa: E402

HEADER = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
    '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
    '"Metric Value"'
)


def row(i: int, name: str, ns: str) -> str:
    return (
        f'"{i}","7","sd-cli","127.0.0.1","{name}","1","7","(256, 1, 1)","(5, 64, 64)","0",'
        f'"9.0","Command line profiler metrics","gpu__time_duration.sum","ns","{ns}"'
    )


LOG = "\n".join(
    [
        "==PROF== Connected to process 7 (sd-cli)",
        HEADER,
        row(0, "void im2col_kernel<__half>(const float *, __half *, long)", "11,000"),
        row(1, "void flash_attn_ext_f16<64, 64, 8>(const char *)", "2000"),
        row(2, "void im2col_kernel<__half>(const float *, __half *, long)", "3000"),
        row(3, "void flash_attn_ext_f16<64, 64, 8>(const char *)", "2000"),
        row(4, "void group_norm_f32<(int)1024>(const float *, float *)", "5000"),
        row(5, "void im2col_kernel<__half>(const float *, __half *, long)", "40000"),
        "==PROF== Disconnected from process 7",
    ]
)


def test_reads_every_kernel_in_launch_order_in_ms() -> None:
    kernels = ncu_profile.read_kernels(LOG)
    assert [round(ms, 3) for _, ms in kernels] == [0.011, 0.002, 0.003, 0.002, 0.005, 0.04]
    assert ncu_profile.short(kernels[4][0]) == "group_norm_f32"


def test_phases_cut_at_the_first_and_last_flash_attention() -> None:
    parts = ncu_profile.phases(ncu_profile.read_kernels(LOG))
    before, unet, after = parts.values()
    assert len(before) == 1 and len(unet) == 3 and len(after) == 2
    decode = ncu_profile.summary(after, top=5)
    assert decode["ms"] == 0.045
    assert decode["top"][0] == {"kernel": "im2col_kernel", "ms": 0.04, "launches": 1}


def test_without_flash_attention_everything_is_one_phase() -> None:
    kernels = [("void a<int>(int)", 1.0), ("b", 2.0)]
    assert ncu_profile.phases(kernels) == {"all": kernels}
    assert ncu_profile.summary(kernels, top=1)["top"] == [{"kernel": "b", "ms": 2.0, "launches": 1}]
