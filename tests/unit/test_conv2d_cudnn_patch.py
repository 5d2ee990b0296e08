"""Convolutions through cuDNN on CUDA (native/patches/conv2d_cudnn.cuh, native/cudnn.py; an
operator's switch): which library a worker names to its runtime, the patch applying to the
pinned source, the fusion's graph walk on a graph the pinned ggml builds (the CPU runtime's
library), and the workspace the patch allows against what the estimate counts. The cuDNN
calls themselves need a GPU (bench/gpu_run.sh cudnnfix, cudnnalone; docs/gpu.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdfarm.native import cudnn, sourcepatch
from sdfarm.native.devices import Device
from sdfarm.native.estimate import (
    CUDA_CONTEXT_BYTES,
    CUDNN_DECODE_BYTES_PER_PIXEL,
    CUDNN_WORKSPACE_FIXED_BYTES,
    context_bytes,
)

from helpers.ggmlgraph import cuda_patched_source, pinned_source, run_graph_harness


def test_cudnn_is_used_only_where_the_operator_named_a_file(tmp_path: Path) -> None:
    """An operator's switch (it moves pixels by a rounding): never found on its own, only a
    named file counts."""
    lib = tmp_path / "libcudnn.so.9"
    lib.write_bytes(b"")
    assert cudnn.find({}) is None
    assert cudnn.find({cudnn.ENV: ""}) is None
    assert cudnn.find({cudnn.ENV: "0"}) is None
    assert cudnn.find({cudnn.ENV: str(lib)}) == lib
    assert cudnn.find({cudnn.ENV: f" {lib} "}) == lib
    assert cudnn.find({cudnn.ENV: str(tmp_path / "missing.so")}) is None
    assert cudnn.find({cudnn.ENV: str(tmp_path)}) is None  # a folder is not the library
    assert cudnn.find({cudnn.ENV: "/x.so"}, is_file=lambda p: p == Path("/x.so")) == Path("/x.so")


def test_auto_takes_the_first_cudnn_of_this_pythons_wheels_then_the_systems(tmp_path) -> None:
    """SDFARM_CUDNN=auto: a cuDNN wheel in a sys.path folder (nvidia/cudnn/lib, where
    nvidia-cudnn-cu13 and PyTorch's put it) before the system's folders; none found is off."""
    site, system = tmp_path / "site", tmp_path / "usr-lib"
    assert cudnn.search_dirs([str(site), ""]) == [
        site / "nvidia" / "cudnn" / "lib",
        *map(Path, cudnn.SYSTEM_DIRS),
    ]
    wheel = site / "nvidia" / "cudnn" / "lib"
    wheel.mkdir(parents=True)
    system.mkdir()
    (system / cudnn.LIBRARY).write_bytes(b"")
    dirs = [wheel, system]
    assert cudnn.find({cudnn.ENV: "auto"}, dirs=dirs) == system / cudnn.LIBRARY
    (wheel / cudnn.LIBRARY).write_bytes(b"")
    assert cudnn.find({cudnn.ENV: " auto "}, dirs=dirs) == wheel / cudnn.LIBRARY
    assert cudnn.find({cudnn.ENV: "auto"}, dirs=[tmp_path / "none"]) is None


def test_the_runtime_is_told_the_library_the_estimate_counted_on(tmp_path: Path) -> None:
    """export names the found file to the runtime, or 0 so that it opens none of its own."""
    lib = tmp_path / "libcudnn.so.9"
    lib.write_bytes(b"")
    env = {cudnn.ENV: str(lib)}
    assert cudnn.export(env) == lib and env[cudnn.ENV] == str(lib)
    env = {cudnn.ENV: str(tmp_path / "gone.so")}
    assert cudnn.export(env) is None and env[cudnn.ENV] == "0"
    env = {}
    assert cudnn.export(env) is None and env[cudnn.ENV] == "0"


def test_the_patch_applies_to_the_pinned_source(tmp_path: Path) -> None:
    src, out = pinned_source(), cuda_patched_source(tmp_path)
    conv = (out / sourcepatch.CONV).read_text()
    assert '#include "conv2d_cudnn.cuh"' in conv
    body = conv.split(
        "void ggml_cuda_op_conv2d(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {"
    )
    assert body[1].lstrip().startswith("if (sdfarm_cudnn_conv2d(ctx, dst, dst, nullptr))")
    assert "int sdfarm_conv2d_fuse(" in (out / sourcepatch.CONV_H).read_text()
    graph = (out / sourcepatch.GRAPH).read_text()
    assert graph.count("sdfarm_conv2d_fuse(*cuda_ctx, cgraph, i);") == 1
    assert graph.index("sdfarm_group_norm_fuse") < graph.index("sdfarm_conv2d_fuse")
    assert graph.index("sdfarm_conv2d_fuse") < graph.index("ggml_cuda_topk_moe_args args;")
    assert (out / "ggml/src/ggml-cuda/sdfarm_graph.cuh").is_file()
    assert (src / sourcepatch.CONV).read_text().count("sdfarm") == 0
    assert "ggml-cuda-conv2d-cudnn" not in {p.name for p in sourcepatch.for_backend("cpu")}


GRAPH_HARNESS = r"""
#include <cstdio>
#include "ggml.h"
#include "ggml-impl.h"
#define SDFARM_HOST_GRAPH 1
#include "conv2d_cudnn.cuh"

#ifndef IMAGES
#define IMAGES 1  // the batch (ggml's dim 3)
#endif

// ggml_ext_conv_2d of stable-diffusion.cpp with direct convolution (src/ggml_extend.hpp).
static ggml_tensor * sd_conv(ggml_context * ctx, ggml_tensor * x, ggml_tensor * w,
                             ggml_tensor * b) {
    x = ggml_conv_2d_direct(ctx, w, x, 1, 1, 1, 1, 1, 1);
    if (b != nullptr) {
        b = ggml_reshape_4d(ctx, b, 1, 1, b->ne[0], 1);
        x = ggml_add_inplace(ctx, x, b);
    }
    return x;
}

int main() {
    ggml_init_params params = {64 * 1024 * 1024, nullptr, true};
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * x = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 16, 16, 8, IMAGES);
    ggml_tensor * w1 = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, 3, 3, 8, 8);
    ggml_tensor * b1 = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 8);
    ggml_tensor * w2 = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, 3, 3, 8, 8);
    ggml_tensor * w3 = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, 3, 3, 8, 8);
    // 1: conv + bias, then silu (a resnet's conv)
    ggml_tensor * h = ggml_silu_inplace(ctx, sd_conv(ctx, x, w1, b1));
    // 2: a conv without bias whose result is added to another tensor: not a bias add
    ggml_tensor * c = sd_conv(ctx, h, w2, nullptr);
    ggml_tensor * s = ggml_add(ctx, c, h);
    // 3: a conv read twice (the add and the mul): not fusable
    ggml_tensor * d = ggml_conv_2d_direct(ctx, w3, s, 1, 1, 1, 1, 1, 1);
    ggml_tensor * e = ggml_add(ctx, d, ggml_reshape_4d(ctx, b1, 1, 1, 8, 1));
    ggml_tensor * out = ggml_mul(ctx, e, d);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        if (ggml_graph_node(gf, i)->op != GGML_OP_CONV_2D) continue;
        const int j = sdfarm_conv2d_bias_node(gf, i);
        printf("conv at %d: bias add %d", i, j);
        if (j >= 0) printf(" (%s) between: %s", ggml_op_name(ggml_graph_node(gf, j)->op),
                           ggml_op_name(ggml_graph_node(gf, i + 1)->op));
        printf("\n");
    }
    ggml_free(ctx);
    return 0;
}
"""


@pytest.mark.parametrize("images", [1, 4])
def test_the_bias_add_fuses_only_where_it_is_ggml_ext_conv_2ds(tmp_path: Path, images) -> None:
    """The walk finds stable-diffusion.cpp's bias add behind the bias's reshape, and refuses
    an add of another tensor and a convolution that is read twice; the same over a batch of
    four images (batched sampling: cuDNN's N, the bias broadcast over it)."""
    lines = run_graph_harness(tmp_path, f"#define IMAGES {images}\n" + GRAPH_HARNESS)
    assert len(lines) == 3, lines
    assert "(ADD) between: RESHAPE" in lines[0], lines[0]
    assert lines[1].endswith("bias add -1"), lines[1]
    assert lines[2].endswith("bias add -1"), lines[2]


WORKSPACE_HARNESS = r"""
#include <cstdio>
#include "ggml.h"
#include "ggml-impl.h"
#define SDFARM_HOST_GRAPH 1
#include "conv2d_cudnn.cuh"

int main() {
%s
    return 0;
}
"""


def workspace_caps(tmp_path: Path, shapes: list[tuple[int, int, int]]) -> list[int]:
    """sdfarm_cudnn_max_workspace of the patch for 3x3 convolutions C -> K at S x S."""
    calls = "\n".join(
        f'    printf("%zu\\n", sdfarm_cudnn_max_workspace({c * s * s}LL, {k * s * s}LL));'
        for c, k, s in shapes
    )
    return [int(line) for line in run_graph_harness(tmp_path, WORKSPACE_HARNESS % calls)]


def test_the_workspace_cap_admits_the_algorithm_cudnn_ranked_first(tmp_path: Path) -> None:
    """The heuristics' first algorithm (implicit-precomputed GEMM) for bench/cudnn_check.cpp's
    shapes on the H200 (bench/results/gpu/log-cudnnalone-3.txt) fits the cap; a fixed 64 MiB
    refused the larger two, and images were 2-3x slower."""
    ranked_first = {(320, 320, 8): 1_926_416, (128, 128, 256): 42_238_835,
                    (256, 256, 512): 269_616_275}  # fmt: skip
    *caps, fixed = workspace_caps(tmp_path, [*ranked_first, (0, 0, 0)])
    for (shape, needed), cap in zip(ranked_first.items(), caps, strict=True):
        assert cap >= needed, shape
    assert fixed == CUDNN_WORKSPACE_FIXED_BYTES


def test_the_estimate_counts_the_largest_decode_convolution_at_every_size(tmp_path) -> None:
    """Per decoded pixel, CUDNN_DECODE_BYTES_PER_PIXEL holds the SD VAE's largest
    convolution (256 -> 256 channels at the output size): its f16 input and output copies and
    the workspace the patch allows, less the fixed part, which the context term holds."""
    sides = (64, 256, 512, 1024, 2048)
    caps = workspace_caps(tmp_path, [(256, 256, s) for s in sides])
    for side, cap in zip(sides, caps, strict=True):
        pixels = side * side
        copies = 2 * (256 * pixels * 2)  # f16 input and output
        assert CUDNN_DECODE_BYTES_PER_PIXEL * pixels >= copies + cap - CUDNN_WORKSPACE_FIXED_BYTES


def test_a_named_cudnn_adds_its_fixed_workspace_to_a_cuda_processs_context(
    tmp_path: Path, monkeypatch
) -> None:
    lib = tmp_path / "libcudnn.so.9"
    lib.write_bytes(b"")
    cuda, cpu = Device(0, "CUDA0", "H200", "gpu", 1, 1), Device(0, "CPU", "Xeon", "cpu", 1, 1)
    monkeypatch.setenv(cudnn.ENV, "0")
    assert context_bytes(cuda) == CUDA_CONTEXT_BYTES
    monkeypatch.setenv(cudnn.ENV, str(lib))
    assert context_bytes(cuda) == CUDA_CONTEXT_BYTES + CUDNN_WORKSPACE_FIXED_BYTES
    assert context_bytes(cpu) == 0
