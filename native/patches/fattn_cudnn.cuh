// sdfarm: ggml's CUDA flash attention (GGML_OP_FLASH_ATTN_EXT) through cuDNN's fused
// scaled-dot-product attention, loaded at run time (applied by sdfarm.native.sourcepatch).
// Compiled in only where the build found cuDNN's and its frontend's headers
// (SDFARM_CUDNN_SDPA: sdfarm.native.build.cudnn_sdpa_flags), and off unless SDFARM_CUDNN
// names a libcudnn.so.9, like the convolutions of conv2d_cudnn.cuh; SDFARM_CUDNN_SDPA=0 in a
// process's environment keeps ggml's kernel with cuDNN's convolutions.
//
// Why: the SD UNet's self-attention at its first level is 16,384 queries against 16,384 keys
// of head size 64 at 1024x1024. ggml's MMA kernel (tuned for language models: 16 query rows
// a warp, 2 blocks of 4 warps an SM) ran it at 129 TFLOP/s on an H200, 2.66 ms a call, where
// PyTorch's SDPA took 0.78 ms (441 TFLOP/s; bench/fattn_bench.cpp against bench/fattn_torch.py,
// docs/gpu.md): 16.7 against 5.9 ms of attention per UNet call at 1024. cuDNN's flash
// attention is one of the kernels PyTorch's SDPA dispatches to on Hopper. With it, one engine's
// 1024x1024 image at 4 steps took 329-355 ms against 373-423 with ggml's kernel on the H200,
// pixels within 1/255 (PSNR 57.8 dB; bench/results/gpu/cuda-sdpa4-options.json).
//
// What runs: Q (f32 in stable-diffusion.cpp's graph) converted to f16, cuDNN's SDPA with f16
// K and V as ggml lays them out (f32 softmax and accumulation), its f16 output written in
// ggml's [D, heads, queries] order, then converted to the f32 ggml's node writes. Masked,
// biased, soft-capped or sink attention, other types and head sizes above 128 stay with ggml
// (stable-diffusion.cpp's cross-attention pads 77 keys to 256 under a mask: a small share).
// The output is rounded to f16 once, so pixels move by a rounding, as with the convolutions.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(SDFARM_HOST_GRAPH)
// What decides whether an attention goes to cuDNN, kept outside the CUDA-only part so that
// tests can ask it on the host, of nodes the pinned ggml builds.
struct sdfarm_sdpa_shape {
    int64_t d, q_len, kv_len, heads, kv_heads, batch;
    ggml_type q_type, k_type, v_type, dst_type;
    bool has_mask, has_sinks, q_contiguous, dst_contiguous, kv_matches;
    float scale, max_bias, logit_softcap;
};

static sdfarm_sdpa_shape sdfarm_sdpa_shape_of(const ggml_tensor * dst) {
    const ggml_tensor * Q = dst->src[0];
    const ggml_tensor * K = dst->src[1];
    const ggml_tensor * V = dst->src[2];
    float params[3];
    memcpy(params, dst->op_params, sizeof(params));  // scale, max_bias, logit_softcap
    // K and V: rows of D contiguous values, one length and head count, Q's batch
    const bool kv = K->nb[0] == ggml_type_size(K->type) && V->nb[0] == ggml_type_size(V->type) &&
                    K->ne[0] == Q->ne[0] && V->ne[0] == Q->ne[0] && V->ne[1] == K->ne[1] && V->ne[2] == K->ne[2] &&
                    K->ne[3] == Q->ne[3] && V->ne[3] == Q->ne[3];
    return {Q->ne[0], Q->ne[1], K->ne[1], Q->ne[2], K->ne[2], Q->ne[3],
            Q->type, K->type, V->type, dst->type,
            dst->src[3] != nullptr, dst->src[4] != nullptr, ggml_is_contiguous(Q), ggml_is_contiguous(dst), kv,
            params[0], params[1], params[2]};
}

// cuDNN takes it: unmasked, unbiased, no soft cap or sinks; f16 K and V (stable-diffusion.cpp
// casts them), f32 or f16 Q, f32 out; head size a multiple of 8 up to 128; as many K heads as
// Q heads.
static bool sdfarm_sdpa_eligible(const sdfarm_sdpa_shape & s) {
    return !s.has_mask && !s.has_sinks && s.max_bias == 0.0f && s.logit_softcap == 0.0f &&
           (s.q_type == GGML_TYPE_F32 || s.q_type == GGML_TYPE_F16) && s.k_type == GGML_TYPE_F16 &&
           s.v_type == GGML_TYPE_F16 && s.dst_type == GGML_TYPE_F32 && s.q_contiguous && s.dst_contiguous &&
           s.kv_matches && s.d % 8 == 0 && s.d >= 8 && s.d <= 128 && s.kv_heads == s.heads && s.q_len >= 1 &&
           s.kv_len >= 1 && s.batch >= 1;
}

// An attention as cuDNN's SDPA sees it: Q [B, H, Sq, D], K and V [B, H, Skv, D], O [B, H, Sq,
// D], each with its element strides of batch, head and row (D's stride is 1). The plan of a
// shape is keyed by all of it, the output's strides included (two layouts reach it: ggml's
// [D, H, Sq, B] and the batched self-attention's, below).
struct sdfarm_sdpa_dims {
    int64_t B, H, Sq, Skv, D;
    int64_t q[3], k[3], v[3], o[3];  // batch, head, row
};

// A FLASH_ATTN_EXT node that sdfarm_sdpa_eligible takes: Q as our contiguous f16 copy of it
// ([D, Sq, H, B]), K and V where ggml keeps them, O in ggml's output order [D, H, Sq, B].
static sdfarm_sdpa_dims sdfarm_sdpa_dims_of(const ggml_tensor * dst) {
    const ggml_tensor * Q = dst->src[0];
    const ggml_tensor * K = dst->src[1];
    const ggml_tensor * V = dst->src[2];
    const int64_t D = Q->ne[0], Sq = Q->ne[1], H = Q->ne[2];
    const int64_t ks = (int64_t) ggml_type_size(K->type), vs = (int64_t) ggml_type_size(V->type);
    return {Q->ne[3], H, Sq, K->ne[1], D,
            {H * Sq * D, Sq * D, D},
            {(int64_t) K->nb[3] / ks, (int64_t) K->nb[2] / ks, (int64_t) K->nb[1] / ks},
            {(int64_t) V->nb[3] / vs, (int64_t) V->nb[2] / vs, (int64_t) V->nb[1] / vs},
            {Sq * H * D, D, H * D}};
}

// The self-attention of B images whose Q, K and V are to_q's, to_k's and to_v's products
// (attn_fused.cuh): each [H * D, L * B], image b's L rows of H * D values a block. O is
// written where ggml's FLASH_ATTN_EXT node has it: with stable-diffusion.cpp's Q of
// [D, L, H * B] (`images_in_heads`: ggml_ext_attention_ext folds the images into the heads,
// head h of image b being head h + H * b) the node is [D, H * B, L], so a row of O holds every
// image's heads; with a Q of [D, L, H, B] it is [D, H, L, B]. One image: both are [D, H, L].
static sdfarm_sdpa_dims sdfarm_sdpa_rows_dims(int64_t B, int64_t H, int64_t L, int64_t D, bool images_in_heads) {
    const int64_t C = H * D;
    const int64_t ob = images_in_heads && B > 1 ? C : L * C;
    const int64_t os = images_in_heads && B > 1 ? B * C : C;
    return {B, H, L, L, D, {L * C, D, C}, {L * C, D, C}, {L * C, D, C}, {ob, D, os}};
}
#endif

#if defined(__CUDACC__) && defined(SDFARM_CUDNN_SDPA)
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

namespace cudnn_frontend {
void * cudnn_dlhandle = nullptr;  // the frontend's calls go to the library SDFARM_CUDNN names
}

namespace sdfarm_fe = cudnn_frontend;

// The library SDFARM_CUDNN names, opened once for the frontend; false when off or absent.
static bool sdfarm_sdpa_on() {
    static const bool on = [] {
        const char * lib = getenv("SDFARM_CUDNN");
        const char * sw  = getenv("SDFARM_CUDNN_SDPA");
        if (lib == nullptr || lib[0] == '\0' || strcmp(lib, "0") == 0 || (sw != nullptr && sw[0] == '0')) {
            return false;
        }
        void * h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
        if (h == nullptr) {
            GGML_LOG_WARN("sdfarm: cuDNN (%s) did not load for attention (%s): ggml's kernel runs\n", lib, dlerror());
            return false;
        }
        sdfarm_fe::cudnn_dlhandle = h;
        GGML_LOG_INFO("sdfarm: attention through cuDNN (%s)\n", lib);
        return true;
    }();
    return on;
}

static void sdfarm_sdpa_fail(const std::string & what) {
    static bool said = false;
    if (!said) {
        said = true;
        GGML_LOG_WARN("sdfarm: cuDNN refused an attention (%s): ggml's kernel runs it\n", what.c_str());
    }
}

enum : int64_t { SDFARM_SDPA_Q = 1, SDFARM_SDPA_K, SDFARM_SDPA_V, SDFARM_SDPA_O };

struct sdfarm_sdpa_plan {
    std::shared_ptr<sdfarm_fe::graph::Graph> graph;  // nullptr: cuDNN refused this shape
    int64_t workspace = 0;
};

// (device, B, H, Sq, Skv, D, Q's, K's, V's and O's element strides of batch, head and row, the
// scale's bits)
typedef std::tuple<int, std::array<int64_t, 17>, uint32_t> sdfarm_sdpa_key;

static sdfarm_sdpa_key sdfarm_sdpa_key_of(int device, const sdfarm_sdpa_dims & s, float scale) {
    uint32_t scale_bits;
    memcpy(&scale_bits, &scale, sizeof(scale_bits));
    return {device,
            {s.B, s.H, s.Sq, s.Skv, s.D, s.q[0], s.q[1], s.q[2], s.k[0], s.k[1], s.k[2], s.v[0], s.v[1], s.v[2],
             s.o[0], s.o[1], s.o[2]},
            scale_bits};
}

static cudnnHandle_t sdfarm_sdpa_handle(int device) {
    static std::mutex mu;
    static cudnnHandle_t handles[GGML_CUDA_MAX_DEVICES] = {};
    std::lock_guard<std::mutex> lock(mu);
    if (handles[device] == nullptr) {
        try {
            if (sdfarm_fe::detail::create_handle(&handles[device]) != CUDNN_STATUS_SUCCESS) {
                handles[device] = nullptr;
                sdfarm_sdpa_fail("cudnnCreate");
            }
        } catch (const std::exception & e) {
            handles[device] = nullptr;
            sdfarm_sdpa_fail(e.what());
        }
    }
    return handles[device];
}

// The built graph of a shape, made once per shape and device (nullptr graph if refused).
static const sdfarm_sdpa_plan & sdfarm_sdpa_plan_for(cudnnHandle_t h, int device, const sdfarm_sdpa_dims & s,
                                                     float scale) {
    static std::mutex mu;
    static std::map<sdfarm_sdpa_key, sdfarm_sdpa_plan> plans;
    const sdfarm_sdpa_key key = sdfarm_sdpa_key_of(device, s, scale);
    std::lock_guard<std::mutex> lock(mu);
    auto it = plans.find(key);
    if (it != plans.end()) {
        return it->second;
    }
    const int64_t B = s.B, H = s.H, Sq = s.Sq, Skv = s.Skv, D = s.D;
    sdfarm_sdpa_plan plan;
    try {
        auto g = std::make_shared<sdfarm_fe::graph::Graph>();
        g->set_io_data_type(sdfarm_fe::DataType_t::HALF)
            .set_intermediate_data_type(sdfarm_fe::DataType_t::FLOAT)
            .set_compute_data_type(sdfarm_fe::DataType_t::FLOAT);
        using T = sdfarm_fe::graph::Tensor_attributes;
        // Q: our contiguous f16 copy in ggml's [D, Sq, H, B] order, or the to_q GEMM's rows
        auto q = g->tensor(
            T().set_name("Q").set_uid(SDFARM_SDPA_Q).set_dim({B, H, Sq, D}).set_stride({s.q[0], s.q[1], s.q[2], 1}));
        auto k = g->tensor(
            T().set_name("K").set_uid(SDFARM_SDPA_K).set_dim({B, H, Skv, D}).set_stride({s.k[0], s.k[1], s.k[2], 1}));
        auto v = g->tensor(
            T().set_name("V").set_uid(SDFARM_SDPA_V).set_dim({B, H, Skv, D}).set_stride({s.v[0], s.v[1], s.v[2], 1}));
        auto opts = sdfarm_fe::graph::SDPA_attributes().set_name("sdfarm_sdpa").set_generate_stats(false).set_attn_scale(
            scale);
        auto [o, stats] = g->sdpa(q, k, v, opts);
        (void) stats;
        // O where ggml's FLASH_ATTN_EXT node has it (sdfarm_sdpa_dims_of, sdfarm_sdpa_rows_dims)
        o->set_output(true).set_uid(SDFARM_SDPA_O).set_dim({B, H, Sq, D}).set_stride({s.o[0], s.o[1], s.o[2], 1});
        auto st = g->build(h, {sdfarm_fe::HeurMode_t::A});
        if (!st.is_good()) {
            sdfarm_sdpa_fail(st.get_message());
        } else if (!(st = g->get_workspace_size(plan.workspace)).is_good()) {
            sdfarm_sdpa_fail(st.get_message());
        } else {
            plan.graph = g;
        }
    } catch (const std::exception & e) {
        sdfarm_sdpa_fail(e.what());
    }
    return plans.emplace(key, plan).first->second;
}

// Run a built plan on f16 q, k, v into an f16 copy of the output, converted to the f32 `out`
// (n values). False where cuDNN failed (nothing written to `out`).
static bool sdfarm_sdpa_execute(ggml_backend_cuda_context & ctx, cudnnHandle_t h, const sdfarm_sdpa_plan & plan,
                                const half * q, const half * k, const half * v, float * out, int64_t n) {
    cudaStream_t stream = ctx.stream();
    ggml_cuda_pool & pool = ctx.pool();
    ggml_cuda_pool_alloc<half> o16(pool, n);
    ggml_cuda_pool_alloc<char> ws(pool, plan.workspace > 0 ? plan.workspace : 1);
    std::unordered_map<int64_t, void *> pack = {
        {SDFARM_SDPA_Q, const_cast<half *>(q)}, {SDFARM_SDPA_K, const_cast<half *>(k)},
        {SDFARM_SDPA_V, const_cast<half *>(v)}, {SDFARM_SDPA_O, o16.get()}};
    try {
        if (sdfarm_fe::detail::set_stream(h, stream) != CUDNN_STATUS_SUCCESS) {
            sdfarm_sdpa_fail("cudnnSetStream");
            return false;
        }
        auto st = plan.graph->execute(h, pack, ws.get());
        if (!st.is_good()) {
            sdfarm_sdpa_fail(st.get_message());
            return false;
        }
    } catch (const std::exception & e) {
        sdfarm_sdpa_fail(e.what());
        return false;
    }
    ggml_get_to_fp32_cuda(GGML_TYPE_F16)(o16.get(), out, n, stream);
    return true;
}

// dst (a FLASH_ATTN_EXT node) through cuDNN. False where cuDNN is off, the node is not one it
// takes or it refused (at most Q's f16 copy was launched, into a buffer of our own); then
// ggml's kernel runs it.
static bool sdfarm_cudnn_fattn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * Q = dst->src[0];
    const ggml_tensor * K = dst->src[1];
    const ggml_tensor * V = dst->src[2];
    const sdfarm_sdpa_shape s = sdfarm_sdpa_shape_of(dst);
    if (!sdfarm_sdpa_eligible(s) || !sdfarm_sdpa_on()) {
        return false;
    }
    cudnnHandle_t h = sdfarm_sdpa_handle(ctx.device);
    if (h == nullptr) {
        return false;
    }
    const sdfarm_sdpa_plan & plan = sdfarm_sdpa_plan_for(h, ctx.device, sdfarm_sdpa_dims_of(dst), s.scale);
    if (plan.graph == nullptr) {
        return false;
    }
    cudaStream_t stream = ctx.stream();
    const int64_t n = ggml_nelements(Q);
    ggml_cuda_pool_alloc<half> q16(ctx.pool());
    const half * q = (const half *) Q->data;
    if (Q->type == GGML_TYPE_F32) {
        q16.alloc(n);
        ggml_get_to_fp16_cuda(GGML_TYPE_F32)(Q->data, q16.get(), n, stream);
        q = q16.get();
    }
    return sdfarm_sdpa_execute(ctx, h, plan, q, (const half *) K->data, (const half *) V->data, (float *) dst->data,
                               ggml_nelements(dst));
}

// Self-attention of B images whose f16 Q, K and V are the to_q, to_k and to_v GEMMs' outputs:
// L rows of H * D values per image (ggml's [D, H, L, B] before stable-diffusion.cpp's
// permutes), as attn_fused.cuh has them; O where the FLASH_ATTN_EXT node has it
// (sdfarm_sdpa_rows_dims). The plan (built once per shape) exists.
static bool sdfarm_sdpa_rows_plan(int device, int64_t B, int64_t H, int64_t L, int64_t D, bool images_in_heads,
                                  float scale, cudnnHandle_t * h, const sdfarm_sdpa_plan ** plan) {
    if (!sdfarm_sdpa_on() || D % 8 != 0 || D < 8 || D > 128 || B < 1) {
        return false;
    }
    *h = sdfarm_sdpa_handle(device);
    if (*h == nullptr) {
        return false;
    }
    *plan = &sdfarm_sdpa_plan_for(*h, device, sdfarm_sdpa_rows_dims(B, H, L, D, images_in_heads), scale);
    return (*plan)->graph != nullptr;
}

bool sdfarm_cudnn_sdpa_rows_ready(int device, int64_t B, int64_t H, int64_t L, int64_t D, bool images_in_heads,
                                  float scale) {
    cudnnHandle_t h;
    const sdfarm_sdpa_plan * plan;
    return sdfarm_sdpa_rows_plan(device, B, H, L, D, images_in_heads, scale, &h, &plan);
}

// dst: ggml's FLASH_ATTN_EXT output, f32, B * H * L * D values (sdfarm_sdpa_rows_dims' order).
bool sdfarm_cudnn_sdpa_rows(ggml_backend_cuda_context & ctx, const half * q, const half * k, const half * v,
                            int64_t B, int64_t H, int64_t L, int64_t D, bool images_in_heads, float scale,
                            float * dst) {
    cudnnHandle_t h;
    const sdfarm_sdpa_plan * plan;
    if (!sdfarm_sdpa_rows_plan(ctx.device, B, H, L, D, images_in_heads, scale, &h, &plan)) {
        return false;
    }
    return sdfarm_sdpa_execute(ctx, h, *plan, q, k, v, dst, B * H * L * D);
}
#elif defined(__CUDACC__)
static bool sdfarm_cudnn_fattn(ggml_backend_cuda_context &, ggml_tensor *) {
    return false;  // built without cuDNN's headers
}

bool sdfarm_cudnn_sdpa_rows_ready(int, int64_t, int64_t, int64_t, int64_t, bool, float) {
    return false;
}

bool sdfarm_cudnn_sdpa_rows(ggml_backend_cuda_context &, const half *, const half *, const half *, int64_t, int64_t,
                            int64_t, int64_t, bool, float, float *) {
    return false;
}
#endif
