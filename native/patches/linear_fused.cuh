// sdfarm: stable-diffusion.cpp's linear layers on ggml's CUDA backend with what follows them
// taken into the one pass that turns cuBLAS's f16 product into f32 (applied by
// sdfarm.native.sourcepatch into ggml-cuda.cu).
//
// A Linear (ggml_ext_linear) is a MUL_MAT and an in-place ADD of its bias. With f16 weights and
// many rows ggml runs the MUL_MAT through cuBLAS: the input converted to f16, an f16 GEMM into a
// pool buffer, a kernel converting that buffer to the f32 node, and then one kernel per node
// that follows: the bias add, and in the UNet's transformer blocks either the residual add
// (attention's to_out, the feed-forward's net.2) or GEGLU (common_block.hpp: a copy of the
// gate half, gelu on it in place, a multiply by the other half). Each reads and writes the
// whole f32 tensor: at 1024x1024 the GEGLU product alone is 16384 x 2560 floats (168 MB) in the
// UNet's first level, and on an H200 these broadcasts, conversions and copies were 19 ms of a
// 56 ms UNet call (docs/gpu.md).
//
// Here the same conversion and the same cuBLAS call (ggml_cuda_op_mul_mat_cublas's arguments,
// so the same f16 product) are followed by one kernel that reads the f16 product and writes the
// last node of the chain: f32(c) + bias, or (f32(c) + bias) + residual, or
// (f32(x) + bias_x) * gelu(f32(g) + bias_g) with ggml's own gelu. Each step rounds as ggml's
// kernel for that node does (adds through __fadd_rn, so no multiply-add is contracted across
// them), so the values are ggml's. Nothing in between is written: the chain's other nodes
// are read by no one else (sdfarm_one_use), which the graph walk checks.
//
// A batch of images (the UNet's [C, L, N] in its transformer blocks) is the same: its input is
// contiguous, so the chain's tensors are [width, L * N] rows like one image's. The product is
// the one ggml would make for that node: where the input has more than one image ggml does not
// take ggml_cuda_op_mul_mat_cublas but ggml_cuda_mul_mat_batched_cublas (one GEMM of L columns
// per image through cublasGemmBatchedEx), and so does this, argument for argument.
//
// SDFARM_LINEAR_FUSED=0 in a process's environment leaves every linear to ggml.
// tests/unit/test_unet_fusions_patch.py asks the walk about graphs the pinned ggml builds the
// way stable-diffusion.cpp builds them.
#pragma once

#include <cstdint>

#include "sdfarm_graph.cuh"

enum sdfarm_linear_kind {
    SDFARM_LINEAR_NONE = 0,
    SDFARM_LINEAR_BIAS,      // f32(c) + b
    SDFARM_LINEAR_RESIDUAL,  // (f32(c) + b) + r
    SDFARM_LINEAR_GEGLU,     // (f32(c[:I]) + b[:I]) * gelu(f32(c[I:]) + b[I:])
};

struct sdfarm_linear_plan {
    int kind = SDFARM_LINEAR_NONE;
    int last = -1;                        // the node whose tensor the fused pass writes
    const ggml_tensor * bias = nullptr;
    const ggml_tensor * residual = nullptr;
};

#if defined(__CUDACC__) || defined(SDFARM_HOST_GRAPH)
static bool sdfarm_linear_f32_contiguous(const ggml_tensor * t) {
    return t != nullptr && t->type == GGML_TYPE_F32 && ggml_is_contiguous(t);
}

static bool sdfarm_linear_computes(const ggml_tensor * t) {
    return (t->flags & GGML_TENSOR_FLAG_COMPUTE) != 0;
}

// Whether node j adds a bias row of `mm`'s width to `mm` (ggml_ext_linear's add, in place).
static bool sdfarm_linear_is_bias_add(const ggml_cgraph * cgraph, int i, int j) {
    const ggml_tensor * mm = cgraph->nodes[i];
    if (j >= cgraph->n_nodes) {
        return false;
    }
    const ggml_tensor * add = cgraph->nodes[j];
    const ggml_tensor * b = add->src[1];
    return add->op == GGML_OP_ADD && add->src[0] == mm && sdfarm_linear_f32_contiguous(b) &&
           b->ne[0] == mm->ne[0] && ggml_nrows(b) == 1 && ggml_are_same_shape(add, mm) &&
           sdfarm_linear_f32_contiguous(add) && sdfarm_linear_computes(add) && sdfarm_one_use(cgraph, i, nullptr);
}

// A view of `src` that takes the half of its rows starting at element `offset` (0 or ne0 / 2).
static bool sdfarm_linear_is_half_view(const ggml_tensor * v, const ggml_tensor * src, int64_t offset) {
    return v != nullptr && v->op == GGML_OP_VIEW && v->src[0] == src && v->type == GGML_TYPE_F32 &&
           v->view_offs == (size_t) offset * sizeof(float) && v->ne[0] * 2 == src->ne[0] &&
           v->ne[1] == src->ne[1] && v->ne[2] == src->ne[2] && v->ne[3] == src->ne[3] &&
           v->nb[1] == src->nb[1] && v->nb[2] == src->nb[2] && v->nb[3] == src->nb[3];
}

// The index of the graph node that is tensor t, searched from `from` on, or -1.
static int sdfarm_linear_index(const ggml_cgraph * cgraph, const ggml_tensor * t, int from) {
    for (int k = from; k < cgraph->n_nodes; k++) {
        if (cgraph->nodes[k] == t) {
            return k;
        }
    }
    return -1;
}

// GEGLU after the bias add at node j (common_block.hpp): the next computing nodes are a CONT of
// the add's upper half, GELU in place on that copy, and a MUL of the add's lower half by it.
// Returns the MUL's index, or -1.
static int sdfarm_linear_geglu(const ggml_cgraph * cgraph, int j, const ggml_tensor * mm) {
    const ggml_tensor * add = cgraph->nodes[j];
    if (add->ne[0] % 2 != 0) {
        return -1;
    }
    const int64_t half = add->ne[0] / 2;
    const int c = sdfarm_next_computing(cgraph, j + 1);
    const int g = c < cgraph->n_nodes ? sdfarm_next_computing(cgraph, c + 1) : cgraph->n_nodes;
    const int m = g < cgraph->n_nodes ? sdfarm_next_computing(cgraph, g + 1) : cgraph->n_nodes;
    if (m >= cgraph->n_nodes) {
        return -1;
    }
    const ggml_tensor * cont = cgraph->nodes[c];
    const ggml_tensor * gelu = cgraph->nodes[g];
    const ggml_tensor * mul = cgraph->nodes[m];
    if (cont->op != GGML_OP_CONT || !sdfarm_linear_is_half_view(cont->src[0], add, half) ||
        !sdfarm_linear_f32_contiguous(cont)) {
        return -1;
    }
    if (gelu->op != GGML_OP_UNARY || ggml_get_unary_op(gelu) != GGML_UNARY_OP_GELU || gelu->src[0] != cont ||
        !sdfarm_linear_f32_contiguous(gelu)) {
        return -1;
    }
    if (mul->op != GGML_OP_MUL || !sdfarm_linear_is_half_view(mul->src[0], add, 0) || mul->src[1] != gelu ||
        !sdfarm_linear_f32_contiguous(mul) || !ggml_are_same_shape(mul, cont)) {
        return -1;
    }
    // Every node of the chain is read only by the next: the add by its two halves' views, each
    // view and the copy once, the gelu once (it may be in place on the copy). The views, like
    // the in-place add, are views of the product itself (ggml views the root of a view).
    const int lower = sdfarm_linear_index(cgraph, mul->src[0], j + 1);
    const int upper = sdfarm_linear_index(cgraph, cont->src[0], j + 1);
    if (lower < 0 || upper < 0 || lower > m || upper > c || ggml_node_get_use_count(cgraph, j) != 2 ||
        !sdfarm_one_use(cgraph, lower, mm) || !sdfarm_one_use(cgraph, upper, mm) ||
        !sdfarm_one_use(cgraph, c, nullptr) || !sdfarm_one_use(cgraph, g, cont)) {
        return -1;
    }
    for (int k = j + 1; k <= m; k++) {
        const ggml_tensor * t = cgraph->nodes[k];
        if (k != c && k != g && k != m && !sdfarm_computes_nothing(t)) {
            return -1;  // another computation sits between the chain's nodes
        }
    }
    if (!sdfarm_linear_computes(cont) || !sdfarm_linear_computes(gelu) || !sdfarm_linear_computes(mul)) {
        return -1;
    }
    return m;
}

// The residual add after the bias add at node j: the next computing node adds a tensor of the
// same shape to it (either order; float addition commutes exactly). Its index, or -1.
static int sdfarm_linear_residual(const ggml_cgraph * cgraph, int j, const ggml_tensor * mm,
                                  const ggml_tensor ** residual) {
    const ggml_tensor * add = cgraph->nodes[j];
    const int k = sdfarm_next_computing(cgraph, j + 1);
    if (k >= cgraph->n_nodes) {
        return -1;
    }
    const ggml_tensor * radd = cgraph->nodes[k];
    if (radd->op != GGML_OP_ADD || !sdfarm_linear_f32_contiguous(radd) || !sdfarm_linear_computes(radd)) {
        return -1;
    }
    const ggml_tensor * r = radd->src[0] == add ? radd->src[1] : radd->src[1] == add ? radd->src[0] : nullptr;
    if (r == nullptr || r == add || !sdfarm_linear_f32_contiguous(r) || !ggml_are_same_shape(r, add) ||
        !ggml_are_same_shape(radd, add) || !sdfarm_one_use(cgraph, j, mm)) {
        return -1;
    }
    *residual = r;
    return k;
}

// What to fuse at node i: a MUL_MAT of f16 weights by a contiguous f32 input (one image's
// [k, L] or a batch's [k, L, N]: rows of k values either way) whose result only its bias add
// reads, then GEGLU, or a residual add, or nothing more.
static sdfarm_linear_plan sdfarm_linear_plan_at(const ggml_cgraph * cgraph, int i) {
    sdfarm_linear_plan plan;
    const ggml_tensor * mm = cgraph->nodes[i];
    if (mm->op != GGML_OP_MUL_MAT) {
        return plan;
    }
    const ggml_tensor * w = mm->src[0];
    const ggml_tensor * x = mm->src[1];
    if (w->type != GGML_TYPE_F16 || !ggml_is_contiguous(w) || w->ne[2] != 1 || w->ne[3] != 1 ||
        !sdfarm_linear_f32_contiguous(x) || !sdfarm_linear_f32_contiguous(mm) || mm->ne[0] != w->ne[1] ||
        mm->ne[1] != x->ne[1] || mm->ne[2] != x->ne[2] || mm->ne[3] != x->ne[3] ||
        mm->op_params[0] != GGML_PREC_DEFAULT) {
        return plan;
    }
    const int j = sdfarm_next_computing(cgraph, i + 1);
    if (!sdfarm_linear_is_bias_add(cgraph, i, j)) {
        return plan;
    }
    plan.bias = cgraph->nodes[j]->src[1];
    const int m = sdfarm_linear_geglu(cgraph, j, mm);
    if (m > 0) {
        plan.kind = SDFARM_LINEAR_GEGLU;
        plan.last = m;
        return plan;
    }
    const int k = sdfarm_linear_residual(cgraph, j, mm, &plan.residual);
    if (k > 0) {
        plan.kind = SDFARM_LINEAR_RESIDUAL;
        plan.last = k;
        return plan;
    }
    plan.residual = nullptr;
    plan.kind = SDFARM_LINEAR_BIAS;
    plan.last = j;
    return plan;
}

// The product's shape for the fused pass: m = the weights' rows (the width of a row of the
// product), `columns` = an image's rows of the input (x's ne[1], what ggml decides its kernel
// by), `images` = x's ne[2] * ne[3]. The chain's tensors are contiguous, so they are
// columns * images rows of m values (2 * (m / 2) for GEGLU's halves).
struct sdfarm_linear_rows {
    int64_t k, m, columns, images;
};

static sdfarm_linear_rows sdfarm_linear_rows_of(const ggml_tensor * mm) {
    const ggml_tensor * w = mm->src[0];
    const ggml_tensor * x = mm->src[1];
    return {w->ne[0], w->ne[1], x->ne[1], x->ne[2] * x->ne[3]};
}
#endif

#ifdef __CUDACC__
#define SDFARM_LINEAR_THREADS 256

// V consecutive values of a row, as floats: 4 through one 8-byte (f16) or 16-byte (f32) load.
template <int V>
static __device__ __forceinline__ void sdfarm_linear_load(const half * p, float * f) {
    if constexpr (V == 4) {
        const uint2 raw = *(const uint2 *) p;
        const half2 lo = *(const half2 *) &raw.x;
        const half2 hi = *(const half2 *) &raw.y;
        f[0] = __low2float(lo);
        f[1] = __high2float(lo);
        f[2] = __low2float(hi);
        f[3] = __high2float(hi);
    } else {
        f[0] = __half2float(p[0]);
    }
}

template <int V>
static __device__ __forceinline__ void sdfarm_linear_load(const float * p, float * f) {
    if constexpr (V == 4) {
        const float4 q = *(const float4 *) p;
        f[0] = q.x;
        f[1] = q.y;
        f[2] = q.z;
        f[3] = q.w;
    } else {
        f[0] = p[0];
    }
}

// One pass from the f16 product c (rows of `width` values, 2 * width for GEGLU) to the chain's
// last node. V = 4 where every row and pointer allows it (the UNet's widths are multiples of
// 64), else 1.
template <int KIND, int V>
static __global__ void sdfarm_linear_epilogue(const half * __restrict__ c, const float * __restrict__ b,
                                              const float * __restrict__ r, float * __restrict__ out,
                                              const int64_t width, const int64_t rows) {
    const int64_t groups = width / V;
    const int64_t n = groups * rows;
    for (int64_t t = (int64_t) blockIdx.x * blockDim.x + threadIdx.x; t < n; t += (int64_t) gridDim.x * blockDim.x) {
        const int64_t row = t / groups;
        const int64_t col = (t - row * groups) * V;
        float y[V];
        float bias[V];
        sdfarm_linear_load<V>(b + col, bias);
        if constexpr (KIND == SDFARM_LINEAR_GEGLU) {
            float x[V];
            float g[V];
            float bias_g[V];
            sdfarm_linear_load<V>(c + row * 2 * width + col, x);
            sdfarm_linear_load<V>(c + row * 2 * width + width + col, g);
            sdfarm_linear_load<V>(b + width + col, bias_g);
#pragma unroll
            for (int v = 0; v < V; v++) {
                y[v] = __fmul_rn(__fadd_rn(x[v], bias[v]), ggml_cuda_op_gelu_single(__fadd_rn(g[v], bias_g[v])));
            }
        } else {
            sdfarm_linear_load<V>(c + row * width + col, y);
#pragma unroll
            for (int v = 0; v < V; v++) {
                y[v] = __fadd_rn(y[v], bias[v]);
            }
            if constexpr (KIND == SDFARM_LINEAR_RESIDUAL) {
                float res[V];
                sdfarm_linear_load<V>(r + row * width + col, res);
#pragma unroll
                for (int v = 0; v < V; v++) {
                    y[v] = __fadd_rn(y[v], res[v]);
                }
            }
        }
        float * o = out + row * width + col;
        if constexpr (V == 4) {
            *(float4 *) o = make_float4(y[0], y[1], y[2], y[3]);
        } else {
            o[0] = y[0];
        }
    }
}

template <int KIND>
static void sdfarm_linear_epilogue_launch(const half * c, const float * b, const float * r, float * out,
                                          int64_t width, int64_t rows, cudaStream_t stream) {
    auto aligned = [](const void * p) { return ((uintptr_t) p % 16) == 0; };
    const bool vec = width % 4 == 0 && aligned(c) && aligned(b) && aligned(out) && (r == nullptr || aligned(r));
    const int v = vec ? 4 : 1;
    const int64_t n = width / v * rows;
    const int64_t blocks = (n + SDFARM_LINEAR_THREADS - 1) / SDFARM_LINEAR_THREADS;
    const int grid = (int) (blocks < 65536 * 16 ? blocks : 65536 * 16);
    if (vec) {
        sdfarm_linear_epilogue<KIND, 4><<<grid, SDFARM_LINEAR_THREADS, 0, stream>>>(c, b, r, out, width, rows);
    } else {
        sdfarm_linear_epilogue<KIND, 1><<<grid, SDFARM_LINEAR_THREADS, 0, stream>>>(c, b, r, out, width, rows);
    }
    CUDA_CHECK(cudaGetLastError());
}

// Whether ggml_cuda_mul_mat would multiply f16 weights w by an input of n columns (its ne[1];
// per image) through cuBLAS with an f16 product (CUBLAS_COMPUTE_16F): ggml_cuda_op_mul_mat_cublas's
// f16 path for one image, ggml_cuda_mul_mat_batched_cublas's for more (the same tests: neither
// mmvf nor mmf for n, f16 fast on this NVIDIA GPU, not Volta, no forced f32 compute, weights not
// split).
static bool sdfarm_cublas_f16_path(ggml_backend_cuda_context & ctx, const ggml_tensor * w, int64_t n) {
    const int cc = ggml_cuda_info().devices[ctx.device].cc;
    const int warp_size = ggml_cuda_info().devices[ctx.device].warp_size;
    return GGML_CUDA_CC_IS_NVIDIA(cc) && cc != GGML_CUDA_CC_VOLTA && fast_fp16_hardware_available(cc) &&
           !ggml_cuda_cublas_get_force_compute_type().fp32 && !ggml_backend_buft_is_cuda_split(w->buffer->buft) &&
           !ggml_cuda_should_use_mmvf(w->type, cc, w->ne, w->nb, n) &&
           !ggml_cuda_should_use_mmf(w->type, cc, warp_size, w->ne, w->nb, n, /*mul_mat_id=*/false);
}

// The f16 product of f16 weights w ([k, m]) and f16 x ([k, n]) into c ([m, n]): the cuBLAS call
// of ggml_cuda_op_mul_mat_cublas's f16 path, argument for argument, so the same values.
static void sdfarm_cublas_f16_gemm(ggml_backend_cuda_context & ctx, const ggml_tensor * w, const half * x,
                                   half * c, int64_t n, cudaStream_t stream) {
    const int64_t k = w->ne[0];
    const int64_t m = w->ne[1];
    const half alpha = 1.0f;
    const half beta = 0.0f;
    CUBLAS_CHECK(cublasSetStream(ctx.cublas_handle(), stream));
    CUBLAS_CHECK(cublasGemmEx(ctx.cublas_handle(), CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, w->data, CUDA_R_16F, k,
                              x, CUDA_R_16F, k, &beta, c, CUDA_R_16F, m, CUBLAS_COMPUTE_16F,
                              CUBLAS_GEMM_DEFAULT_TENSOR_OP));
}

// The same for `images` inputs of n columns each, one after another in x ([k, n * images]) and
// c ([m, n * images]): the cuBLAS call ggml_cuda_mul_mat_batched_cublas_impl<GGML_TYPE_F16>
// makes for a 2-d f16 weight and a contiguous f32 [k, n, images] input converted to f16 (its
// broadcast branch, cublasGemmBatchedEx over pointers that k_compute_batched_ptrs computes;
// ne12 = images, ne13 = 1, r2 = images), argument for argument, so the same values as ggml's
// node. One image is sdfarm_cublas_f16_gemm (ggml takes ggml_cuda_op_mul_mat_cublas then).
static void sdfarm_cublas_f16_gemm_images(ggml_backend_cuda_context & ctx, const ggml_tensor * w, const half * x,
                                          half * c, int64_t n, int64_t images, cudaStream_t stream) {
    if (images == 1) {
        sdfarm_cublas_f16_gemm(ctx, w, x, c, n, stream);
        return;
    }
    using traits = batched_mul_mat_traits<GGML_TYPE_F16>;
    const int64_t k = w->ne[0];
    const int64_t m = w->ne[1];
    const int64_t ne12 = images, ne13 = 1, ne23 = ne12 * ne13;
    ggml_cuda_pool_alloc<const void *> ptrs_src(ctx.pool(), 2 * ne23);
    ggml_cuda_pool_alloc<void *> ptrs_dst(ctx.pool(), 1 * ne23);
    const int threads_x = 16;
    const int threads_y = 16;
    const dim3 block_dims(threads_x, threads_y);
    const dim3 grid_dims((ne13 + threads_x - 1) / threads_x, (ne12 + threads_y - 1) / threads_y);
    const size_t nb12 = (size_t) (n * k) * sizeof(half);  // s12 * sizeof(half) after the conversion
    const size_t nbd2 = (size_t) (m * n) * sizeof(half);  // the f32 node's nb[2], halved
    k_compute_batched_ptrs<<<grid_dims, block_dims, 0, stream>>>(
        w->data, x, (char *) c, ptrs_src.get(), ptrs_dst.get(), ne12, ne13, ne23, w->nb[2], w->nb[3], nb12,
        nb12 * ne12, nbd2, nbd2 * ne12, /*r2=*/ne12, /*r3=*/ne13);
    CUDA_CHECK(cudaGetLastError());
    CUBLAS_CHECK(cublasSetStream(ctx.cublas_handle(), stream));
    CUBLAS_CHECK(cublasGemmBatchedEx(ctx.cublas_handle(), CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, traits::get_alpha(),
                                     (const void **) (ptrs_src.get() + 0 * ne23), CUDA_R_16F, k,
                                     (const void **) (ptrs_src.get() + 1 * ne23), CUDA_R_16F, k, traits::get_beta(),
                                     (void **) (ptrs_dst.get() + 0 * ne23), CUDA_R_16F, m, ne23,
                                     traits::compute_type, CUBLAS_GEMM_DEFAULT_TENSOR_OP));
}

// The linear at node i and what follows it (sdfarm_linear_plan_at), tried by the graph loop of
// ggml-cuda.cu where ggml would take ggml_cuda_op_mul_mat_cublas's f16 path. Returns the index
// of the last node, whose tensor it wrote, or -1 (nothing launched; ggml computes node i).
int sdfarm_linear_fuse(ggml_backend_cuda_context & ctx, ggml_cgraph * cgraph, int i) {
    static const bool off = sdfarm_env_first("SDFARM_LINEAR_FUSED") == '0';
    if (off) {
        return -1;
    }
    const sdfarm_linear_plan plan = sdfarm_linear_plan_at(cgraph, i);
    if (plan.kind == SDFARM_LINEAR_NONE) {
        return -1;
    }
    const ggml_tensor * mm = cgraph->nodes[i];
    const ggml_tensor * w = mm->src[0];
    const ggml_tensor * x = mm->src[1];
    const sdfarm_linear_rows r = sdfarm_linear_rows_of(mm);
    const int64_t k = r.k;
    const int64_t m = r.m;
    const int64_t n = r.columns * r.images;  // rows of the chain's tensors
    if (!sdfarm_cublas_f16_path(ctx, w, r.columns)) {
        return -1;
    }
    cudaStream_t stream = ctx.stream();

    ggml_cuda_pool_alloc<half> x16(ctx.pool(), k * n);
    ggml_get_to_fp16_cuda(GGML_TYPE_F32)(x->data, x16.get(), k * n, stream);
    ggml_cuda_pool_alloc<half> c16(ctx.pool(), m * n);
    sdfarm_cublas_f16_gemm_images(ctx, w, x16.get(), c16.get(), r.columns, r.images, stream);

    ggml_tensor * out = cgraph->nodes[plan.last];
    const float * b = (const float *) plan.bias->data;
    switch (plan.kind) {
        case SDFARM_LINEAR_BIAS:
            sdfarm_linear_epilogue_launch<SDFARM_LINEAR_BIAS>(c16.get(), b, nullptr, (float *) out->data, m, n, stream);
            break;
        case SDFARM_LINEAR_RESIDUAL:
            sdfarm_linear_epilogue_launch<SDFARM_LINEAR_RESIDUAL>(c16.get(), b, (const float *) plan.residual->data,
                                                                  (float *) out->data, m, n, stream);
            break;
        default:
            sdfarm_linear_epilogue_launch<SDFARM_LINEAR_GEGLU>(c16.get(), b, nullptr, (float *) out->data, m / 2, n,
                                                               stream);
            break;
    }
    return plan.last;
}
#endif
