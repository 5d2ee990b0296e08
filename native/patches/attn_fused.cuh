// sdfarm: the UNet's self-attention from its input to the attention's output in one step on
// ggml's CUDA backend, with cuDNN's SDPA (applied by sdfarm.native.sourcepatch into
// ggml-cuda.cu, after linear_fused.cuh, whose cuBLAS helpers it uses).
//
// stable-diffusion.cpp's CrossAttention with flash attention (common_block.hpp,
// ggml_ext_attention_ext) multiplies the normed input by to_q, to_k and to_v (three f16 GEMMs,
// each converting the same input to f16 and its f16 product back to f32), copies each result
// into [D, L, H] order (three CONTs), casts K and V to f16 (two CPYs), and the attention (through
// cuDNN: fattn_cudnn.cuh) converts Q to f16 again. At 1024x1024 each of these passes is over
// 16384 x 320 values, twice per transformer block.
//
// Here the input is converted once, the three GEMMs (ggml's cuBLAS call) write their f16
// products, and cuDNN's SDPA reads them where they are: a row of H * D values per position is
// the layout cuDNN calls BSHD. The values reaching the attention are those of ggml's path (an
// f16 product converted to f32 and back is the same f16), so the attention gets the same
// inputs; only the FLASH_ATTN_EXT node's f32 output is written.
//
// A batch of N images ([C, L, N] input) goes through in one step too: the GEMMs are those ggml
// makes for its nodes (linear_fused.cuh: one of L columns per image), so Q, K and V are each
// N blocks of L rows of H * D values, which cuDNN reads as B = N; stable-diffusion.cpp folds the
// images into the heads ([D, L, H * N], head h of image n its head h + H * n), so a row of the
// attention's output holds every image's heads, and cuDNN writes it there
// (fattn_cudnn.cuh: sdfarm_sdpa_rows_dims).
//
// Only where the attention goes to cuDNN (SDFARM_CUDNN names it; a build with its headers),
// unless SDFARM_ATTN_FUSED=0 is in a process's environment (then the chain is left to ggml and
// fattn_cudnn.cuh). On the H200 it gives the same image at 512 and 1024 x 4 steps, and the farm
// of eight engines 5-10% more images per second (docs/gpu.md).
// tests/unit/test_unet_fusions_patch.py asks the walk about the graph the pinned ggml builds.
#pragma once

#include <cstdint>
#include <cstring>

#include "sdfarm_graph.cuh"

struct sdfarm_attn_plan {
    int fa = -1;  // the FLASH_ATTN_EXT node, the last one computed
    const ggml_tensor * x = nullptr;
    const ggml_tensor * w[3] = {nullptr, nullptr, nullptr};  // to_q, to_k, to_v
    int64_t d = 0, heads = 0, len = 0;  // heads: of one image
    int64_t images = 1;                 // x's ne[2]: the batch
    bool images_in_heads = false;       // Q is [D, L, heads * images], images > 1 (else [D, L, heads, images])
    float scale = 0.0f;
};

#if defined(__CUDACC__) || defined(SDFARM_HOST_GRAPH)
#define SDFARM_ATTN_SPAN 32  // nodes from to_q's product to the attention: 18 in the pinned graph

// The node index of t in [from, to], or -1.
static int sdfarm_attn_index(const ggml_cgraph * cgraph, const ggml_tensor * t, int from, int to) {
    for (int k = from; k <= to && k < cgraph->n_nodes; k++) {
        if (cgraph->nodes[k] == t) {
            return k;
        }
    }
    return -1;
}

// Whether t is a node in [from, to] that exactly one other node reads and nobody takes as
// output (ggml_cast's CPY names itself as its second source, which the graph counts as a use).
static bool sdfarm_attn_once(const ggml_cgraph * cgraph, const ggml_tensor * t, int from, int to) {
    const int k = sdfarm_attn_index(cgraph, t, from, to);
    const int self = t->src[1] == t ? 1 : 0;
    return k >= 0 && ggml_node_get_use_count(cgraph, k) == 1 + self && (t->flags & GGML_TENSOR_FLAG_OUTPUT) == 0;
}

// ggml_ext_attention_ext's operand chain: RESHAPE(CONT(PERMUTE(RESHAPE(mm), 0, 2, 1, 3))), with
// a CPY to f16 on top for K and V. Returns the MUL_MAT and marks the chain's nodes in mine
// (mine[k - from] for node k), or nullptr. *split: the first RESHAPE, of the product's
// [H * D, L, N] to [D, H, L, N].
static const ggml_tensor * sdfarm_attn_operand(const ggml_cgraph * cgraph, const ggml_tensor * t, bool cast,
                                               int from, int to, bool * mine, const ggml_tensor ** split) {
    if (cast) {
        if (t->op != GGML_OP_CPY || t->type != GGML_TYPE_F16 || t->src[0] == nullptr ||
            t->src[0]->type != GGML_TYPE_F32 || !sdfarm_attn_once(cgraph, t, from, to)) {
            return nullptr;
        }
        mine[sdfarm_attn_index(cgraph, t, from, to) - from] = true;
        t = t->src[0];
    }
    const ggml_op ops[4] = {GGML_OP_RESHAPE, GGML_OP_CONT, GGML_OP_PERMUTE, GGML_OP_RESHAPE};
    for (ggml_op op : ops) {
        if (t->op != op || !sdfarm_attn_once(cgraph, t, from, to)) {
            return nullptr;
        }
        if (op == GGML_OP_PERMUTE) {
            int32_t axes[4];
            memcpy(axes, t->op_params, sizeof(axes));
            if (axes[0] != 0 || axes[1] != 2 || axes[2] != 1 || axes[3] != 3) {
                return nullptr;
            }
        }
        mine[sdfarm_attn_index(cgraph, t, from, to) - from] = true;
        *split = t;
        t = t->src[0];
    }
    if (t->op != GGML_OP_MUL_MAT || !sdfarm_attn_once(cgraph, t, from, to)) {
        return nullptr;
    }
    mine[sdfarm_attn_index(cgraph, t, from, to) - from] = true;
    return t;
}

// What to fuse at node i: to_q's product, the chain of ggml_ext_attention_ext to an unmasked
// FLASH_ATTN_EXT whose K and V are to_k's and to_v's products of the same input (self-attention),
// f16 weights of [C, C] and C = heads x D; every node from i to the attention is part of that
// chain or computes nothing. The input is one image's [C, L] or a batch's [C, L, N]
// (contiguous); each product is split into [D, heads, L, N] and the attention's Q is
// [D, L, heads * N] (as stable-diffusion.cpp builds it) or [D, L, heads, N].
static sdfarm_attn_plan sdfarm_attn_plan_at(const ggml_cgraph * cgraph, int i) {
    sdfarm_attn_plan plan;
    const ggml_tensor * mq = cgraph->nodes[i];
    if (mq->op != GGML_OP_MUL_MAT) {
        return plan;
    }
    int fa = -1;
    for (int k = i + 1; k < cgraph->n_nodes && k <= i + SDFARM_ATTN_SPAN; k++) {
        if (cgraph->nodes[k]->op == GGML_OP_FLASH_ATTN_EXT) {
            fa = k;
            break;
        }
    }
    if (fa < 0) {
        return plan;
    }
    const ggml_tensor * att = cgraph->nodes[fa];
    if (att->src[3] != nullptr || att->src[4] != nullptr || att->type != GGML_TYPE_F32 || !ggml_is_contiguous(att) ||
        (att->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
        return plan;
    }
    float params[3];
    memcpy(params, att->op_params, sizeof(params));  // scale, max_bias, logit_softcap
    if (params[1] != 0.0f || params[2] != 0.0f) {
        return plan;
    }
    bool mine[SDFARM_ATTN_SPAN] = {};  // mine[k - i]: node k is part of the chain
    const ggml_tensor * mm[3];
    const ggml_tensor * split[3];
    for (int o = 0; o < 3; o++) {
        mm[o] = sdfarm_attn_operand(cgraph, att->src[o], o > 0, i, fa - 1, mine, &split[o]);
        if (mm[o] == nullptr) {
            return plan;
        }
    }
    const ggml_tensor * x = mq->src[1];
    if (mm[0] != mq || mm[1]->src[1] != x || mm[2]->src[1] != x || x->type != GGML_TYPE_F32 ||
        !ggml_is_contiguous(x) || x->ne[3] != 1) {
        return plan;
    }
    const ggml_tensor * Q = att->src[0];
    const int64_t d = Q->ne[0], len = Q->ne[1], images = x->ne[2];
    if (d < 1 || mq->ne[0] % d != 0) {
        return plan;
    }
    const int64_t heads = mq->ne[0] / d;
    // Q's heads: stable-diffusion.cpp's [D, L, heads * N], or [D, L, heads, N] (the same at N = 1)
    const bool images_in_heads = Q->ne[2] == heads * images && Q->ne[3] == 1;
    if (!images_in_heads && (Q->ne[2] != heads || Q->ne[3] != images)) {
        return plan;
    }
    for (int o = 0; o < 3; o++) {
        const ggml_tensor * w = mm[o]->src[0];
        const ggml_tensor * sp = split[o];
        if (w->type != GGML_TYPE_F16 || !ggml_is_contiguous(w) || w->ne[0] != x->ne[0] || w->ne[1] != d * heads ||
            w->ne[2] != 1 || w->ne[3] != 1 || mm[o]->op_params[0] != GGML_PREC_DEFAULT ||
            !ggml_are_same_shape(att->src[o], Q) || sp->ne[0] != d || sp->ne[1] != heads || sp->ne[2] != len ||
            sp->ne[3] != images) {
            return plan;
        }
        plan.w[o] = w;
    }
    if (x->ne[1] != len || att->ne[0] != d || att->ne[1] != Q->ne[2] || att->ne[2] != len ||
        att->ne[3] != Q->ne[3]) {
        return plan;
    }
    for (int k = i; k < fa; k++) {
        const ggml_tensor * t = cgraph->nodes[k];
        if (sdfarm_computes_nothing(t)) {
            continue;
        }
        if (!mine[k - i] || (t->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
            return plan;  // another computation sits inside the chain
        }
    }
    plan.fa = fa;
    plan.x = x;
    plan.d = d;
    plan.heads = heads;
    plan.len = len;
    plan.images = images;
    plan.images_in_heads = images_in_heads && images > 1;
    plan.scale = params[0];
    return plan;
}
#endif

#ifdef __CUDACC__
// fattn_cudnn.cuh (fattn.cu): the plan for this shape exists; run it into ggml's f32 output.
bool sdfarm_cudnn_sdpa_rows_ready(int device, int64_t B, int64_t H, int64_t L, int64_t D, bool images_in_heads,
                                  float scale);
bool sdfarm_cudnn_sdpa_rows(ggml_backend_cuda_context & ctx, const half * q, const half * k, const half * v,
                            int64_t B, int64_t H, int64_t L, int64_t D, bool images_in_heads, float scale,
                            float * dst);

// The self-attention whose to_q product is node i (sdfarm_attn_plan_at), tried by the graph
// loop of ggml-cuda.cu. Returns the attention's index, whose tensor it wrote, or -1 (nothing
// written to the graph; ggml computes node i on).
int sdfarm_attn_fuse(ggml_backend_cuda_context & ctx, ggml_cgraph * cgraph, int i) {
    // On unless SDFARM_ATTN_FUSED=0; bash bench/gpu_run.sh attnfuse measures it against that.
    static const bool off = sdfarm_env_first("SDFARM_ATTN_FUSED") == '0';
    if (off) {
        return -1;
    }
    const sdfarm_attn_plan plan = sdfarm_attn_plan_at(cgraph, i);
    if (plan.fa < 0 || !sdfarm_cublas_f16_path(ctx, plan.w[0], plan.len) ||
        !sdfarm_cudnn_sdpa_rows_ready(ctx.device, plan.images, plan.heads, plan.len, plan.d, plan.images_in_heads,
                                      plan.scale)) {
        return -1;
    }
    cudaStream_t stream = ctx.stream();
    const int64_t c = plan.w[0]->ne[0];
    const int64_t n = plan.len * plan.images;  // the input's rows
    const int64_t values = n * plan.heads * plan.d;
    ggml_cuda_pool_alloc<half> x16(ctx.pool(), c * n);
    ggml_get_to_fp16_cuda(GGML_TYPE_F32)(plan.x->data, x16.get(), c * n, stream);
    ggml_cuda_pool_alloc<half> q16(ctx.pool(), values);
    ggml_cuda_pool_alloc<half> k16(ctx.pool(), values);
    ggml_cuda_pool_alloc<half> v16(ctx.pool(), values);
    half * out[3] = {q16.get(), k16.get(), v16.get()};
    for (int o = 0; o < 3; o++) {
        // the product ggml's to_q, to_k and to_v nodes make (one GEMM of L columns per image)
        sdfarm_cublas_f16_gemm_images(ctx, plan.w[o], x16.get(), out[o], plan.len, plan.images, stream);
    }
    ggml_tensor * att = cgraph->nodes[plan.fa];
    if (!sdfarm_cudnn_sdpa_rows(ctx, q16.get(), k16.get(), v16.get(), plan.images, plan.heads, plan.len, plan.d,
                                plan.images_in_heads, plan.scale, (float *) att->data)) {
        return -1;  // nothing of the graph written: ggml runs the chain
    }
    return plan.fa;
}
#endif
