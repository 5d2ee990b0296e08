"""The split group norm we patch into ggml (native/patches/group_norm_split.cuh) normalises every
element of every group once, with its own channel's weight and bias: its per-thread functions,
compiled for the host with g++ and run one block after another (several threads each), against
ggml's group norm followed by ggml's mul and add (and silu, which the patch takes in too),
transcribed as loops in double. Shapes cover
chunks that do not divide a group, a group smaller than one chunk, several images (four, as
batched sampling has them), and the fusion's channel lookup across a group's planes. (On the
GPU bench/build_options.py compares the pixels.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sdfarm.native import sourcepatch

from helpers.ggmlgraph import cuda_patched_source, pinned_source, run_graph_harness

HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <vector>
#include "group_norm_split.cuh"

int main() {
    long W, H, C, N, G;
    int affine, nt, cases = 0;
    while (scanf("%ld %ld %ld %ld %ld %d %d", &W, &H, &C, &N, &G, &affine, &nt) == 7) {
        const long plane = W * H, cpg = C / G, gs = plane * cpg, ne = plane * C * N;
        std::vector<float> x(ne), w(C), b(C), got(ne, NAN);
        for (long i = 0; i < ne; i++) x[i] = (float) std::sin(0.37 * i) * 3.0f + 0.5f * (i % 7);
        for (long c = 0; c < C; c++) { w[c] = 0.5f + 0.01f * c; b[c] = -0.25f + 0.02f * c; }
        const long groups = G * N;
        const int chunks = sdfarm_gn_chunks(gs, groups);
        std::vector<sdfarm_gn_part> part(groups * chunks);
        for (long g = 0; g < groups; g++)
        for (int c = 0; c < chunks; c++) {
            long a, e;
            sdfarm_gn_range(g, c, gs, ne, chunks, &a, &e);
            sdfarm_gn_part t = {0.0, 0.0};
            for (int tid = 0; tid < nt; tid++) {
                const sdfarm_gn_part p = sdfarm_gn_thread_sums(x.data(), a, e, tid, nt);
                t.s += p.s; t.ss += p.ss;
            }
            part[g * chunks + c] = t;
        }
        for (long g = 0; g < groups; g++) {
            float mean, scale;
            sdfarm_gn_stats(part.data(), g, chunks, gs, 1e-6f, &mean, &scale);
            for (int c = 0; c < chunks; c++) {
                long a, e;
                sdfarm_gn_range(g, c, gs, ne, chunks, &a, &e);
                for (int tid = 0; tid < nt; tid++)
                    sdfarm_gn_thread_apply(x.data(), got.data(), affine ? w.data() : nullptr,
                                           affine ? b.data() : nullptr, a, e, g, gs, plane, cpg,
                                           G, mean, scale, affine == 2, tid, nt);
            }
        }
        double worst = 0.0;
        for (long g = 0; g < groups; g++) {
            double s = 0.0, v = 0.0;
            for (long j = g * gs; j < (g + 1) * gs; j++) s += x[j];
            const double m = s / gs;
            for (long j = g * gs; j < (g + 1) * gs; j++) v += (x[j] - m) * (x[j] - m);
            const double inv = 1.0 / std::sqrt(v / gs + 1e-6);
            for (long j = g * gs; j < (g + 1) * gs; j++) {
                const long ch = (j / plane) % C;
                double want = (x[j] - m) * inv;
                if (affine) want = want * w[ch] + b[ch];
                if (affine == 2) want = want / (1.0 + std::exp(-want));
                const double err = std::fabs(got[j] - want);  // NAN (never written) fails too
                if (!(err <= 2e-5 * (1.0 + std::fabs(want)))) {
                    printf("MISMATCH case %d at %ld (channel %ld): want %.8g got %.8g\n",
                           cases, j, ch, want, got[j]);
                    return 1;
                }
                worst = err > worst ? err : worst;
            }
        }
        printf("case %d: %ld values, %d chunks per group, worst error %.3g\n", cases, ne, chunks,
               worst);
        cases++;
    }
    printf("ok %d\n", cases);
    return 0;
}
"""

# W H C N groups affine (0 none, 1 weight and bias, 2 those then silu) threads
CASES = [
    (128, 128, 64, 1, 32, 1, 256),  # a VAE block's shape, small: two chunks per group
    (300, 111, 64, 1, 32, 0, 128),  # 66,600-element groups: chunks do not divide them
    (8, 8, 32, 1, 32, 1, 64),  # groups of one 64-element plane: one chunk of 64
    (45, 33, 96, 2, 32, 2, 96),  # two images, three channels per group, silu
    (17, 19, 320, 1, 32, 1, 256),  # the UNet's 320 channels, an odd plane
    (64, 64, 128, 1, 32, 2, 256),  # a resnet's norm then silu
    (32, 32, 320, 4, 32, 2, 256),  # batched sampling: four images' latents through a resnet
]


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed (the runtime's build needs one too)"
    tmp = tmp_path_factory.mktemp("gn")
    src = tmp / "harness.cpp"
    src.write_text(HARNESS)
    exe = tmp / "harness"
    subprocess.run(
        [cxx, "-std=c++17", "-O2", f"-I{sourcepatch.HERE}", str(src), "-o", str(exe)], check=True
    )
    return exe


def test_split_group_norm_matches_ggml_with_its_affine(harness: Path) -> None:
    stdin = "\n".join(" ".join(map(str, c)) for c in CASES) + "\n"
    done = subprocess.run([str(harness)], input=stdin, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith(f"ok {len(CASES)}"), done.stdout
    chunks = [
        int(line.split(" chunks per group")[0].rsplit(" ", 1)[1])
        for line in done.stdout.splitlines()
        if "chunks per group" in line
    ]
    assert chunks[0] > 1 and chunks[1] > 1 and chunks[2] == 1, done.stdout  # split and not


def test_the_patch_applies_to_the_pinned_source(tmp_path: Path) -> None:
    src, out = pinned_source(), cuda_patched_source(tmp_path)
    norm = (out / sourcepatch.NORM).read_text()
    assert '#include "group_norm_split.cuh"' in norm
    assert norm.count("sdfarm_group_norm_launch(ctx, dst, dst, nullptr, nullptr)") == 1
    assert "int sdfarm_group_norm_fuse(" in (out / sourcepatch.NORM_H).read_text()
    graph = (out / sourcepatch.GRAPH).read_text()
    assert graph.count("sdfarm_group_norm_fuse(*cuda_ctx, cgraph, i);") == 1
    assert graph.index("sdfarm_group_norm_fuse") < graph.index("ggml_cuda_topk_moe_args args;")
    assert (src / sourcepatch.GRAPH).read_text().count("sdfarm") == 0


GRAPH_HARNESS = r"""
#include <cstdio>
#include "ggml.h"
#include "ggml-impl.h"
#define SDFARM_GN_HOST_GRAPH 1
#include "group_norm_split.cuh"

#ifndef IMAGES
#define IMAGES 1  // the batch (ggml's dim 3)
#endif

// ggml_ext_group_norm of stable-diffusion.cpp (src/ggml_extend.hpp at master-596).
static ggml_tensor * sd_group_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * w,
                                   ggml_tensor * b) {
    w = ggml_reshape_4d(ctx, w, 1, 1, w->ne[0], 1);
    b = ggml_reshape_4d(ctx, b, 1, 1, b->ne[0], 1);
    x = ggml_group_norm(ctx, x, 32, 1e-6f);
    x = ggml_mul_inplace(ctx, x, w);
    return ggml_add_inplace(ctx, x, b);
}

int main() {
    ggml_init_params params = {64 * 1024 * 1024, nullptr, true};
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * x = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 16, 16, 64, IMAGES);
    ggml_tensor * w1 = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 64);
    ggml_tensor * b1 = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 64);
    ggml_tensor * w2 = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 64);
    ggml_tensor * b2 = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 64);
    // a resnet's first norm, then silu
    ggml_tensor * h = ggml_silu_inplace(ctx, sd_group_norm(ctx, x, w1, b1));
    // a bare group norm whose result is also used elsewhere: not fusable
    ggml_tensor * g = ggml_group_norm(ctx, h, 32, 1e-6f);
    ggml_tensor * m = ggml_mul(ctx, g, ggml_reshape_4d(ctx, w2, 1, 1, 64, 1));
    ggml_tensor * out = ggml_add(ctx, ggml_add(ctx, m, ggml_reshape_4d(ctx, b2, 1, 1, 64, 1)), g);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        ggml_tensor * n = ggml_graph_node(gf, i);
        if (n->op != GGML_OP_GROUP_NORM) continue;
        int idx[4] = {-1, -1, -1, -1};
        int fuse = sdfarm_gn_fusion_nodes(gf, i, idx);
        const int without_silu = sdfarm_gn_fusion_nodes(gf, i, idx, false);
        printf("group_norm at %d: fuse %d (%d without silu)", i, fuse, without_silu);
        if (fuse) {
            fuse = sdfarm_gn_fusion_nodes(gf, i, idx);
            printf(" mul at %d (%s) add at %d (%s) between: %s", idx[1],
                   ggml_op_name(ggml_graph_node(gf, idx[1])->op), idx[2],
                   ggml_op_name(ggml_graph_node(gf, idx[2])->op),
                   ggml_op_name(ggml_graph_node(gf, i + 1)->op));
            if (fuse == 4) {
                const ggml_tensor * act = ggml_graph_node(gf, idx[3]);
                printf(" then %s", ggml_unary_op_name(ggml_get_unary_op(act)));
            }
        }
        printf("\n");
    }
    ggml_free(ctx);
    return 0;
}
"""


@pytest.mark.parametrize("images", [1, 4])
def test_the_fusion_finds_stable_diffusion_cpps_group_norm_in_a_real_ggml_graph(
    tmp_path: Path, images: int
) -> None:
    """The graph walk, on a graph the pinned ggml builds (the CPU runtime's library): the
    group norm as stable-diffusion.cpp writes it is fused with its mul and add, which sit
    behind the weight's reshape, and a group norm with another use is not; the same for a
    batch of four images (batched sampling; the weight and bias broadcast over it)."""
    lines = run_graph_harness(tmp_path, f"#define IMAGES {images}\n" + GRAPH_HARNESS)
    assert len(lines) == 2, lines
    assert "fuse 4 (3 without silu)" in lines[0], lines[0]
    assert "(MUL)" in lines[0] and "(ADD)" in lines[0], lines[0]
    assert "between: RESHAPE then SILU" in lines[0], lines[0]  # the walk steps over views
    assert "fuse 0 (0 without silu)" in lines[1], lines[1]
