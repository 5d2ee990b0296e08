// sdfarm: a group norm for ggml's CUDA backend that spreads each group over many blocks, and
// takes the affine (x * weight + bias) that follows it in the same pass (applied by
// sdfarm.native.sourcepatch).
//
// ggml's group_norm_f32 gives each group one block: an SD VAE decode has 32 groups, so 32 of an
// H200's 132 SMs read a 1024x1024x128 tensor (512 MB) five times (sum; centre and square;
// scale), and two more kernels then multiply by the weight and add the bias (two more reads
// and writes). Profiled on an H200 (bench/ncu_profile.py) the group norms were 30.7 ms and the
// broadcasts 20.2 ms of a 1024x1024 image's 341.5 ms of kernels.
//
// Here a group is cut into chunks, one block each: a first kernel sums x and x*x of each chunk
// in double (one read), a second combines the chunks' sums of its group, in chunk order, into
// the mean and the variance (double, so E[x^2] - mean^2 loses nothing a float two-pass would
// keep) and writes (x - mean) * scale, times the weight and plus the bias of x's channel when
// the graph has them (one read, one write). The sums are taken in another order than ggml's,
// so a value may differ from ggml's in its last bits; the multiply and the add round as
// ggml's separate kernels do (no fused multiply-add). On the H200 (bench/build_options.py) a
// 1024x1024 image took 208-238 ms instead of 253-264, and a third of its 8-bit values moved,
// by at most 4 of 255 (PSNR 52 dB); tests/unit/test_group_norm_patch.py checks the indexing
// and the fusion's graph walk on the host.
//
// The per-thread work is __host__ __device__ so that the test runs the same code on the host,
// one thread per block.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#ifndef __CUDACC__
#define __host__
#define __device__
#define __forceinline__ inline
#endif

#define SDFARM_GN_THREADS 256
#define SDFARM_GN_MIN_CHUNK 16384  // elements: below this a chunk is not worth a block
#define SDFARM_GN_MAX_BLOCKS 2048  // chunks x groups

struct sdfarm_gn_part {
    double s;
    double ss;
};

// Chunks per group: enough blocks to fill the GPU, none smaller than SDFARM_GN_MIN_CHUNK.
static inline int sdfarm_gn_chunks(int64_t group_size, int64_t groups) {
    int64_t by_size = (group_size + SDFARM_GN_MIN_CHUNK - 1) / SDFARM_GN_MIN_CHUNK;
    int64_t by_grid = SDFARM_GN_MAX_BLOCKS / (groups > 0 ? groups : 1);
    int64_t c = by_size < by_grid ? by_size : by_grid;
    return c < 1 ? 1 : (int) c;
}

// Elements of one chunk (a multiple of 32, so a chunk starts on a warp's worth of floats).
static __host__ __device__ __forceinline__ int64_t sdfarm_gn_chunk_len(int64_t group_size, int chunks) {
    const int64_t len = (group_size + chunks - 1) / chunks;
    return (len + 31) / 32 * 32;
}

// The range [a, b) of chunk c of group g (b <= a when the chunk is past the group's end).
static __host__ __device__ __forceinline__ void sdfarm_gn_range(
        int64_t g, int c, int64_t group_size, int64_t ne, int chunks, int64_t * a, int64_t * b) {
    const int64_t start = g * group_size;
    const int64_t end0  = start + group_size;
    const int64_t end   = end0 < ne ? end0 : ne;
    const int64_t len   = sdfarm_gn_chunk_len(group_size, chunks);
    *a = start + c * len;
    *b = *a + len < end ? *a + len : end;
}

// One thread's sums over [a, b), thread tid of nt.
static __host__ __device__ __forceinline__ sdfarm_gn_part sdfarm_gn_thread_sums(
        const float * x, int64_t a, int64_t b, int tid, int nt) {
    sdfarm_gn_part p = {0.0, 0.0};
    for (int64_t j = a + tid; j < b; j += nt) {
        const double v = x[j];
        p.s  += v;
        p.ss += v * v;
    }
    return p;
}

// Mean and 1/sqrt(var + eps) of group g from its chunks' sums, in chunk order. ggml divides
// by group_size (not by the elements a short last group holds); so does this.
static __host__ __device__ __forceinline__ void sdfarm_gn_stats(
        const sdfarm_gn_part * part, int64_t g, int chunks, int64_t group_size, float eps,
        float * mean, float * scale) {
    double s = 0.0, ss = 0.0;
    for (int c = 0; c < chunks; c++) {
        s  += part[g * chunks + c].s;
        ss += part[g * chunks + c].ss;
    }
    const double m = s / (double) group_size;
    double var = ss / (double) group_size - m * m;
    var = var > 0.0 ? var : 0.0;
    *mean = (float) m;
#ifdef __CUDA_ARCH__
    *scale = rsqrtf((float) var + eps);
#else
    *scale = 1.0f / std::sqrt((float) var + eps);
#endif
}

// One thread's writes over [a, b): (x - mean) * scale, then * w[ch] and + bias[ch] where given
// (each rounded on its own, as ggml's group_norm, mul and add kernels round), then silu'd
// when `silu` (as ggml's silu kernel computes it). The channel of
// element j of group g is (g % groups_per_image) * ch_per_group + (j - start) / plane, divided
// once and then carried along the thread's stride (a division per element cost more than the
// memory traffic).
static __host__ __device__ __forceinline__ void sdfarm_gn_thread_apply(
        const float * x, float * dst, const float * w, const float * bias, int64_t a, int64_t b,
        int64_t g, int64_t group_size, int64_t plane, int64_t ch_per_group,
        int64_t groups_per_image, float mean, float scale, bool silu, int tid, int nt) {
    const int64_t start = g * group_size;
    int64_t ch = (g % groups_per_image) * ch_per_group + (a + tid - start) / plane;
    int64_t rem = (a + tid - start) % plane;
    for (int64_t j = a + tid; j < b; j += nt) {
#ifdef __CUDA_ARCH__
        float v = __fmul_rn(x[j] - mean, scale);
        if (w != nullptr) {
            v = __fadd_rn(__fmul_rn(v, w[ch]), bias[ch]);
        }
        if (silu) {
            v = v / (1.0f + expf(-v));  // ggml_cuda_op_silu_single, compiled as unary.cu is
        }
#else
        volatile float v = (x[j] - mean) * scale;
        if (w != nullptr) {
            volatile float t = v * w[ch];
            v = t + bias[ch];
        }
        if (silu) {
            v = v / (1.0f + std::exp(-v));
        }
#endif
        dst[j] = v;
        for (rem += nt; rem >= plane; rem -= plane) {
            ch++;
        }
    }
}

// The graph walk of the fusion, outside CUDA too (the test builds a graph with the pinned ggml
// on the host and asks it): needs ggml-impl.h, which norm.cu has through common.cuh.
#if defined(SDFARM_GN_HOST_GRAPH) && !defined(SDFARM_HOST_GRAPH)
#define SDFARM_HOST_GRAPH 1
#endif
#include "sdfarm_graph.cuh"

#if defined(__CUDACC__) || defined(SDFARM_HOST_GRAPH)
// ggml_ext_group_norm's nodes from the group norm at i: idx = {the group norm, the mul by the
// weight, the add of the bias[, a silu]}; returns how many (3 or 4), or 0 where they do not
// fuse. Between them the graph holds the reshapes of the weight and the bias ([C] -> [1, 1,
// C, 1]; a mul's second source is visited after its first), which compute nothing and are
// stepped over. The group norm and the mul must have no other use (ggml_can_fuse_ext's rule,
// which refuses the in-place mul outright: sdfarm_one_use). A silu right after the add
// (stable-diffusion.cpp's resnet blocks: norm, then silu in place) joins when the add has no
// other use and `with_silu`.
static int sdfarm_gn_fusion_nodes(const ggml_cgraph * cgraph, int i, int idx[4], bool with_silu = true) {
    idx[0] = i;
    int j = i + 1;
    for (int k = 1; k < 3; k++) {
        j = sdfarm_next_computing(cgraph, j);
        if (j >= cgraph->n_nodes) {
            return 0;
        }
        idx[k] = j++;
    }
    const ggml_tensor * gn  = cgraph->nodes[idx[0]];
    const ggml_tensor * mul = cgraph->nodes[idx[1]];
    const ggml_tensor * add = cgraph->nodes[idx[2]];
    for (const ggml_tensor * t : {gn, mul, add}) {
        if ((t->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
            return 0;
        }
    }
    const bool fuse = gn->op == GGML_OP_GROUP_NORM && mul->op == GGML_OP_MUL && add->op == GGML_OP_ADD &&
                      mul->src[0] == gn && add->src[0] == mul &&
                      ggml_are_same_shape(mul, gn) && ggml_are_same_shape(add, mul) &&
                      sdfarm_one_use(cgraph, idx[0], nullptr) && sdfarm_one_use(cgraph, idx[1], gn);
    if (!fuse) {
        return 0;
    }
    j = sdfarm_next_computing(cgraph, j);
    if (!with_silu || j >= cgraph->n_nodes) {
        return 3;
    }
    const ggml_tensor * act = cgraph->nodes[j];
    const bool silu = act->op == GGML_OP_UNARY && ggml_get_unary_op(act) == GGML_UNARY_OP_SILU &&
                      act->src[0] == add && ggml_are_same_shape(act, add) &&
                      (act->flags & GGML_TENSOR_FLAG_COMPUTE) != 0 && sdfarm_one_use(cgraph, idx[2], gn);
    if (!silu) {
        return 3;
    }
    idx[3] = j;
    return 4;
}
#endif

#ifdef __CUDACC__
static __device__ __forceinline__ double sdfarm_gn_warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffff, v, o, 32);
    }
    return v;
}

static __global__ void sdfarm_gn_sums_kernel(
        const float * x, sdfarm_gn_part * part, int64_t group_size, int64_t ne, int chunks) {
    int64_t a, b;
    sdfarm_gn_range(blockIdx.y, blockIdx.x, group_size, ne, chunks, &a, &b);
    sdfarm_gn_part p = sdfarm_gn_thread_sums(x, a, b, threadIdx.x, blockDim.x);
    __shared__ double s_s[SDFARM_GN_THREADS / 32], s_ss[SDFARM_GN_THREADS / 32];
    p.s  = sdfarm_gn_warp_sum(p.s);
    p.ss = sdfarm_gn_warp_sum(p.ss);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        s_s[warp]  = p.s;
        s_ss[warp] = p.ss;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        sdfarm_gn_part t = {0.0, 0.0};
        for (int k = 0; k < (int) (blockDim.x / 32); k++) {
            t.s  += s_s[k];
            t.ss += s_ss[k];
        }
        part[(int64_t) blockIdx.y * chunks + blockIdx.x] = t;
    }
}

static __global__ void sdfarm_gn_apply_kernel(
        const float * x, float * dst, const float * w, const float * bias,
        const sdfarm_gn_part * part, int64_t group_size, int64_t ne, int chunks, int64_t plane,
        int64_t ch_per_group, int64_t groups_per_image, float eps, bool silu) {
    __shared__ float s_mean, s_scale;
    const int64_t g = blockIdx.y;
    if (threadIdx.x == 0) {
        sdfarm_gn_stats(part, g, chunks, group_size, eps, &s_mean, &s_scale);
    }
    __syncthreads();
    int64_t a, b;
    sdfarm_gn_range(g, blockIdx.x, group_size, ne, chunks, &a, &b);
    sdfarm_gn_thread_apply(x, dst, w, bias, a, b, g, group_size, plane, ch_per_group,
                           groups_per_image, s_mean, s_scale, silu, threadIdx.x, blockDim.x);
}

static bool sdfarm_gn_env_off(const char * name) {
    const char * v = getenv(name);
    return v != nullptr && v[0] == '0';
}

static bool sdfarm_gn_disabled() {
    static const bool disabled = sdfarm_gn_env_off("SDFARM_GROUPNORM_SPLIT");
    return disabled;
}

// SDFARM_GN_SILU=0 leaves the silu after a group norm to ggml's kernel (for measurement).
static bool sdfarm_gn_silu_fused() {
    static const bool fused = !sdfarm_gn_env_off("SDFARM_GN_SILU");
    return fused;
}

// The group norm of `gn` (a GGML_OP_GROUP_NORM node), written to `out`, times `w` plus `bias`
// when both are given ([1, 1, C, 1] each, C = gn's ne[2]), through silu when `silu`. Returns false, having launched
// nothing, where it does not apply (then ggml's kernels run): SDFARM_GROUPNORM_SPLIT=0, a
// source that is not contiguous f32, channels not a multiple of the groups, more groups than
// a grid's y dimension holds.
static bool sdfarm_group_norm_launch(
        ggml_backend_cuda_context & ctx, const ggml_tensor * gn, ggml_tensor * out,
        const ggml_tensor * w, const ggml_tensor * bias, bool silu = false) {
    const ggml_tensor * src = gn->src[0];
    if (sdfarm_gn_disabled() || src->type != GGML_TYPE_F32 || out->type != GGML_TYPE_F32 ||
            !ggml_is_contiguous(src) || !ggml_is_contiguous(out) ||
            ggml_nelements(src) != ggml_nelements(out)) {
        return false;
    }
    const int groups = gn->op_params[0];
    float eps;
    memcpy(&eps, gn->op_params + 1, sizeof(float));
    if (groups < 1 || src->ne[2] % groups != 0 || (int64_t) groups * src->ne[3] > 65535 || eps < 0.0f) {
        return false;
    }
    if (w != nullptr) {
        for (const ggml_tensor * t : {w, bias}) {
            if (t == nullptr || t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t) ||
                    t->ne[0] != 1 || t->ne[1] != 1 || t->ne[2] != src->ne[2] || t->ne[3] != 1) {
                return false;
            }
        }
    }
    const int64_t plane = src->ne[0] * src->ne[1];
    const int64_t ch_per_group = src->ne[2] / groups;
    const int64_t group_size = plane * ch_per_group;
    const int64_t n_groups = (int64_t) groups * src->ne[3];
    const int64_t ne = ggml_nelements(src);
    const int chunks = sdfarm_gn_chunks(group_size, n_groups);
    cudaStream_t stream = ctx.stream();
    ggml_cuda_pool_alloc<sdfarm_gn_part> part(ctx.pool(), n_groups * chunks);
    const dim3 grid(chunks, n_groups, 1);
    sdfarm_gn_sums_kernel<<<grid, SDFARM_GN_THREADS, 0, stream>>>(
        (const float *) src->data, part.get(), group_size, ne, chunks);
    sdfarm_gn_apply_kernel<<<grid, SDFARM_GN_THREADS, 0, stream>>>(
        (const float *) src->data, (float *) out->data,
        w ? (const float *) w->data : nullptr, w ? (const float *) bias->data : nullptr,
        part.get(), group_size, ne, chunks, plane, ch_per_group, groups, eps, silu);
    CUDA_CHECK(cudaGetLastError());
    return true;
}

// The fused form of ggml_ext_group_norm's three nodes and the silu after them (see
// sdfarm_gn_fusion_nodes), tried by the graph loop of ggml-cuda.cu at the group norm node i.
// Returns the index of the last node, whose tensor it wrote, or -1 (nothing launched; the
// loop goes on at i).
int sdfarm_group_norm_fuse(ggml_backend_cuda_context & ctx, ggml_cgraph * cgraph, int i) {
    int idx[4];
    const int n = sdfarm_gn_fusion_nodes(cgraph, i, idx, sdfarm_gn_silu_fused());
    if (n == 0) {
        return -1;
    }
    ggml_tensor * mul  = cgraph->nodes[idx[1]];
    ggml_tensor * add  = cgraph->nodes[idx[2]];
    ggml_tensor * last = cgraph->nodes[idx[n - 1]];
    if (!sdfarm_group_norm_launch(ctx, cgraph->nodes[idx[0]], last, mul->src[1], add->src[1], n == 4)) {
        return -1;
    }
    return idx[n - 1];
}
#endif
