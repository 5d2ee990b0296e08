// sdfarm: a tiled im2col for ggml's CUDA backend (applied by sdfarm.native.patches).
//
// ggml's im2col_kernel gives each thread one (channel, kh, kw) of one output pixel: its writes
// are contiguous, but consecutive threads read from different channels, IH*IW floats apart, so
// every read fetches a sector for four bytes. Profiled on an H200 (bench/ncu_profile.py), it
// was 186 of the 274 ms of a 1024x1024 SD VAE decode.
//
// Measured on the H200 against ggml's kernel in the same build (bench/build_options.py,
// docs/gpu.md): the same pixels, 438-443 -> 281-284 ms per 1024x1024 image, 125-127 -> 86-88
// at 512. (A first version, which divided per value written, gave 341-357 and 101-106.)
//
// Here one block takes TW consecutive output pixels of one output row and CT channels: it
// first copies the input rows those pixels need into shared memory, reading along the row
// (coalesced), then writes each pixel's CT*KH*KW values, which are contiguous in dst, one
// thread per value. Every
// value is the same float, converted to T the same way, at the same place as ggml's kernel
// puts it, so the image does not change (tests/unit/test_im2col_patch.py checks the layout
// against ggml's indexing on the host; bench/build_options.py the pixels on the GPU).
//
// The block's work is a __host__ __device__ function of its indices so that the same code
// runs on the host in the test, one thread per block (every loop strides by the thread
// count, so one thread covers what many would).
#pragma once

#include <cstdint>
#include <cstdlib>

#ifndef __CUDACC__
#define __host__
#define __device__
#define __forceinline__ inline
#endif

#define SDFARM_IM2COL_TW 32  // output pixels of one row per block
#define SDFARM_IM2COL_CT 32  // input channels per block

// Width of the shared tile's rows: the input columns TW output pixels read.
static inline int sdfarm_im2col_tile_width(int s0, int d0, int KW) {
    return (SDFARM_IM2COL_TW - 1) * s0 + (KW - 1) * d0 + 1;
}

// Bytes of shared memory a block needs.
static inline size_t sdfarm_im2col_tile_bytes(int s0, int d0, int KW, int KH) {
    return (size_t) SDFARM_IM2COL_CT * KH * sdfarm_im2col_tile_width(s0, d0, KW) * sizeof(float);
}

// One block's work for output row iz (= n * OH + oh), pixels [bx*TW, bx*TW + TW) and channels
// [by*CT, by*CT + CT); tid/nt: this thread and the block's thread count.
template <typename T>
static __host__ __device__ __forceinline__ void sdfarm_im2col_tile(
        const float * x, T * dst, float * tile, int bx, int by, int64_t iz, int tid, int nt,
        int IW, int IH, int OW, int OH, int KW, int KH, int IC,
        int64_t IC_IH_IW, int64_t IH_IW, int SW,
        int s0, int s1, int p0, int p1, int d0, int d1) {
    const int ow0 = bx * SDFARM_IM2COL_TW;
    const int ic0 = by * SDFARM_IM2COL_CT;
    const int ct  = IC - ic0 < SDFARM_IM2COL_CT ? IC - ic0 : SDFARM_IM2COL_CT;
    const int tw  = OW - ow0 < SDFARM_IM2COL_TW ? OW - ow0 : SDFARM_IM2COL_TW;
    const int KH_KW = KH * KW;
    const int64_t IC_KH_KW = (int64_t) IC * KH_KW;
    const int64_t in  = iz / OH;
    const int     ioh = (int) (iz - in * OH);
    const int     iw0 = ow0 * s0 - p0;

    // The input: CT channels x KH rows x SW columns, read along the rows.
    const int rows = ct * KH;
    for (int j = tid; j < rows * SW; j += nt) {
        const int r   = j / SW;
        const int col = j - r * SW;
        const int c   = r / KH;
        const int kh  = r - c * KH;
        const int iih = ioh * s1 + kh * d1 - p1;
        const int iiw = iw0 + col;
        float v = 0.0f;
        if (iih >= 0 && iih < IH && iiw >= 0 && iiw < IW) {
            v = x[(int64_t) (ic0 + c) * IC_IH_IW + in * IH_IW + (int64_t) iih * IW + iiw];
        }
        tile[j] = v;
    }
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
    // The output: each thread takes one (channel, kh, kw) of the tile's CT*KH*KW and writes it
    // for every pixel; at each pixel the threads' writes are contiguous in dst. The divisions
    // are per value of the segment, not per value written.
    const int seg = ct * KH_KW;
    const int64_t base = (iz * OW + ow0) * IC_KH_KW + (int64_t) ic0 * KH_KW;
    for (int r = tid; r < seg; r += nt) {
        const int c  = r / KH_KW;
        const int k  = r - c * KH_KW;
        const int kh = k / KW;
        const int kw = k - kh * KW;
        const float * from = tile + (c * KH + kh) * SW + kw * d0;
        T * to = dst + base + r;
        for (int p = 0; p < tw; p++) {
            to[p * IC_KH_KW] = from[p * s0];
        }
    }
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
}

#ifdef __CUDACC__
template <typename T>
static __global__ void sdfarm_im2col_tiled_kernel(
        const float * x, T * dst, int64_t N_OH,
        int IW, int IH, int OW, int OH, int KW, int KH, int IC,
        int64_t IC_IH_IW, int64_t IH_IW, int SW,
        int s0, int s1, int p0, int p1, int d0, int d1) {
    extern __shared__ float sdfarm_tile[];
    for (int64_t iz = blockIdx.z; iz < N_OH; iz += gridDim.z) {
        sdfarm_im2col_tile<T>(x, dst, sdfarm_tile, blockIdx.x, blockIdx.y, iz, threadIdx.x,
                              blockDim.x, IW, IH, OW, OH, KW, KH, IC, IC_IH_IW, IH_IW, SW,
                              s0, s1, p0, p1, d0, d1);
    }
}

// Launches the tiled kernel and returns true, or returns false (nothing launched) where it
// does not apply: a tile larger than 48 KiB of shared memory, sizes past int, or
// SDFARM_IM2COL_TILED=0 in the environment (ggml's own kernel, for side-by-side measurement).
template <typename T>
static bool sdfarm_im2col_tiled(
        const float * x, T * dst, int64_t IW, int64_t IH, int64_t OW, int64_t OH, int64_t KW,
        int64_t KH, int64_t IC, int64_t N, int64_t IC_IH_IW, int64_t IH_IW,
        int s0, int s1, int p0, int p1, int d0, int d1, cudaStream_t stream) {
    static const bool disabled = [] {
        const char * v = getenv("SDFARM_IM2COL_TILED");
        return v != nullptr && v[0] == '0';
    }();
    if (disabled) {
        return false;
    }
    const int64_t limit = 1 << 30;
    if (IW > limit || IH > limit || OW > limit || OH > limit || IC > limit || KW > 64 || KH > 64 ||
            s0 < 1 || d0 < 1) {
        return false;
    }
    const size_t smem = sdfarm_im2col_tile_bytes(s0, d0, (int) KW, (int) KH);
    if (smem > 48 * 1024) {
        return false;
    }
    const int64_t N_OH = N * OH;
    dim3 grid((OW + SDFARM_IM2COL_TW - 1) / SDFARM_IM2COL_TW,
              (IC + SDFARM_IM2COL_CT - 1) / SDFARM_IM2COL_CT,
              N_OH < 65535 ? N_OH : 65535);
    if (grid.y > 65535) {
        return false;
    }
    // One thread per value of a pixel's segment (rounded up to whole warps), at most 1024.
    const int64_t seg = (IC < SDFARM_IM2COL_CT ? IC : SDFARM_IM2COL_CT) * KH * KW;
    const int threads = seg >= 1024 ? 1024 : (int) ((seg + 31) / 32 * 32);
    sdfarm_im2col_tiled_kernel<T><<<grid, threads, smem, stream>>>(
        x, dst, N_OH, (int) IW, (int) IH, (int) OW, (int) OH, (int) KW, (int) KH, (int) IC,
        IC_IH_IW, IH_IW, sdfarm_im2col_tile_width(s0, d0, (int) KW), s0, s1, p0, p1, d0, d1);
    return true;
}
#endif
