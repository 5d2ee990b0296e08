"""The UNet transformer's fusions on CUDA: linear layers with their bias add and the GEGLU or
residual add after them (native/patches/linear_fused.cuh), the layer norm with its weight and
bias (native/patches/layer_norm_fused.cuh), and the self-attention from its input to cuDNN's
attention (native/patches/attn_fused.cuh). The patches applying to the pinned source, and
their graph walks asked about graphs the pinned ggml builds the way stable-diffusion.cpp builds
them (Linear, GEGLU, LayerNorm and BasicTransformerBlock's residual adds, transcribed from its
common_block.hpp and ggml_extend.hpp). The kernels need a GPU: bench/build_options.py compares
the images with and without them (SDFARM_LINEAR_FUSED=0, SDFARM_LAYER_NORM_FUSED=0,
SDFARM_ATTN_FUSED=0), docs/gpu.md."""

from __future__ import annotations

from pathlib import Path

from sdfarm.native import sourcepatch

from helpers.ggmlgraph import cuda_patched_source, pinned_source, run_graph_harness


def test_the_patch_applies_to_the_pinned_source(tmp_path: Path) -> None:
    src, out = pinned_source(), cuda_patched_source(tmp_path)
    graph = (out / sourcepatch.GRAPH).read_text()
    include = graph.index('#include "ggml-cuda/linear_fused.cuh"')
    assert include < graph.index(sourcepatch.LINEAR_ANCHOR)
    # the cuBLAS helpers it calls are defined above it
    assert graph.index("ggml_cuda_cublas_get_force_compute_type() {") < include
    assert graph.count("sdfarm_linear_fuse(*cuda_ctx, cgraph, i);") == 1
    assert graph.index("sdfarm_linear_fuse") < graph.index("ggml_cuda_topk_moe_args args;")
    assert (out / "ggml/src/ggml-cuda/linear_fused.cuh").is_file()
    assert (src / sourcepatch.GRAPH).read_text().count("sdfarm") == 0
    assert graph.count("sdfarm_layer_norm_fuse(*cuda_ctx, cgraph, i);") == 1
    assert graph.count("sdfarm_attn_fuse(*cuda_ctx, cgraph, i);") == 1
    attn = graph.index('#include "ggml-cuda/attn_fused.cuh"')
    assert include < attn < graph.index(sourcepatch.LINEAR_ANCHOR)
    fattn = (out / sourcepatch.FATTN).read_text()
    assert '#include "fattn_cudnn.cuh"' in fattn  # defines what attn_fused.cuh calls
    norm = (out / sourcepatch.NORM).read_text()
    assert '#include "layer_norm_fused.cuh"' in norm
    assert "int sdfarm_layer_norm_fuse(" in (out / sourcepatch.NORM_H).read_text()
    assert (src / sourcepatch.NORM).read_text().count("sdfarm") == 0
    for backend in ("cpu", "vulkan"):
        names = {p.name for p in sourcepatch.for_backend(backend)}
        assert not names & {
            "ggml-cuda-linear-fused",
            "ggml-cuda-layer-norm-fused",
            "ggml-cuda-attn-fused",
        }


HARNESS = r"""
#include <cstdio>
#include "ggml.h"
#include "ggml-impl.h"
#define SDFARM_HOST_GRAPH 1
#include "linear_fused.cuh"
#include "layer_norm_fused.cuh"

#ifndef IMAGES
#define IMAGES 1  // the batch: stable-diffusion.cpp's [C, L, N] in a transformer block
#endif

static ggml_context * ctx;

static ggml_tensor * f16(int64_t a, int64_t b) {
    return ggml_new_tensor_2d(ctx, GGML_TYPE_F16, a, b);
}
static ggml_tensor * f32(int64_t a) { return ggml_new_tensor_1d(ctx, GGML_TYPE_F32, a); }

// ggml_ext_linear (ggml_extend.hpp), for a 3-d x of IMAGES images (at most 1024: no reshape)
static ggml_tensor * linear(ggml_tensor * x, ggml_tensor * w, ggml_tensor * b) {
    x = ggml_mul_mat(ctx, w, x);
    if (b != nullptr) x = ggml_add_inplace(ctx, x, b);
    return x;
}

// GEGLU::forward (common_block.hpp): ggml_ext_chunk(x, 2, 0, false), cont of the gate, gelu in
// place (ggml_ext_gelu), multiply
static ggml_tensor * geglu(ggml_tensor * x, ggml_tensor * w, ggml_tensor * b) {
    x = linear(x, w, b);
    const int64_t half = x->ne[0] / 2;
    ggml_tensor * lo = ggml_view_4d(ctx, x, half, x->ne[1], x->ne[2], x->ne[3],
                                    x->nb[1], x->nb[2], x->nb[3], 0);
    ggml_tensor * hi = ggml_view_4d(ctx, x, half, x->ne[1], x->ne[2], x->ne[3],
                                    x->nb[1], x->nb[2], x->nb[3], half * x->nb[0]);
    ggml_tensor * gate = ggml_gelu_inplace(ctx, ggml_cont(ctx, hi));
    return ggml_mul(ctx, lo, gate);
}

// ggml_ext_layer_norm (ggml_extend.hpp)
static ggml_tensor * layer_norm(ggml_tensor * x, ggml_tensor * w, ggml_tensor * b) {
    x = ggml_norm(ctx, x, 1e-5f);
    x = ggml_mul_inplace(ctx, x, w);
    return ggml_add_inplace(ctx, x, b);
}

static void show(ggml_cgraph * gf) {
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        ggml_tensor * t = ggml_graph_node(gf, i);
        if (t->op == GGML_OP_NORM) {
            const int k = sdfarm_layer_norm_chain(gf, i);
            printf("%s chain %s\n", t->name, k < 0 ? "-" : ggml_graph_node(gf, k)->name);
        }
        if (t->op != GGML_OP_MUL_MAT) continue;
        const sdfarm_linear_plan p = sdfarm_linear_plan_at(gf, i);
        printf("%s kind %d", t->name, p.kind);
        if (p.kind != SDFARM_LINEAR_NONE) {
            const ggml_tensor * last = ggml_graph_node(gf, p.last);
            printf(" last %s %s", ggml_op_name(last->op), last->name);
            printf(" residual %s", p.residual ? p.residual->name : "-");
        }
        printf("\n");
        if (p.kind != SDFARM_LINEAR_NONE) {
            const sdfarm_linear_rows r = sdfarm_linear_rows_of(t);
            printf("%s rows k %ld m %ld columns %ld images %ld\n", t->name, (long) r.k, (long) r.m,
                   (long) r.columns, (long) r.images);
        }
    }
}

int main() {
    ggml_init_params params = {64 * 1024 * 1024, nullptr, true};
    ctx = ggml_init(params);
    const int64_t C = 64, L = 256, I = 4 * C;
    ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, C, L, IMAGES);
    ggml_set_name(x, "x");
    // a transformer block's attention output and feed-forward, each with its residual add
    ggml_tensor * r = x;
    ggml_tensor * n1 = layer_norm(x, f32(C), f32(C));
    ggml_set_name(n1->src[0]->src[0], "norm1");
    ggml_set_name(n1, "norm1_bias");
    ggml_tensor * h = linear(n1, f16(C, C), nullptr);  // to_q: no bias
    ggml_set_name(h, "to_q");
    ggml_tensor * o = linear(h, f16(C, C), f32(C));
    ggml_set_name(o->src[0], "to_out");
    h = ggml_add(ctx, o, r);
    ggml_set_name(h, "attn_residual");
    r = h;
    ggml_tensor * n3 = ggml_norm(ctx, h, 1e-5f);  // a norm without its bias: left to ggml
    ggml_set_name(n3, "norm_no_bias");
    ggml_tensor * g = geglu(ggml_mul_inplace(ctx, n3, f32(C)), f16(C, 2 * I), f32(2 * I));
    ggml_set_name(g->src[0]->src[0]->src[0], "geglu_proj");  // mul <- view <- add <- mul_mat
    ggml_set_name(g, "geglu_mul");
    o = linear(g, f16(I, C), f32(C));
    ggml_set_name(o->src[0], "ff_out");
    h = ggml_add(ctx, r, o);  // the residual first: either order is the same sum
    ggml_set_name(h, "ff_residual");
    // proj_out: a bias add, then the permute and copy of SpatialTransformer
    o = linear(h, f16(C, C), f32(C));
    ggml_set_name(o->src[0], "proj_out");
    ggml_set_name(o, "proj_out_bias");
    h = ggml_cont(ctx, ggml_permute(ctx, o, 1, 0, 2, 3));
    h = ggml_cont(ctx, ggml_permute(ctx, h, 1, 0, 2, 3));
    // a product read twice: by its bias add and by a multiply
    ggml_tensor * w2 = ggml_mul_mat(ctx, f16(C, C), h);
    ggml_set_name(w2, "read_twice");
    ggml_tensor * e = ggml_mul(ctx, ggml_add_inplace(ctx, w2, f32(C)), w2);
    // a bias add whose result is also read elsewhere: the residual is not taken
    ggml_tensor * k = linear(e, f16(C, C), f32(C));
    ggml_set_name(k->src[0], "bias_read_twice");
    ggml_set_name(k, "bias_read_twice_bias");
    ggml_tensor * s = ggml_add(ctx, k, e);
    ggml_tensor * out = ggml_mul(ctx, s, k);
    // a layer norm whose weighted value is read again: left to ggml
    ggml_tensor * n4 = ggml_norm(ctx, out, 1e-5f);
    ggml_set_name(n4, "norm_read_twice");
    ggml_tensor * n4w = ggml_mul_inplace(ctx, n4, f32(C));
    out = ggml_add(ctx, ggml_add_inplace(ctx, n4w, f32(C)), ggml_scale(ctx, n4w, 2.0f));
    // GEGLU whose gate copy is read again: no GEGLU, the bias alone
    ggml_tensor * p = linear(out, f16(C, 2 * I), f32(2 * I));
    ggml_set_name(p->src[0], "geglu_gate_reused");
    ggml_set_name(p, "geglu_gate_reused_bias");
    ggml_tensor * hi =
        ggml_view_4d(ctx, p, I, L, IMAGES, 1, p->nb[1], p->nb[2], p->nb[3], I * p->nb[0]);
    ggml_tensor * lo = ggml_view_4d(ctx, p, I, L, IMAGES, 1, p->nb[1], p->nb[2], p->nb[3], 0);
    ggml_tensor * gc = ggml_cont(ctx, hi);
    ggml_tensor * m2 = ggml_mul(ctx, lo, ggml_gelu_inplace(ctx, gc));
    ggml_tensor * fin = ggml_add(ctx, ggml_sum_rows(ctx, m2), ggml_sum_rows(ctx, gc));
    // f32 weights: not ours
    ggml_tensor * w32 = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, 1);
    ggml_tensor * f = ggml_add_inplace(ctx, ggml_mul_mat(ctx, w32, fin), f32(1));
    ggml_set_name(f->src[0], "f32_weights");
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, f);
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        ggml_graph_node(gf, i)->flags |= GGML_TENSOR_FLAG_COMPUTE;
    }
    show(gf);
    ggml_free(ctx);
    return 0;
}
"""


LINEAR_KINDS = {
    "to_q": "0",
    "to_out": "2 last ADD attn_residual residual x",
    "geglu_proj": "3 last MUL geglu_mul residual -",
    "ff_out": "2 last ADD ff_residual residual attn_residual",
    "proj_out": "1 last ADD proj_out_bias residual -",
    "read_twice": "0",
    "bias_read_twice": "1 last ADD bias_read_twice_bias residual -",
    "geglu_gate_reused": "1 last ADD geglu_gate_reused_bias residual -",
    "f32_weights": "0",
}


def linear_rows(lines: list[str]) -> dict[str, tuple[int, ...]]:
    """name -> (k, m, columns, images) of each linear the walk takes."""
    rows = (line.split(" rows ") for line in lines if " rows " in line)
    return {name: tuple(int(v) for v in rest.split()[1::2]) for name, rest in rows}


def test_the_walk_takes_stable_diffusion_cpps_linears_and_nothing_else(tmp_path: Path) -> None:
    """GEGLU, the residual adds and a plain bias add are each taken whole; a linear without a
    bias, a product or bias add read by another node, a gate copy read again and f32 weights
    are left to ggml (kind 0 or the bias alone)."""
    lines = run_graph_harness(tmp_path, HARNESS)
    got = {line.split(" kind ")[0]: line.split(" kind ")[1] for line in lines if " kind " in line}
    assert got == LINEAR_KINDS, lines
    assert linear_rows(lines)["geglu_proj"] == (64, 512, 256, 1), lines


def test_a_batch_of_four_images_fuses_as_one_does(tmp_path: Path) -> None:
    """Batched sampling makes the transformer's input [C, L, 4]: contiguous, so the walk takes
    the same chains (GEGLU's halves, the residual adds, the layer norms), and the fused pass
    covers L x 4 rows of the product, which the GEMMs make one image at a time (ggml's node at
    N > 1 is ggml_cuda_mul_mat_batched_cublas: L columns per image)."""
    lines = run_graph_harness(tmp_path, "#define IMAGES 4\n" + HARNESS)
    got = {line.split(" kind ")[0]: line.split(" kind ")[1] for line in lines if " kind " in line}
    assert got == LINEAR_KINDS, lines
    assert linear_rows(lines) == {
        "to_out": (64, 64, 256, 4),
        "geglu_proj": (64, 512, 256, 4),  # 2 x 256 wide: GEGLU's halves per row
        "ff_out": (256, 64, 256, 4),
        "proj_out": (64, 64, 256, 4),
        "bias_read_twice": (64, 64, 256, 4),
        "geglu_gate_reused": (64, 512, 256, 4),
    }, lines
    chains = dict(line.split(" chain ") for line in lines if " chain " in line)
    assert chains == {"norm1": "norm1_bias", "norm_no_bias": "-", "norm_read_twice": "-"}, lines


def test_the_layer_norm_walk_takes_ggml_ext_layer_norm_whole_and_nothing_else(tmp_path) -> None:
    """NORM, its weight's MUL and its bias's ADD (in place) end at the ADD; a norm without a
    bias or whose weighted value is read again is left to ggml."""
    lines = run_graph_harness(tmp_path, HARNESS)
    got = dict(line.split(" chain ") for line in lines if " chain " in line)
    assert got == {"norm1": "norm1_bias", "norm_no_bias": "-", "norm_read_twice": "-"}, lines


LINEAR_VALUES_HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <vector>
#include "ggml.h"
#include "ggml-cpu.h"
#include "ggml-impl.h"
#define SDFARM_HOST_GRAPH 1
#include "linear_fused.cuh"

static ggml_context * ctx;

static ggml_tensor * filled(ggml_type type, int64_t a, int64_t b, int64_t c, double f) {
    ggml_tensor * t = ggml_new_tensor_3d(ctx, type, a, b, c);
    for (int64_t i = 0; i < ggml_nelements(t); i++) {
        const float v = (float) std::sin(f * (double) i + 0.5);
        if (type == GGML_TYPE_F16) ((ggml_fp16_t *) t->data)[i] = ggml_fp32_to_fp16(0.1f * v);
        else ((float *) t->data)[i] = v;
    }
    return t;
}

// sdfarm_linear_epilogue's arithmetic, one value at a time (V = 1), on the f32 product (the
// kernel reads the f16 one; the indexing is the same).
static std::vector<float> epilogue(int kind, const float * c, const float * b, const float * r,
                                   int64_t width, int64_t rows) {
    std::vector<float> out((size_t) (width * rows));
    for (int64_t row = 0; row < rows; row++)
    for (int64_t col = 0; col < width; col++) {
        float y;
        if (kind == SDFARM_LINEAR_GEGLU) {
            const float x = c[row * 2 * width + col] + b[col];
            const float g = c[row * 2 * width + width + col] + b[width + col];
            y = x * (0.5f * g * (1.0f + std::tanh(0.7978845608f * g * (1.0f + 0.044715f * g * g))));
        } else {
            y = c[row * width + col] + b[col];
            if (kind == SDFARM_LINEAR_RESIDUAL) y += r[row * width + col];
        }
        out[(size_t) (row * width + col)] = y;
    }
    return out;
}

int main() {
    ggml_init_params params = {64 * 1024 * 1024, nullptr, false};
    ctx = ggml_init(params);
    const int64_t C = 64, L = 48, N = 4, I = 96;
    ggml_tensor * x = filled(GGML_TYPE_F32, C, L, N, 0.37);
    ggml_tensor * w1 = filled(GGML_TYPE_F16, C, C, 1, 0.11);
    ggml_tensor * w2 = filled(GGML_TYPE_F16, C, 2 * I, 1, 0.13);
    // to_out with its residual add, then GEGLU (common_block.hpp's FeedForward)
    ggml_tensor * b1 = filled(GGML_TYPE_F32, C, 1, 1, 0.7);
    ggml_tensor * b2 = filled(GGML_TYPE_F32, 2 * I, 1, 1, 0.3);
    ggml_tensor * o = ggml_add_inplace(ctx, ggml_mul_mat(ctx, w1, x), b1);
    ggml_tensor * h = ggml_add(ctx, o, x);
    ggml_tensor * p = ggml_add_inplace(ctx, ggml_mul_mat(ctx, w2, h), b2);
    ggml_tensor * lo = ggml_view_4d(ctx, p, I, L, N, 1, p->nb[1], p->nb[2], p->nb[3], 0);
    ggml_tensor * hi = ggml_view_4d(ctx, p, I, L, N, 1, p->nb[1], p->nb[2], p->nb[3], I * p->nb[0]);
    ggml_tensor * out = ggml_mul(ctx, lo, ggml_gelu_inplace(ctx, ggml_cont(ctx, hi)));
    // the products again, kept (the chain's bias adds are in place on theirs)
    ggml_tensor * c1 = ggml_mul_mat(ctx, w1, x);
    ggml_tensor * c2 = ggml_mul_mat(ctx, w2, h);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_build_forward_expand(gf, c1);
    ggml_build_forward_expand(gf, c2);
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        ggml_graph_node(gf, i)->flags |= GGML_TENSOR_FLAG_COMPUTE;
    }
    ggml_graph_compute_with_ctx(ctx, gf, 2);
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        const ggml_tensor * mm = ggml_graph_node(gf, i);
        if (mm->op != GGML_OP_MUL_MAT || mm == c1 || mm == c2) continue;
        const sdfarm_linear_plan plan = sdfarm_linear_plan_at(gf, i);
        const sdfarm_linear_rows r = sdfarm_linear_rows_of(mm);
        const ggml_tensor * last = ggml_graph_node(gf, plan.last);
        const int64_t width = plan.kind == SDFARM_LINEAR_GEGLU ? r.m / 2 : r.m;
        const float * c = (const float *) (mm->src[0] == w1 ? c1 : c2)->data;
        const float * res = plan.residual ? (const float *) plan.residual->data : nullptr;
        const std::vector<float> want = epilogue(plan.kind, c, (const float *) plan.bias->data,
                                                 res, width, r.columns * r.images);
        double worst = ggml_nelements(last) == (int64_t) want.size() ? 0.0 : INFINITY;
        for (size_t k = 0; k < want.size() && worst == worst; k++) {
            const double e = std::fabs((double) want[k] - ((const float *) last->data)[k]);
            worst = e > worst ? e : worst;
        }
        printf("kind %d rows %ld width %ld error %.6f\n", plan.kind,
               (long) (r.columns * r.images), (long) width, worst);
    }
    ggml_free(ctx);
    return 0;
}
"""


def test_the_fused_pass_over_a_batch_covers_every_image(tmp_path: Path) -> None:
    """Indexing, on the host: the fused pass's arithmetic over L x 4 rows of the product (the
    kernel's indexing, one value at a time) against what the pinned ggml computes on the CPU
    for the residual add and GEGLU of four images ([C, L, 4], GEGLU's halves viewed per
    image): the same values (GEGLU to the CPU's gelu, which ggml takes from an f16 table)."""
    lines = run_graph_harness(tmp_path, LINEAR_VALUES_HARNESS)
    assert [line.rsplit(" error ", 1)[0] for line in lines] == [
        "kind 2 rows 192 width 64",
        "kind 3 rows 192 width 96",
    ], lines
    errors = [float(line.rsplit(" error ", 1)[1]) for line in lines]
    assert errors[0] == 0.0 and errors[1] < 2e-3, lines


ATTN_HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#include "ggml.h"
#include "ggml-impl.h"
#define SDFARM_HOST_GRAPH 1
#include "attn_fused.cuh"

static ggml_context * ctx;

// CrossAttention::forward (common_block.hpp) through ggml_ext_attention_ext (ggml_extend.hpp)
// with flash attention, for key lengths that need no padding, over x's ne[2] images; `twice`
// reads to_q's product again, `mask` adds one, `q4d` makes Q [d, L, H, N] where
// stable-diffusion.cpp makes it [d, L, H * N], `wrong_split` splits to_q's product as
// [d, L, H, N] (the same shapes, other values)
static ggml_tensor * attention(ggml_tensor * x, ggml_tensor * context, int64_t H, bool twice,
                               bool mask, const char * name, bool q4d = false,
                               bool wrong_split = false) {
    const int64_t C = x->ne[0], L = x->ne[1], N = x->ne[2], d = C / H;
    ggml_tensor * q = ggml_mul_mat(ctx, ggml_new_tensor_2d(ctx, GGML_TYPE_F16, C, C), x);
    ggml_set_name(q, name);
    ggml_tensor * wk = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, context->ne[0], C);
    ggml_tensor * wv = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, context->ne[0], C);
    ggml_tensor * k = ggml_mul_mat(ctx, wk, context);
    ggml_tensor * v = ggml_mul_mat(ctx, wv, context);
    const int64_t Lk = k->ne[1];
    ggml_tensor * extra = twice ? ggml_sum(ctx, q) : nullptr;
    q = wrong_split ? ggml_reshape_4d(ctx, q, d, L, H, N) : ggml_reshape_4d(ctx, q, d, H, L, N);
    q = ggml_cont(ctx, ggml_permute(ctx, q, 0, 2, 1, 3));
    q = q4d ? ggml_reshape_4d(ctx, q, d, L, H, N) : ggml_reshape_3d(ctx, q, d, L, H * N);
    k = ggml_reshape_4d(ctx, k, d, H, Lk, N);
    k = ggml_cont(ctx, ggml_permute(ctx, k, 0, 2, 1, 3));
    k = q4d ? ggml_reshape_4d(ctx, k, d, Lk, H, N) : ggml_reshape_3d(ctx, k, d, Lk, H * N);
    v = ggml_reshape_4d(ctx, v, d, H, Lk, N);
    k = ggml_cast(ctx, k, GGML_TYPE_F16);
    v = ggml_cont(ctx, ggml_permute(ctx, v, 0, 2, 1, 3));
    v = q4d ? ggml_reshape_4d(ctx, v, d, Lk, H, N) : ggml_reshape_3d(ctx, v, d, Lk, H * N);
    v = ggml_cast(ctx, v, GGML_TYPE_F16);
    ggml_tensor * m = mask ? ggml_new_tensor_2d(ctx, GGML_TYPE_F16, Lk, L) : nullptr;
    ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, m, 1.0f / std::sqrt((float) d), 0, 0);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    if (!q4d) {
        // [d, H * N, L] -> [d, H, L, N] (for one image the view of ggml_ext_attention_ext; the
        // pinned one takes image 0's heads alone at N > 1 and then fails its reshape)
        out = ggml_view_4d(ctx, out, d, H, N, L, out->nb[1], out->nb[1] * H, out->nb[2], 0);
        out = ggml_cont(ctx, ggml_permute(ctx, out, 0, 1, 3, 2));
    }
    out = ggml_reshape_3d(ctx, out, C, L, N);
    return extra ? ggml_add(ctx, out, ggml_repeat(ctx, extra, out)) : out;
}

int main() {
    ggml_init_params params = {64 * 1024 * 1024, nullptr, true};
    ctx = ggml_init(params);
    const int64_t C = 320, L = 512;
    ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, C, L, 1);
    ggml_tensor * context = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1024, 256, 1);
    ggml_tensor * h = ggml_add(ctx, attention(x, x, 5, false, false, "self"), x);
    h = ggml_add(ctx, attention(h, context, 5, false, false, "cross"), h);
    h = ggml_add(ctx, attention(h, h, 5, true, false, "q_read_twice"), h);
    h = ggml_add(ctx, attention(h, h, 5, false, true, "masked"), h);
    // a batch of four (batched sampling): the context repeated over it
    ggml_tensor * x4 = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, C, L, 4);
    ggml_tensor * context4 =
        ggml_repeat(ctx, context, ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1024, 256, 4));
    ggml_tensor * h4 = ggml_add(ctx, attention(x4, x4, 5, false, false, "self4"), x4);
    h4 = ggml_add(ctx, attention(h4, context4, 5, false, false, "cross4"), h4);
    h4 = ggml_add(ctx, attention(h4, h4, 5, false, false, "self4_q4d", true), h4);
    h4 = ggml_add(ctx, attention(h4, h4, 5, false, false, "wrong_split4", false, true), h4);
    h4 = ggml_add(ctx, attention(h4, h4, 5, true, false, "q_read_twice4"), h4);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, h);
    ggml_build_forward_expand(gf, h4);
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        ggml_graph_node(gf, i)->flags |= GGML_TENSOR_FLAG_COMPUTE;
    }
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        ggml_tensor * t = ggml_graph_node(gf, i);
        if (t->op != GGML_OP_MUL_MAT || strncmp(t->name, "node_", 5) == 0) continue;
        const sdfarm_attn_plan p = sdfarm_attn_plan_at(gf, i);
        if (p.fa < 0) {
            printf("%s -\n", t->name);
            continue;
        }
        printf("%s %s after %d nodes: heads %ld d %ld len %ld scale %.4f shared x %d"
               " images %ld in heads %d\n", t->name, ggml_op_name(ggml_graph_node(gf, p.fa)->op),
               p.fa - i, (long) p.heads, (long) p.d, (long) p.len, p.scale, p.x == t->src[1],
               (long) p.images, (int) p.images_in_heads);
    }
    ggml_free(ctx);
    return 0;
}
"""


def test_the_attention_walk_takes_the_unets_self_attention_and_nothing_else(tmp_path) -> None:
    """Self-attention is taken from to_q's product to the attention (18 nodes in between, the
    input shared by to_q, to_k and to_v), of one image or of a batch of four (whose images
    stable-diffusion.cpp folds into the heads, or a Q of [d, L, H, N]); cross-attention (K and V
    from the context), a to_q product read again, a masked attention and a product split
    otherwise than [d, H, L, N] are left to ggml."""
    lines = run_graph_harness(tmp_path, ATTN_HARNESS)
    got = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in lines}
    taken = "FLASH_ATTN_EXT after 17 nodes: heads 5 d 64 len 512 scale 0.1250 shared x 1"
    assert got == {
        "self": f"{taken} images 1 in heads 0",
        "cross": "-",
        "q_read_twice": "-",
        "masked": "-",
        "self4": f"{taken} images 4 in heads 1",
        "cross4": "-",
        "self4_q4d": f"{taken} images 4 in heads 0",
        "wrong_split4": "-",
        "q_read_twice4": "-",
    }, lines


ATTN_VALUES_HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <vector>
#include "ggml.h"
#include "ggml-cpu.h"
#include "ggml-impl.h"
#define SDFARM_HOST_GRAPH 1
#include "attn_fused.cuh"
#include "fattn_cudnn.cuh"

// The attention of B images as cuDNN's SDPA computes it from the dims and strides the fusion
// gives it (fattn_cudnn.cuh), Q, K and V read from to_q's, to_k's and to_v's products ([C, L, N]:
// the rows the fusion's GEMMs write), O written at O's strides.
static std::vector<float> sdpa(const sdfarm_sdpa_dims & s, const float * q, const float * k,
                               const float * v, float scale) {
    std::vector<float> o((size_t) (s.B * s.H * s.Sq * s.D), NAN);
    std::vector<double> p((size_t) s.Skv);
    for (int64_t b = 0; b < s.B; b++)
    for (int64_t h = 0; h < s.H; h++)
    for (int64_t i = 0; i < s.Sq; i++) {
        const float * qi = q + b * s.q[0] + h * s.q[1] + i * s.q[2];
        double top = -INFINITY, sum = 0.0;
        for (int64_t j = 0; j < s.Skv; j++) {
            const float * kj = k + b * s.k[0] + h * s.k[1] + j * s.k[2];
            double dot = 0.0;
            for (int64_t e = 0; e < s.D; e++) dot += (double) qi[e] * kj[e];
            p[j] = dot * scale;
            top = p[j] > top ? p[j] : top;
        }
        for (int64_t j = 0; j < s.Skv; j++) sum += (p[j] = std::exp(p[j] - top));
        for (int64_t e = 0; e < s.D; e++) {
            double acc = 0.0;
            for (int64_t j = 0; j < s.Skv; j++)
                acc += p[j] * v[b * s.v[0] + h * s.v[1] + j * s.v[2] + e];
            o[b * s.o[0] + h * s.o[1] + i * s.o[2] + e] = (float) (acc / sum);
        }
    }
    return o;
}

static double worst(const std::vector<float> & a, const float * b) {
    double w = 0.0;
    for (size_t i = 0; i < a.size(); i++) {
        const double e = std::fabs((double) a[i] - b[i]);
        w = e == e && e < w ? w : e;  // NAN (never written) is the worst
    }
    return w;
}

// ggml_ext_attention_ext's self-attention (flash) of N images, computed by the pinned ggml on
// the CPU, against the SDPA the fusion would run for it.
static void run(int64_t N, bool q4d) {
    ggml_init_params params = {64 * 1024 * 1024, nullptr, false};
    ggml_context * ctx = ggml_init(params);
    const int64_t C = 128, H = 2, d = 64, L = 24;
    ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, C, L, N);
    for (int64_t i = 0; i < ggml_nelements(x); i++) ((float *) x->data)[i] = std::sin(0.37 * i);
    ggml_tensor * w[3];
    for (int o = 0; o < 3; o++) {
        w[o] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, C, C);
        for (int64_t i = 0; i < C * C; i++) {
            const float f = 0.1f * (float) std::cos(0.11 * i + o);
            ((ggml_fp16_t *) w[o]->data)[i] = ggml_fp32_to_fp16(f);
        }
    }
    ggml_tensor * mm[3];
    ggml_tensor * t[3];
    for (int o = 0; o < 3; o++) {
        mm[o] = ggml_mul_mat(ctx, w[o], x);
        t[o] = ggml_reshape_4d(ctx, mm[o], d, H, L, N);
        if (o == 2) continue;
        t[o] = ggml_cont(ctx, ggml_permute(ctx, t[o], 0, 2, 1, 3));
        t[o] = q4d ? ggml_reshape_4d(ctx, t[o], d, L, H, N)
                   : ggml_reshape_3d(ctx, t[o], d, L, H * N);
    }
    t[1] = ggml_cast(ctx, t[1], GGML_TYPE_F16);
    t[2] = ggml_cont(ctx, ggml_permute(ctx, t[2], 0, 2, 1, 3));
    t[2] = q4d ? ggml_reshape_4d(ctx, t[2], d, L, H, N) : ggml_reshape_3d(ctx, t[2], d, L, H * N);
    t[2] = ggml_cast(ctx, t[2], GGML_TYPE_F16);
    const float scale = 1.0f / std::sqrt((float) d);
    ggml_tensor * att = ggml_flash_attn_ext(ctx, t[0], t[1], t[2], nullptr, scale, 0, 0);
    ggml_flash_attn_ext_set_prec(att, GGML_PREC_F32);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, att);
    int iq = -1;
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        ggml_graph_node(gf, i)->flags |= GGML_TENSOR_FLAG_COMPUTE;
        if (ggml_graph_node(gf, i) == mm[0]) iq = i;
    }
    const sdfarm_attn_plan p = sdfarm_attn_plan_at(gf, iq);
    if (p.fa < 0 || ggml_graph_node(gf, p.fa) != att) {
        printf("N %ld q4d %d: not taken\n", (long) N, (int) q4d);
        return;
    }
    ggml_graph_compute_with_ctx(ctx, gf, 2);
    const float * q = (const float *) mm[0]->data;
    const float * k = (const float *) mm[1]->data;
    const float * v = (const float *) mm[2]->data;
    const sdfarm_sdpa_dims s =
        sdfarm_sdpa_rows_dims(p.images, p.heads, p.len, p.d, p.images_in_heads);
    const sdfarm_sdpa_dims other =
        sdfarm_sdpa_rows_dims(p.images, p.heads, p.len, p.d, !p.images_in_heads);
    const float * got = (const float *) att->data;
    printf("N %ld q4d %d: B %ld H %ld L %ld D %ld o strides %ld %ld %ld: error %.5f,"
           " other layout's %.5f\n", (long) N, (int) q4d, (long) s.B, (long) s.H, (long) s.Sq,
           (long) s.D, (long) s.o[0], (long) s.o[1], (long) s.o[2],
           worst(sdpa(s, q, k, v, p.scale), got), worst(sdpa(other, q, k, v, p.scale), got));
    ggml_free(ctx);
}

int main() {
    run(1, false);
    run(4, false);
    run(4, true);
    return 0;
}
"""


def test_the_fused_attention_of_a_batch_writes_what_ggmls_attention_writes(tmp_path) -> None:
    """Indexing, on the host: the attention of N images (ggml_ext_attention_ext's, computed by
    the pinned ggml on the CPU) against the SDPA the fusion gives cuDNN, Q, K and V read from the
    to_q, to_k and to_v products at its strides (each image L rows of H x D values) and O written
    at its strides: the same values to f16 K and V's rounding, for one image and for four
    (stable-diffusion.cpp's Q of [d, L, H x 4], so each of O's rows holds the four images' heads,
    and a Q of [d, L, H, 4]); the other layout's O strides would put values elsewhere."""
    lines = run_graph_harness(tmp_path, ATTN_VALUES_HARNESS)
    got = {line.split(":")[0]: line.split(": ", 1)[1] for line in lines}
    assert set(got) == {"N 1 q4d 0", "N 4 q4d 0", "N 4 q4d 1"}, lines
    strides = {key: value.split(": ")[0] for key, value in got.items()}
    assert strides == {
        "N 1 q4d 0": "B 1 H 2 L 24 D 64 o strides 3072 64 128",
        "N 4 q4d 0": "B 4 H 2 L 24 D 64 o strides 128 64 512",  # a row: 4 images x 2 heads
        "N 4 q4d 1": "B 4 H 2 L 24 D 64 o strides 3072 64 128",
    }, lines
    for key, value in got.items():
        error = float(value.split("error ")[1].split(",")[0])
        other = float(value.split("other layout's ")[1])
        assert error < 0.02, lines  # f16 K and V (and ggml's f16 accumulation of V) on the CPU
        if key != "N 1 q4d 0":  # one image: both layouts are [d, H, L]
            assert other > 0.1, lines
