"""Attention through cuDNN on CUDA (native/patches/fattn_cudnn.cuh; inert unless the operator
names a cuDNN): the patch applying to the pinned source, which attention nodes it takes (asked
of nodes the pinned ggml builds, the way stable-diffusion.cpp builds them), and where the
build finds the headers it compiles against. cuDNN's SDPA itself needs a GPU
(bench/gpu_run.sh sdpa; docs/gpu.md)."""

from __future__ import annotations

from pathlib import Path

from sdfarm.native import cudnn, sourcepatch

from helpers.ggmlgraph import cuda_patched_source, pinned_source, run_graph_harness


def test_the_patch_applies_to_the_pinned_source(tmp_path: Path) -> None:
    src, out = pinned_source(), cuda_patched_source(tmp_path)
    fattn = (out / sourcepatch.FATTN).read_text()
    assert '#include "fattn_cudnn.cuh"' in fattn
    body = fattn.split(
        "void ggml_cuda_flash_attn_ext(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {"
    )[1]
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    assert lines[:2] == ["ggml_cuda_set_device(ctx.device);", "if (sdfarm_cudnn_fattn(ctx, dst)) {"]
    assert (out / "ggml/src/ggml-cuda/fattn_cudnn.cuh").is_file()
    assert "sdfarm" not in (src / sourcepatch.FATTN).read_text()
    assert "ggml-cuda-fattn-cudnn" not in {p.name for p in sourcepatch.for_backend("cpu")}


HARNESS = r"""
#include <cmath>
#include <cstdio>
#include "ggml.h"
#include "ggml-impl.h"
#define SDFARM_HOST_GRAPH 1
#include "fattn_cudnn.cuh"

// The attention of stable-diffusion.cpp's ggml_ext_attention_ext with flash attention: Q
// made contiguous [d, L_q, heads], K and V cast to f16; the cross-attention's keys padded to
// 256 under a mask. kv_heads != heads, f32 K, a soft cap or a permuted Q: cases it refuses.
static void ask(ggml_context * ctx, const char * name, int d, int lq, int lk, int heads,
                int kv_heads, bool mask, bool f16_kv, float softcap, bool permuted_q) {
    ggml_tensor * q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, lq, heads);
    if (permuted_q) {
        q = ggml_permute(ctx, ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, heads, lq), 0, 2, 1, 3);
    }
    ggml_tensor * k = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, lk, kv_heads);
    ggml_tensor * v = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, lk, kv_heads);
    if (f16_kv) {
        k = ggml_cast(ctx, k, GGML_TYPE_F16);
        v = ggml_cast(ctx, v, GGML_TYPE_F16);
    }
    ggml_tensor * m = mask ? ggml_cast(ctx, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, lk, lq),
                                       GGML_TYPE_F16) : nullptr;
    const float scale = 1.0f / sqrtf((float) d);
    ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, m, scale, 0.0f, softcap);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    const sdfarm_sdpa_shape s = sdfarm_sdpa_shape_of(out);
    printf("%s %d d=%lld q=%lld kv=%lld heads=%lld scale=%.6f\n", name,
           (int) sdfarm_sdpa_eligible(s), (long long) s.d, (long long) s.q_len,
           (long long) s.kv_len, (long long) s.heads, s.scale);
}

// A batch of `images` (batched sampling): stable-diffusion.cpp folds the images into the heads
// (Q, K and V of [d, L, heads * images]); `q4d` keeps them apart ([d, L, heads, images]). The
// dims and strides cuDNN is given: B, H, and each tensor's batch, head and row strides.
static void ask_batch(ggml_context * ctx, const char * name, int d, int l, int heads, int images,
                      bool q4d) {
    ggml_tensor * t[3];
    for (int o = 0; o < 3; o++) {
        t[o] = q4d ? ggml_new_tensor_4d(ctx, GGML_TYPE_F32, d, l, heads, images)
                   : ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, l, heads * images);
        if (o > 0) t[o] = ggml_cast(ctx, t[o], GGML_TYPE_F16);
    }
    ggml_tensor * out = ggml_flash_attn_ext(ctx, t[0], t[1], t[2], nullptr,
                                            1.0f / sqrtf((float) d), 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    const sdfarm_sdpa_dims s = sdfarm_sdpa_dims_of(out);
    printf("%s %d B=%lld H=%lld q=%lld,%lld,%lld k=%lld,%lld,%lld o=%lld,%lld,%lld\n", name,
           (int) sdfarm_sdpa_eligible(sdfarm_sdpa_shape_of(out)), (long long) s.B,
           (long long) s.H, (long long) s.q[0], (long long) s.q[1], (long long) s.q[2],
           (long long) s.k[0], (long long) s.k[1], (long long) s.k[2], (long long) s.o[0],
           (long long) s.o[1], (long long) s.o[2]);
}

int main() {
    ggml_init_params params = {256 * 1024 * 1024, nullptr, true};
    ggml_context * ctx = ggml_init(params);
    ask(ctx, "self-1024", 64, 16384, 16384, 5, 5, false, true, 0.0f, false);
    ask(ctx, "self-512", 64, 4096, 4096, 5, 5, false, true, 0.0f, false);
    ask(ctx, "cross-masked", 64, 16384, 256, 5, 5, true, true, 0.0f, false);
    ask(ctx, "head-80", 80, 1024, 1024, 8, 8, false, true, 0.0f, false);
    ask(ctx, "head-256", 256, 1024, 1024, 2, 2, false, true, 0.0f, false);
    ask(ctx, "f32-kv", 64, 1024, 1024, 5, 5, false, false, 0.0f, false);
    ask(ctx, "gqa", 64, 1024, 1024, 8, 2, false, true, 0.0f, false);
    ask(ctx, "softcap", 64, 1024, 1024, 5, 5, false, true, 30.0f, false);
    ask(ctx, "permuted-q", 64, 1024, 1024, 5, 5, false, true, 0.0f, true);
    ask_batch(ctx, "self-512-x4", 64, 4096, 5, 4, false);
    ask_batch(ctx, "self-512-x4-4d", 64, 4096, 5, 4, true);
    ggml_free(ctx);
    return 0;
}
"""


def test_cudnn_takes_the_unets_self_attention_and_refuses_what_it_cannot_run(tmp_path) -> None:
    """The UNet's self-attention (the 16,384-token one at 1024 that ggml's kernel runs at a
    third of PyTorch's speed) goes to cuDNN; the masked cross-attention, head sizes over 128,
    f32 K/V, grouped heads, a soft cap and a non-contiguous Q stay with ggml's kernel."""
    lines = run_graph_harness(tmp_path, HARNESS)
    got = {line.split()[0]: line.split()[1] for line in lines}
    assert got == {
        "self-1024": "1", "self-512": "1", "cross-masked": "0", "head-80": "1",
        "head-256": "0", "f32-kv": "0", "gqa": "0", "softcap": "0", "permuted-q": "0",
        "self-512-x4": "1", "self-512-x4-4d": "1",
    }, lines  # fmt: skip
    first = lines[0].split()
    assert first[2:6] == ["d=64", "q=16384", "kv=16384", "heads=5"], lines[0]
    assert first[6] == "scale=0.125000", lines[0]  # 1/sqrt(64): the plan is keyed by it


def test_a_batch_of_four_is_one_attention_of_its_images_heads(tmp_path) -> None:
    """Batched sampling's self-attention, as stable-diffusion.cpp builds it (the four images
    folded into the heads: Q, K and V of [64, L, 5 x 4]) goes to cuDNN as 20 heads of one batch;
    its output is ggml's [64, 20, L] (a row holds every image's heads). A Q of [64, L, 5, 4]
    would be B = 4."""
    lines = [line for line in run_graph_harness(tmp_path, HARNESS) if "-x4" in line]
    assert lines == [
        "self-512-x4 1 B=1 H=20 q=5242880,262144,64 k=5242880,262144,64 o=5242880,64,1280",
        "self-512-x4-4d 1 B=4 H=5 q=1310720,262144,64 k=1310720,262144,64 o=1310720,64,320",
    ], lines


def test_the_build_finds_the_three_headers_or_compiles_none_of_it(tmp_path: Path) -> None:
    """cuDNN's, its frontend's and NVRTC's headers, one folder each (the toolkit's first for
    NVRTC's); one missing means attention stays with ggml, not a failed build."""
    site = tmp_path / "site"
    toolkit = tmp_path / "cuda" / "include"
    files = {
        site / "include" / "cudnn_frontend.h",
        site / "nvidia" / "cudnn" / "include" / "cudnn.h",
        site / "nvidia" / "cu13" / "include" / "nvrtc.h",
    }
    found = cudnn.sdpa_include_dirs([str(site)], None, is_file=lambda p: p in files)
    assert found == [site / "include", site / "nvidia/cudnn/include", site / "nvidia/cu13/include"]
    with_toolkit = files | {toolkit / "nvrtc.h"}
    found = cudnn.sdpa_include_dirs([str(site)], toolkit, is_file=lambda p: p in with_toolkit)
    assert found == [site / "include", site / "nvidia/cudnn/include", toolkit]
    no_frontend = files - {site / "include" / "cudnn_frontend.h"}
    assert cudnn.sdpa_include_dirs([str(site)], toolkit, is_file=lambda p: p in no_frontend) is None
    assert cudnn.sdpa_include_dirs([], None, is_file=lambda p: True) is None
