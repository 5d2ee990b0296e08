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
// Storing 4 values at a time instead of one (SDFARM_IM2COL_VEC, below): 251-252 -> 215-220 ms
// at 1024 with the split group norm, the same pixels.
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

// Threads of a block for a full tile's segment of `seg` values, V per store: as many as one
// per value (rounded up to whole warps, at most 1024), so that each group of V values has
// seg rounded up / groups threads ("lanes"), which share the tile's pixels.
static inline int sdfarm_im2col_threads(int64_t seg, int V) {
    const int64_t want = seg >= 1024 ? 1024 : (seg + 31) / 32 * 32;
    const int64_t groups = seg / V;
    const int64_t lanes = groups >= want ? 1 : want / groups;
    return (int) (groups * lanes > 1024 ? 1024 : groups * lanes);
}

// V values to dst[0..V), converted to T as ggml converts one (round to nearest): on the GPU
// as one 2*V- or 4*V-byte store (the launch checks the alignment), on the host one by one.
template <typename T, int V>
static __host__ __device__ __forceinline__ void sdfarm_im2col_store(T * to, const float * vals) {
#ifdef __CUDA_ARCH__
    if constexpr (V == 4 && sizeof(T) == 2) {
        const half2 a = __floats2half2_rn(vals[0], vals[1]);
        const half2 b = __floats2half2_rn(vals[2], vals[3]);
        uint2 u;
        u.x = *reinterpret_cast<const unsigned int *>(&a);
        u.y = *reinterpret_cast<const unsigned int *>(&b);
        *reinterpret_cast<uint2 *>(to) = u;
    } else if constexpr (V == 2 && sizeof(T) == 2) {
        *reinterpret_cast<half2 *>(to) = __floats2half2_rn(vals[0], vals[1]);
    } else if constexpr (V == 4 && sizeof(T) == 4) {
        *reinterpret_cast<float4 *>(to) = make_float4(vals[0], vals[1], vals[2], vals[3]);
    } else if constexpr (V == 2 && sizeof(T) == 4) {
        *reinterpret_cast<float2 *>(to) = make_float2(vals[0], vals[1]);
    } else {
        for (int v = 0; v < V; v++) {
            to[v] = vals[v];
        }
    }
#else
    for (int v = 0; v < V; v++) {
        to[v] = vals[v];
    }
#endif
}

// One block's work for output row iz (= n * OH + oh), pixels [bx*TW, bx*TW + TW) and channels
// [by*CT, by*CT + CT), V values per store (V divides CT*KH*KW of every tile: the launch
// checks); tid/nt: this thread and the block's thread count. `phases` 1 loads the tile, 2
// writes dst, 3 both (the GPU; the host test loads once, then writes thread by thread).
template <typename T, int V = 1>
static __host__ __device__ __forceinline__ void sdfarm_im2col_tile(
        const float * x, T * dst, float * tile, int bx, int by, int64_t iz, int tid, int nt,
        int IW, int IH, int OW, int OH, int KW, int KH, int IC,
        int64_t IC_IH_IW, int64_t IH_IW, int SW,
        int s0, int s1, int p0, int p1, int d0, int d1, int phases = 3) {
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
    for (int j = tid; (phases & 1) && j < rows * SW; j += nt) {
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
    // The output: each thread takes V consecutive values of the tile's CT*KH*KW (a group) and
    // writes them, as one V-wide store, for its share of the pixels (`lanes` threads per group
    // take every lanes-th pixel); at each pixel the groups are contiguous in dst. The
    // divisions are per value of the segment, not per value written.
    const int seg = ct * KH_KW;
    const int groups = seg / V;
    const int lanes = nt >= groups ? nt / groups : 1;
    const int64_t base = (iz * OW + ow0) * IC_KH_KW + (int64_t) ic0 * KH_KW;
    for (int q = tid; (phases & 2) && q < groups * lanes; q += nt) {
        const int g = q % groups;
        const int lane = q / groups;
        int off[V];
        for (int v = 0; v < V; v++) {
            const int r  = g * V + v;
            const int c  = r / KH_KW;
            const int k  = r - c * KH_KW;
            const int kh = k / KW;
            const int kw = k - kh * KW;
            off[v] = (c * KH + kh) * SW + kw * d0;
        }
        T * to = dst + base + g * V;
        for (int p = lane; p < tw; p += lanes) {
            float vals[V];
            for (int v = 0; v < V; v++) {
                vals[v] = tile[off[v] + p * s0];
            }
            sdfarm_im2col_store<T, V>(to + p * IC_KH_KW, vals);
        }
    }
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
}

#ifdef __CUDACC__
template <typename T, int V>
static __global__ void sdfarm_im2col_tiled_kernel(
        const float * x, T * dst, int64_t N_OH,
        int IW, int IH, int OW, int OH, int KW, int KH, int IC,
        int64_t IC_IH_IW, int64_t IH_IW, int SW,
        int s0, int s1, int p0, int p1, int d0, int d1) {
    extern __shared__ float sdfarm_tile[];
    for (int64_t iz = blockIdx.z; iz < N_OH; iz += gridDim.z) {
        sdfarm_im2col_tile<T, V>(x, dst, sdfarm_tile, blockIdx.x, blockIdx.y, iz, threadIdx.x,
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
    // V values per store: 4 or 2 where every tile's segment and dst's alignment allow it
    // (SDFARM_IM2COL_VEC=1|2|4 asks for one, for side-by-side measurement; 1 is the kernel
    // as it first landed).
    static const int asked = [] {
        const char * v = getenv("SDFARM_IM2COL_VEC");
        return v != nullptr ? atoi(v) : 4;
    }();
    const int64_t IC_KH_KW = IC * KH * KW;
    int V = asked >= 4 ? 4 : asked >= 2 ? 2 : 1;
    while (V > 1 && (IC_KH_KW % V != 0 || (uintptr_t) dst % (V * sizeof(T)) != 0)) {
        V /= 2;
    }
    const int64_t seg = (IC < SDFARM_IM2COL_CT ? IC : SDFARM_IM2COL_CT) * KH * KW;
    const int threads = sdfarm_im2col_threads(seg, V);
    const int SW = sdfarm_im2col_tile_width(s0, d0, (int) KW);
#define SDFARM_IM2COL_LAUNCH(VV)                                                               \
    sdfarm_im2col_tiled_kernel<T, VV><<<grid, threads, smem, stream>>>(                        \
        x, dst, N_OH, (int) IW, (int) IH, (int) OW, (int) OH, (int) KW, (int) KH, (int) IC,     \
        IC_IH_IW, IH_IW, SW, s0, s1, p0, p1, d0, d1)
    if (V == 4) {
        SDFARM_IM2COL_LAUNCH(4);
    } else if (V == 2) {
        SDFARM_IM2COL_LAUNCH(2);
    } else {
        SDFARM_IM2COL_LAUNCH(1);
    }
#undef SDFARM_IM2COL_LAUNCH
    return true;
}
#endif
