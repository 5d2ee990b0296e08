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

static ggml_context * ctx;

static ggml_tensor * f16(int64_t a, int64_t b) {
    return ggml_new_tensor_2d(ctx, GGML_TYPE_F16, a, b);
}
static ggml_tensor * f32(int64_t a) { return ggml_new_tensor_1d(ctx, GGML_TYPE_F32, a); }

// ggml_ext_linear (ggml_extend.hpp), for a 3-d x of one image
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
    }
}

int main() {
    ggml_init_params params = {64 * 1024 * 1024, nullptr, true};
    ctx = ggml_init(params);
    const int64_t C = 64, L = 256, I = 4 * C;
    ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, C, L, 1);
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
    ggml_tensor * hi = ggml_view_4d(ctx, p, I, L, 1, 1, p->nb[1], p->nb[2], p->nb[3], I * p->nb[0]);
    ggml_tensor * lo = ggml_view_4d(ctx, p, I, L, 1, 1, p->nb[1], p->nb[2], p->nb[3], 0);
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


def test_the_walk_takes_stable_diffusion_cpps_linears_and_nothing_else(tmp_path: Path) -> None:
    """GEGLU, the residual adds and a plain bias add are each taken whole; a linear without a
    bias, a product or bias add read by another node, a gate copy read again and f32 weights
    are left to ggml (kind 0 or the bias alone)."""
    lines = run_graph_harness(tmp_path, HARNESS)
    got = {line.split(" kind ")[0]: line.split(" kind ")[1] for line in lines if " kind " in line}
    assert got == {
        "to_q": "0",
        "to_out": "2 last ADD attn_residual residual x",
        "geglu_proj": "3 last MUL geglu_mul residual -",
        "ff_out": "2 last ADD ff_residual residual attn_residual",
        "proj_out": "1 last ADD proj_out_bias residual -",
        "read_twice": "0",
        "bias_read_twice": "1 last ADD bias_read_twice_bias residual -",
        "geglu_gate_reused": "1 last ADD geglu_gate_reused_bias residual -",
        "f32_weights": "0",
    }, lines


def test_the_layer_norm_walk_takes_ggml_ext_layer_norm_whole_and_nothing_else(tmp_path) -> None:
    """NORM, its weight's MUL and its bias's ADD (in place) end at the ADD; a norm without a
    bias or whose weighted value is read again is left to ggml."""
    lines = run_graph_harness(tmp_path, HARNESS)
    got = dict(line.split(" chain ") for line in lines if " chain " in line)
    assert got == {"norm1": "norm1_bias", "norm_no_bias": "-", "norm_read_twice": "-"}, lines


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
// with flash attention, for key lengths that need no padding; `twice` reads to_q's product
// again, `mask` adds one
static ggml_tensor * attention(ggml_tensor * x, ggml_tensor * context, int64_t H, bool twice,
                               bool mask, const char * name) {
    const int64_t C = x->ne[0], L = x->ne[1], d = C / H;
    ggml_tensor * q = ggml_mul_mat(ctx, ggml_new_tensor_2d(ctx, GGML_TYPE_F16, C, C), x);
    ggml_set_name(q, name);
    ggml_tensor * wk = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, context->ne[0], C);
    ggml_tensor * wv = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, context->ne[0], C);
    ggml_tensor * k = ggml_mul_mat(ctx, wk, context);
    ggml_tensor * v = ggml_mul_mat(ctx, wv, context);
    const int64_t Lk = k->ne[1];
    ggml_tensor * extra = twice ? ggml_sum(ctx, q) : nullptr;
    q = ggml_reshape_4d(ctx, q, d, H, L, 1);
    q = ggml_cont(ctx, ggml_permute(ctx, q, 0, 2, 1, 3));
    q = ggml_reshape_3d(ctx, q, d, L, H);
    k = ggml_reshape_4d(ctx, k, d, H, Lk, 1);
    k = ggml_cont(ctx, ggml_permute(ctx, k, 0, 2, 1, 3));
    k = ggml_reshape_3d(ctx, k, d, Lk, H);
    v = ggml_reshape_4d(ctx, v, d, H, Lk, 1);
    k = ggml_cast(ctx, k, GGML_TYPE_F16);
    v = ggml_cont(ctx, ggml_permute(ctx, v, 0, 2, 1, 3));
    v = ggml_reshape_3d(ctx, v, d, Lk, H);
    v = ggml_cast(ctx, v, GGML_TYPE_F16);
    ggml_tensor * m = mask ? ggml_new_tensor_2d(ctx, GGML_TYPE_F16, Lk, L) : nullptr;
    ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, m, 1.0f / std::sqrt((float) d), 0, 0);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    out = ggml_view_3d(ctx, out, d, H, L, out->nb[1], out->nb[2], 0);
    out = ggml_reshape_3d(ctx, out, C, L, 1);
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
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, h);
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
        printf("%s %s after %d nodes: heads %ld d %ld len %ld scale %.4f shared x %d\n", t->name,
               ggml_op_name(ggml_graph_node(gf, p.fa)->op), p.fa - i, (long) p.heads, (long) p.d,
               (long) p.len, p.scale, p.x == t->src[1]);
    }
    ggml_free(ctx);
    return 0;
}
"""


def test_the_attention_walk_takes_the_unets_self_attention_and_nothing_else(tmp_path) -> None:
    """Self-attention is taken from to_q's product to the attention (18 nodes in between, the
    input shared by to_q, to_k and to_v); cross-attention (K and V from the context), a to_q
    product read again and a masked attention are left to ggml."""
    lines = run_graph_harness(tmp_path, ATTN_HARNESS)
    got = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in lines}
    assert got == {
        "self": "FLASH_ATTN_EXT after 17 nodes: heads 5 d 64 len 512 scale 0.1250 shared x 1",
        "cross": "-",
        "q_read_twice": "-",
        "masked": "-",
    }, lines
