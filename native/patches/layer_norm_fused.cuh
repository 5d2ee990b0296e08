// sdfarm: stable-diffusion.cpp's layer norm (ggml_ext_layer_norm: NORM, then the weight's MUL
// and the bias's ADD, both in place) as one kernel on ggml's CUDA backend (applied by
// sdfarm.native.sourcepatch into norm.cu).
//
// ggml runs the three nodes as three kernels, each reading and writing the whole tensor; a UNet
// transformer block has three layer norms, over 16384 x 320 floats per block at 1024x1024.
// Here ggml's own norm_f32 (the same block size, the same sums, so the same mean and variance)
// writes ((x - mean) * inv_std) * weight + bias, the multiply and the add rounded on their own
// as ggml's kernels do (__fmul_rn, __fadd_rn: nothing is contracted into a multiply-add), so
// the values are ggml's.
//
// SDFARM_LAYER_NORM_FUSED=0 in a process's environment leaves the three nodes to ggml.
// tests/unit/test_unet_fusions_patch.py asks the walk about a graph the pinned ggml builds.
#pragma once


#include "sdfarm_graph.cuh"

#if defined(__CUDACC__) || defined(SDFARM_HOST_GRAPH)
static bool sdfarm_ln_row_of(const ggml_tensor * t, const ggml_tensor * x) {
    return t != nullptr && t->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && t->ne[0] == x->ne[0] &&
           ggml_nrows(t) == 1;
}

// The ADD that ends ggml_ext_layer_norm's chain at node i (NORM, MUL by a weight row in place,
// ADD of a bias row in place, nothing else reading the first two), or -1.
static int sdfarm_layer_norm_chain(const ggml_cgraph * cgraph, int i) {
    const ggml_tensor * norm = cgraph->nodes[i];
    if (norm->op != GGML_OP_NORM || norm->type != GGML_TYPE_F32 || !ggml_is_contiguous(norm) ||
        norm->src[0]->type != GGML_TYPE_F32 || norm->src[0]->nb[0] != sizeof(float)) {
        return -1;
    }
    const int j = sdfarm_next_computing(cgraph, i + 1);
    const int k = j < cgraph->n_nodes ? sdfarm_next_computing(cgraph, j + 1) : cgraph->n_nodes;
    if (k >= cgraph->n_nodes) {
        return -1;
    }
    const ggml_tensor * mul = cgraph->nodes[j];
    const ggml_tensor * add = cgraph->nodes[k];
    const bool chain = mul->op == GGML_OP_MUL && mul->src[0] == norm && mul->view_src == norm &&
                       sdfarm_ln_row_of(mul->src[1], norm) && add->op == GGML_OP_ADD && add->src[0] == mul &&
                       add->view_src == norm && sdfarm_ln_row_of(add->src[1], norm) &&
                       ggml_are_same_shape(add, norm) && (mul->flags & GGML_TENSOR_FLAG_COMPUTE) != 0 &&
                       (add->flags & GGML_TENSOR_FLAG_COMPUTE) != 0 && sdfarm_one_use(cgraph, i, nullptr) &&
                       sdfarm_one_use(cgraph, j, norm);
    return chain ? k : -1;
}
#endif

#ifdef __CUDACC__
// ggml's norm_f32 (norm.cu) with the weight and the bias taken into its writing loop.
template <int block_size>
static __global__ void sdfarm_layer_norm_f32(const float * x, float * dst, const float * w, const float * b,
                                             const int ncols, const int64_t stride_row,
                                             const int64_t stride_channel, const int64_t stride_sample,
                                             const float eps) {
    const int nrows = gridDim.x;
    const int nchannels = gridDim.y;

    const int row = blockIdx.x;
    const int channel = blockIdx.y;
    const int sample = blockIdx.z;
    const int tid = threadIdx.x;

    x += sample * stride_sample + channel * stride_channel + row * stride_row;
    dst += ((sample * nchannels + channel) * nrows + row) * ncols;

    float2 mean_var = make_float2(0.0f, 0.0f);

    for (int col = tid; col < ncols; col += block_size) {
        const float xi = x[col];
        mean_var.x += xi;
        mean_var.y += xi * xi;
    }

    extern __shared__ float2 s_sum2[];
    mean_var = block_reduce<block_reduce_method::SUM, block_size>(mean_var, s_sum2);

    const float mean = mean_var.x / ncols;
    const float var = mean_var.y / ncols - mean * mean;
    const float inv_std = rsqrtf(var + eps);

    for (int col = tid; col < ncols; col += block_size) {
        const float normed = (x[col] - mean) * inv_std;
        dst[col] = __fadd_rn(__fmul_rn(normed, w[col]), b[col]);
    }
}

// The layer norm at node i with its weight and bias (sdfarm_layer_norm_chain), tried by the
// graph loop of ggml-cuda.cu. Returns the index of the bias add, whose tensor it wrote, or -1.
int sdfarm_layer_norm_fuse(ggml_backend_cuda_context & ctx, ggml_cgraph * cgraph, int i) {
    static const bool off = sdfarm_env_first("SDFARM_LAYER_NORM_FUSED") == '0';
    if (off) {
        return -1;
    }
    const int k = sdfarm_layer_norm_chain(cgraph, i);
    if (k < 0) {
        return -1;
    }
    const ggml_tensor * norm = cgraph->nodes[i];
    const ggml_tensor * src0 = norm->src[0];
    const ggml_tensor * mul = cgraph->nodes[sdfarm_next_computing(cgraph, i + 1)];
    ggml_tensor * add = cgraph->nodes[k];
    float eps;
    memcpy(&eps, norm->op_params, sizeof(float));
    const size_t ts0 = ggml_type_size(src0->type);
    const dim3 blocks_num(src0->ne[1], src0->ne[2], src0->ne[3]);
    const float * x = (const float *) src0->data;
    const float * w = (const float *) mul->src[1]->data;
    const float * b = (const float *) add->src[1]->data;
    float * dst = (float *) add->data;
    const int ncols = (int) src0->ne[0];
    const int64_t s01 = src0->nb[1] / ts0, s02 = src0->nb[2] / ts0, s03 = src0->nb[3] / ts0;
    cudaStream_t stream = ctx.stream();
    if (ncols < 1024) {
        sdfarm_layer_norm_f32<WARP_SIZE><<<blocks_num, dim3(WARP_SIZE, 1, 1), 0, stream>>>(x, dst, w, b, ncols, s01,
                                                                                         s02, s03, eps);
    } else {
        sdfarm_layer_norm_f32<1024><<<blocks_num, dim3(1024, 1, 1), 32 * sizeof(float2), stream>>>(
            x, dst, w, b, ncols, s01, s02, s03, eps);
    }
    CUDA_CHECK(cudaGetLastError());
    return k;
}
#endif
