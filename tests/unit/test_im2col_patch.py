"""The tiled CUDA im2col we patch into ggml (native/patches/im2col_tiled.cuh) puts every value
where ggml's own kernel puts it: its block function, compiled for the host with g++ and run one
thread per block, against ggml's indexing transcribed as loops, over convolution shapes with
padding, strides, dilation, several images, channels and widths past one tile, and a
non-contiguous channel stride. (On the GPU the pixels are compared by bench/build_options.py.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sdfarm.native import sourcepatch

from helpers.ggmlgraph import cuda_patched_source, pinned_source

HARNESS = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
#include "im2col_tiled.cuh"

// ggml's im2col_kernel (ggml/src/ggml-cuda/im2col.cu at master-596), one thread at a time.
static void reference(const float * x, float * dst, int IW, int IH, int OW, int OH, int KW,
                      int KH, int IC, int N, long IC_IH_IW, long IH_IW,
                      int s0, int s1, int p0, int p1, int d0, int d1) {
    const long KH_KW = (long) KH * KW, IC_KH_KW = IC * KH_KW;
    for (long iz = 0; iz < (long) N * OH; iz++)
    for (long iow = 0; iow < OW; iow++)
    for (long i = 0; i < IC_KH_KW; i++) {
        const long iic = i / KH_KW, rem = i - iic * KH_KW, ikh = rem / KW, ikw = rem - ikh * KW;
        const long in = iz / OH, ioh = iz - in * OH;
        const long iiw = iow * s0 + ikw * d0 - p0, iih = ioh * s1 + ikh * d1 - p1;
        const long off = ((in * OH + ioh) * OW + iow) * IC_KH_KW + iic * KH_KW + ikh * KW + ikw;
        dst[off] = (iih < 0 || iih >= IH || iiw < 0 || iiw >= IW)
            ? 0.0f : x[iic * IC_IH_IW + in * IH_IW + iih * IW + iiw];
    }
}

int main() {
    int IC, IH, IW, KH, KW, s0, s1, p0, p1, d0, d1, N, pad;
    int cases = 0;
    while (scanf("%d %d %d %d %d %d %d %d %d %d %d %d %d", &IC, &IH, &IW, &KH, &KW, &s0, &s1,
                 &p0, &p1, &d0, &d1, &N, &pad) == 13) {
        const int OW = (IW + 2 * p0 - d0 * (KW - 1) - 1) / s0 + 1;
        const int OH = (IH + 2 * p1 - d1 * (KH - 1) - 1) / s1 + 1;
        const long IC_IH_IW = (long) IH * IW + pad, IH_IW = IC * IC_IH_IW;
        std::vector<float> x((size_t) N * IH_IW);
        for (size_t i = 0; i < x.size(); i++) x[i] = 1.0f + (float) i;
        const size_t n = (size_t) N * OH * OW * IC * KH * KW;
        std::vector<float> want(n, -1.0f), got(n, -2.0f);
        reference(x.data(), want.data(), IW, IH, OW, OH, KW, KH, IC, N, IC_IH_IW, IH_IW,
                  s0, s1, p0, p1, d0, d1);
        const int SW = sdfarm_im2col_tile_width(s0, d0, KW);
        std::vector<float> tile(sdfarm_im2col_tile_bytes(s0, d0, KW, KH) / sizeof(float));
        const long seg = (long) (IC < SDFARM_IM2COL_CT ? IC : SDFARM_IM2COL_CT) * KH * KW;
        for (int V = 1; V <= 4; V *= 2) {
            if ((long) IC * KH * KW % V != 0) continue;  // the launch would not take this V
            const int nt = sdfarm_im2col_threads(seg, V);
            std::fill(got.begin(), got.end(), -2.0f);
            for (long iz = 0; iz < (long) N * OH; iz++)
            for (int by = 0; by < (IC + SDFARM_IM2COL_CT - 1) / SDFARM_IM2COL_CT; by++)
            for (int bx = 0; bx < (OW + SDFARM_IM2COL_TW - 1) / SDFARM_IM2COL_TW; bx++) {
                // the block's load (one thread does all of it), then each of its nt threads
                sdfarm_im2col_tile<float>(x.data(), got.data(), tile.data(), bx, by, iz, 0, 1,
                                          IW, IH, OW, OH, KW, KH, IC, IC_IH_IW, IH_IW, SW,
                                          s0, s1, p0, p1, d0, d1, 1);
                for (int tid = 0; tid < nt; tid++) {
                    if (V == 4)
                        sdfarm_im2col_tile<float, 4>(x.data(), got.data(), tile.data(), bx, by,
                            iz, tid, nt, IW, IH, OW, OH, KW, KH, IC, IC_IH_IW, IH_IW, SW,
                            s0, s1, p0, p1, d0, d1, 2);
                    else if (V == 2)
                        sdfarm_im2col_tile<float, 2>(x.data(), got.data(), tile.data(), bx, by,
                            iz, tid, nt, IW, IH, OW, OH, KW, KH, IC, IC_IH_IW, IH_IW, SW,
                            s0, s1, p0, p1, d0, d1, 2);
                    else
                        sdfarm_im2col_tile<float, 1>(x.data(), got.data(), tile.data(), bx, by,
                            iz, tid, nt, IW, IH, OW, OH, KW, KH, IC, IC_IH_IW, IH_IW, SW,
                            s0, s1, p0, p1, d0, d1, 2);
                }
            }
            for (size_t i = 0; i < n; i++) {
                if (want[i] != got[i]) {
                    printf("MISMATCH case %d V %d at %zu: want %g got %g\n", cases, V, i,
                           want[i], got[i]);
                    return 1;
                }
            }
            printf("case %d V %d threads %d: %zu values equal\n", cases, V, nt, n);
        }
        cases++;
    }
    printf("ok %d\n", cases);
    return 0;
}
"""

# IC IH IW KH KW s0 s1 p0 p1 d0 d1 N pad(channel stride - IH*IW)
CASES = [
    (4, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1, 1, 0),  # the UNet's first conv, small
    (128, 6, 70, 3, 3, 1, 1, 1, 1, 1, 1, 1, 0),  # channels past 3 tiles, width past 2
    (33, 5, 40, 3, 3, 1, 1, 1, 1, 1, 1, 2, 0),  # a partial channel tile, two images
    (5, 9, 37, 3, 3, 2, 2, 1, 1, 1, 1, 1, 0),  # stride 2 (a downsample)
    (7, 10, 45, 3, 5, 1, 2, 2, 1, 2, 1, 1, 0),  # dilation, unequal kernel and strides
    (6, 7, 33, 1, 1, 1, 1, 0, 0, 1, 1, 3, 0),  # 1x1
    (3, 1, 50, 1, 4, 3, 1, 0, 0, 1, 1, 2, 0),  # the 1-D case (IH = KH = 1)
    (9, 6, 21, 3, 3, 1, 1, 1, 1, 1, 1, 2, 13),  # a non-contiguous channel stride
]


def test_tiled_im2col_matches_ggml_layout(tmp_path: Path) -> None:
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed (the runtime's build needs one too)"
    src = tmp_path / "harness.cpp"
    src.write_text(HARNESS)
    exe = tmp_path / "harness"
    subprocess.run(
        [cxx, "-std=c++17", "-O1", f"-I{sourcepatch.HERE}", str(src), "-o", str(exe)],
        check=True,
    )
    stdin = "\n".join(" ".join(map(str, c)) for c in CASES) + "\n"
    done = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith(f"ok {len(CASES)}"), done.stdout


def test_patch_applies_to_the_pinned_source_without_touching_it(tmp_path: Path) -> None:
    src = pinned_source()
    original = (src / sourcepatch.IM2COL).read_text()
    out = cuda_patched_source(tmp_path)
    text = (out / sourcepatch.IM2COL).read_text()
    assert '#include "im2col_tiled.cuh"' in text
    assert text.count("sdfarm_im2col_tiled<T>(") == 1
    assert (out / "ggml/src/ggml-cuda/im2col_tiled.cuh").read_bytes() == (
        sourcepatch.HERE / "im2col_tiled.cuh"
    ).read_bytes()
    assert (src / sourcepatch.IM2COL).read_text() == original  # the shared tree is unchanged
    assert (out / "CMakeLists.txt").exists()


def test_a_source_the_patch_does_not_fit_is_refused_by_name(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "ggml/src/ggml-cuda").mkdir(parents=True)
    (src / sourcepatch.IM2COL).write_text('#include "im2col.cuh"\n// another version\n')
    with pytest.raises(sourcepatch.PatchError, match="ggml-cuda-im2col-tiled.*im2col.cu.*0 times"):
        sourcepatch.apply(src, tmp_path / "out", sourcepatch.for_backend("cuda"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("backend", ["cpu", "vulkan", "metal"])
def test_other_builds_get_only_the_batch_sampling_patch(backend: str) -> None:
    assert [p.name for p in sourcepatch.for_backend(backend)] == ["sd-batch-sampling"]
    assert sourcepatch.patch_id([]) == ""
    assert sourcepatch.patch_id(sourcepatch.for_backend("cuda")) != sourcepatch.patch_id(
        sourcepatch.for_backend(backend)
    )
