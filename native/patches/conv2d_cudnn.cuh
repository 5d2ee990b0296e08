// sdfarm: ggml's CUDA direct convolution (GGML_OP_CONV_2D) through cuDNN, loaded at run time
// (applied by sdfarm.native.sourcepatch). Off unless SDFARM_CUDNN names a libcudnn.so.9
// (sdfarm.native.cudnn). On the H200 with the cuDNN 9.19 of PyTorch 2.11 (cu130) it made a
// 1024x1024 image 13-29% faster than im2col and its peak 7.8 GiB against 10, with pixels
// within 3/255 of im2col's (PSNR 53 dB): docs/gpu.md, "Convolutions through cuDNN". (Its
// first runs crashed inside cuDNN: the runtime exported a static libstdc++, fixed by the
// build's link flag, sdfarm.native.build.PRIVATE_STDCXX.)
//
// stable-diffusion.cpp convolves through im2col + GEMM on CUDA: every 3x3 convolution first
// writes its input nine times over (a 1024x1024 VAE decode: 41 im2col launches, 36-102 ms of
// its kernels on an H200) and the GEMM reads it back. ggml's direct convolution has no such
// buffer but is a naive kernel, 27x slower. PyTorch convolves through cuDNN's implicit GEMM,
// which reads the input tile by tile into shared memory; this does the same for ggml's
// CONV_2D node: the f32 input is converted to f16 once, cuDNN convolves it with the f16
// kernel on tensor cores (f32 accumulation, f16 output), and one last pass writes the f32
// result, with the bias added when the graph's next node adds one (stable-diffusion.cpp's
// ggml_ext_conv_2d: conv, then an in-place add of [1, 1, OC, 1]).
//
// cuDNN is not linked: the library SDFARM_CUDNN names (the worker names it only when the
// operator did, sdfarm.native.cudnn) is opened at the first convolution; it opens its
// sub-libraries from its own folder. SDFARM_CUDNN_ALGO=N takes cuDNN's algorithm N instead of
// asking its heuristics, SDFARM_CUDNN_FIND=1 times them all (no faster on the H200);
// SDFARM_CUDNN_TRACE=1 prints every step, and a native backtrace and the mapped libraries on a
// crash. A library that does not load, or a convolution cuDNN refuses (int-sized dimensions,
// a kernel type other than f16/f32), falls back to ggml's kernel, with one warning. The
// accumulation differs from cuBLAS's f16 GEMM, so pixels move by a rounding.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "sdfarm_graph.cuh"

#if defined(__CUDACC__) || defined(SDFARM_HOST_GRAPH)
// The bias add of ggml_ext_conv_2d after the convolution at node i: the next node that
// computes something (the bias's reshape to [1, 1, OC, 1] computes nothing), when it adds a
// [1, 1, OC, 1] tensor to the convolution, which nothing else reads. Its index, or -1.
static int sdfarm_conv2d_bias_node(const ggml_cgraph * cgraph, int i) {
    const ggml_tensor * conv = cgraph->nodes[i];
    const int j = sdfarm_next_computing(cgraph, i + 1);
    if (conv->op != GGML_OP_CONV_2D || j >= cgraph->n_nodes) {
        return -1;
    }
    const ggml_tensor * add = cgraph->nodes[j];
    const ggml_tensor * b = add->src[1];
    const bool fuse = add->op == GGML_OP_ADD && add->src[0] == conv && b != nullptr && ggml_are_same_shape(add, conv) &&
                      (add->flags & GGML_TENSOR_FLAG_COMPUTE) != 0 && sdfarm_one_use(cgraph, i, nullptr) &&
                      b->ne[0] == 1 && b->ne[1] == 1 && b->ne[2] == conv->ne[2] && b->ne[3] == 1;
    return fuse ? j : -1;
}

// The most workspace one convolution's algorithm may take: half again the bytes of its f16
// input and output, plus 64 MiB. cuDNN's tensor-core algorithms read NHWC, so the fastest for
// our NCHW tensors transposes both into its workspace (1.0-1.3x of input + output for the
// VAE's shapes on the H200, bench/cudnn_check.cpp). With a fixed 64 MiB the VAE's large
// convolutions took slower algorithms and images were 2-3x slower than im2col's (docs/gpu.md).
// native/estimate.py counts it (CUDNN_DECODE_BYTES_PER_PIXEL, CUDNN_WORKSPACE_FIXED_BYTES).
static size_t sdfarm_cudnn_max_workspace(int64_t in_elems, int64_t out_elems) {
    return (size_t) (3 * (in_elems + out_elems)) + ((size_t) 64 << 20);
}
#endif

#ifdef __CUDACC__
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

// SDFARM_CUDNN_TRACE=1: every cuDNN step on stderr, and a native backtrace on a crash.
static bool sdfarm_cudnn_tracing() {
    static const bool on = [] {
        const char * v = getenv("SDFARM_CUDNN_TRACE");
        return v != nullptr && v[0] == '1';
    }();
    return on;
}

#define SDFARM_CUDNN_TRACE(...)                   \
    do {                                          \
        if (sdfarm_cudnn_tracing()) {             \
            fprintf(stderr, "sdfarm cudnn: " __VA_ARGS__); \
            fflush(stderr);                       \
        }                                         \
    } while (0)

static void sdfarm_cudnn_on_crash(int sig) {
    void * frames[64];
    const int n = backtrace(frames, 64);
    fprintf(stderr, "sdfarm cudnn: signal %d, backtrace:\n", sig);
    backtrace_symbols_fd(frames, n, 2);
    // and every library mapped, once each: which of them could answer libstdc++'s symbols
    if (FILE * maps = fopen("/proc/self/maps", "r")) {
        char line[1024], last[1024] = "";
        while (fgets(line, sizeof line, maps)) {
            const char * path = strchr(line, '/');
            if (path != nullptr && strstr(path, ".so") != nullptr && strcmp(path, last) != 0) {
                fprintf(stderr, "sdfarm cudnn: mapped %s", path);
                snprintf(last, sizeof last, "%s", path);
            }
        }
        fclose(maps);
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

// The part of cudnn.h (cuDNN 9, legacy convolution API) this uses, declared here so the build
// needs no cuDNN headers. Values are cudnn_graph.h / cudnn_cnn.h's.
typedef struct sdfarm_cudnn_ctx * sdfarm_cudnn_handle;
typedef struct sdfarm_cudnn_tensor * sdfarm_cudnn_tensor_desc;
typedef struct sdfarm_cudnn_filter * sdfarm_cudnn_filter_desc;
typedef struct sdfarm_cudnn_conv * sdfarm_cudnn_conv_desc;

enum {
    SDFARM_CUDNN_STATUS_SUCCESS     = 0,
    SDFARM_CUDNN_DATA_FLOAT         = 0,
    SDFARM_CUDNN_DATA_HALF          = 2,
    SDFARM_CUDNN_TENSOR_NCHW        = 0,
    SDFARM_CUDNN_CROSS_CORRELATION  = 1,
    SDFARM_CUDNN_TENSOR_OP_MATH     = 1,
};

struct sdfarm_cudnn_algo_perf {  // cudnnConvolutionFwdAlgoPerf_t
    int    algo;
    int    status;
    float  time;
    size_t memory;
    int    determinism;
    int    math_type;
    int    reserved[3];
};

struct sdfarm_cudnn_api {
    int (*create)(sdfarm_cudnn_handle *);
    int (*set_stream)(sdfarm_cudnn_handle, cudaStream_t);
    int (*create_tensor)(sdfarm_cudnn_tensor_desc *);
    int (*set_tensor_4d)(sdfarm_cudnn_tensor_desc, int format, int type, int n, int c, int h, int w);
    int (*create_filter)(sdfarm_cudnn_filter_desc *);
    int (*set_filter_4d)(sdfarm_cudnn_filter_desc, int type, int format, int k, int c, int h, int w);
    int (*create_conv)(sdfarm_cudnn_conv_desc *);
    int (*set_conv_2d)(sdfarm_cudnn_conv_desc, int pad_h, int pad_w, int u, int v, int dil_h,
                       int dil_w, int mode, int compute_type);
    int (*set_conv_math)(sdfarm_cudnn_conv_desc, int math);
    int (*get_algo_v7)(sdfarm_cudnn_handle, sdfarm_cudnn_tensor_desc, sdfarm_cudnn_filter_desc,
                       sdfarm_cudnn_conv_desc, sdfarm_cudnn_tensor_desc, int requested, int * returned,
                       sdfarm_cudnn_algo_perf * perf);
    int (*find_algo)(sdfarm_cudnn_handle, sdfarm_cudnn_tensor_desc, sdfarm_cudnn_filter_desc,
                     sdfarm_cudnn_conv_desc, sdfarm_cudnn_tensor_desc, int requested, int * returned,
                     sdfarm_cudnn_algo_perf * perf);
    int (*workspace_size)(sdfarm_cudnn_handle, sdfarm_cudnn_tensor_desc, sdfarm_cudnn_filter_desc,
                          sdfarm_cudnn_conv_desc, sdfarm_cudnn_tensor_desc, int algo, size_t * bytes);
    int (*forward)(sdfarm_cudnn_handle, const void * alpha, sdfarm_cudnn_tensor_desc, const void * x,
                   sdfarm_cudnn_filter_desc, const void * w, sdfarm_cudnn_conv_desc, int algo,
                   void * workspace, size_t workspace_bytes, const void * beta,
                   sdfarm_cudnn_tensor_desc, void * y);
    const char * (*error_string)(int);
};

// The cuDNN functions, or nullptr when it is off or did not load (said once).
static const sdfarm_cudnn_api * sdfarm_cudnn() {
    static const sdfarm_cudnn_api * api = []() -> const sdfarm_cudnn_api * {
        const char * env = getenv("SDFARM_CUDNN");
        if (env == nullptr || env[0] == '\0' || strcmp(env, "0") == 0) {
            return nullptr;  // experimental: only where the operator named a library
        }
        const std::string lib = env;
        if (sdfarm_cudnn_tracing()) {
            signal(SIGSEGV, sdfarm_cudnn_on_crash);
        }
        SDFARM_CUDNN_TRACE("opening %s\n", lib.c_str());
        // RTLD_LOCAL: the shim opens its sub-libraries from its own folder.
        void * h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (h == nullptr) {
            GGML_LOG_WARN("sdfarm: cuDNN (%s) did not load (%s): ggml's direct convolution runs\n",
                          lib.c_str(), dlerror());
            return nullptr;
        }
        static sdfarm_cudnn_api a;
        bool ok = true;
        auto sym = [&](auto & fn, const char * name) {
            fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
            ok = ok && fn != nullptr;
        };
        sym(a.create, "cudnnCreate");
        sym(a.set_stream, "cudnnSetStream");
        sym(a.create_tensor, "cudnnCreateTensorDescriptor");
        sym(a.set_tensor_4d, "cudnnSetTensor4dDescriptor");
        sym(a.create_filter, "cudnnCreateFilterDescriptor");
        sym(a.set_filter_4d, "cudnnSetFilter4dDescriptor");
        sym(a.create_conv, "cudnnCreateConvolutionDescriptor");
        sym(a.set_conv_2d, "cudnnSetConvolution2dDescriptor");
        sym(a.set_conv_math, "cudnnSetConvolutionMathType");
        sym(a.get_algo_v7, "cudnnGetConvolutionForwardAlgorithm_v7");
        sym(a.workspace_size, "cudnnGetConvolutionForwardWorkspaceSize");
        sym(a.forward, "cudnnConvolutionForward");
        sym(a.error_string, "cudnnGetErrorString");
        a.find_algo = reinterpret_cast<decltype(a.find_algo)>(dlsym(h, "cudnnFindConvolutionForwardAlgorithm"));
        if (!ok) {
            GGML_LOG_WARN("sdfarm: %s lacks cuDNN 9's convolution API: ggml's direct convolution runs\n",
                          lib.c_str());
            return nullptr;
        }
        GGML_LOG_INFO("sdfarm: convolutions through cuDNN (%s)\n", lib.c_str());
        return &a;
    }();
    return api;
}

// One convolution's shape: what its descriptors and its algorithm depend on.
typedef std::tuple<int, int, int, int, int, int, int, int, int, int, int, int, int, int> sdfarm_conv_shape;

struct sdfarm_conv_plan {
    sdfarm_cudnn_tensor_desc x, y;
    sdfarm_cudnn_filter_desc w;
    sdfarm_cudnn_conv_desc   conv;
    int                      algo;
    size_t                   workspace;
};

static void sdfarm_cudnn_fail(const sdfarm_cudnn_api * a, int status, const char * what) {
    static bool said = false;
    if (!said) {
        said = true;
        GGML_LOG_WARN("sdfarm: cuDNN refused a convolution (%s: %s): ggml's direct convolution runs it\n",
                      what, a->error_string(status));
    }
}

// The plan of a shape on `device`, made once (descriptors and the first algorithm cuDNN's
// heuristics rank that needs at most sdfarm_cudnn_max_workspace), or nullptr.
static const sdfarm_conv_plan * sdfarm_cudnn_plan(const sdfarm_cudnn_api * a, sdfarm_cudnn_handle h,
                                                  int device, const sdfarm_conv_shape & s) {
    static std::mutex mu;
    static std::map<std::pair<int, sdfarm_conv_shape>, sdfarm_conv_plan> plans;
    std::lock_guard<std::mutex> lock(mu);
    const auto key = std::make_pair(device, s);
    auto it = plans.find(key);
    if (it != plans.end()) {
        return &it->second;
    }
    const auto [N, IC, IH, IW, OC, KH, KW, OH, OW, PH, PW, SH, SW, DH] = s;
    const int DW = DH;  // ggml's CONV_2D gives both; the caller refuses them unequal
    const size_t max_ws = sdfarm_cudnn_max_workspace((int64_t) N * IC * IH * IW, (int64_t) N * OC * OH * OW);
    sdfarm_conv_plan p = {};
    int st = a->create_tensor(&p.x);
    st = st ? st : a->set_tensor_4d(p.x, SDFARM_CUDNN_TENSOR_NCHW, SDFARM_CUDNN_DATA_HALF, N, IC, IH, IW);
    st = st ? st : a->create_tensor(&p.y);
    st = st ? st : a->set_tensor_4d(p.y, SDFARM_CUDNN_TENSOR_NCHW, SDFARM_CUDNN_DATA_HALF, N, OC, OH, OW);
    st = st ? st : a->create_filter(&p.w);
    st = st ? st : a->set_filter_4d(p.w, SDFARM_CUDNN_DATA_HALF, SDFARM_CUDNN_TENSOR_NCHW, OC, IC, KH, KW);
    st = st ? st : a->create_conv(&p.conv);
    st = st ? st : a->set_conv_2d(p.conv, PH, PW, SH, SW, DH, DW, SDFARM_CUDNN_CROSS_CORRELATION,
                                  SDFARM_CUDNN_DATA_FLOAT);
    st = st ? st : a->set_conv_math(p.conv, SDFARM_CUDNN_TENSOR_OP_MATH);
    if (st != SDFARM_CUDNN_STATUS_SUCCESS) {
        sdfarm_cudnn_fail(a, st, "descriptors");
        return nullptr;
    }
    const char * forced = getenv("SDFARM_CUDNN_ALGO");
    if (forced != nullptr && forced[0] >= '0' && forced[0] <= '9') {
        p.algo = atoi(forced);
        st = a->workspace_size(h, p.x, p.w, p.conv, p.y, p.algo, &p.workspace);
        SDFARM_CUDNN_TRACE("algorithm %d (SDFARM_CUDNN_ALGO): %d, %zu bytes\n", p.algo, st, p.workspace);
        if (st == SDFARM_CUDNN_STATUS_SUCCESS && p.workspace <= max_ws) {
            return &plans.emplace(key, p).first->second;
        }
        sdfarm_cudnn_fail(a, st, "SDFARM_CUDNN_ALGO");
        return nullptr;
    }
    sdfarm_cudnn_algo_perf perf[16];
    int n = 0;
    SDFARM_CUDNN_TRACE("plan N%d IC%d %dx%d -> OC%d %dx%d k%dx%d pad %d,%d stride %d,%d dil %d\n", N, IC, IH, IW,
                       OC, OH, OW, KH, KW, PH, PW, SH, SW, DH);
    // SDFARM_CUDNN_FIND=1 times every algorithm once (cudnnFind: it allocates their
    // workspaces itself and synchronizes) and ranks them by time, where the heuristics rank
    // by a model of the GPU: for measurement.
    const char * find = getenv("SDFARM_CUDNN_FIND");
    if (find != nullptr && find[0] == '1' && a->find_algo != nullptr) {
        st = a->find_algo(h, p.x, p.w, p.conv, p.y, 16, &n, perf);
    } else {
        st = a->get_algo_v7(h, p.x, p.w, p.conv, p.y, 16, &n, perf);
    }
    SDFARM_CUDNN_TRACE("algo_v7 %d: %d algorithms, first %d (status %d, %zu bytes)\n", st, n, n > 0 ? perf[0].algo : -1,
                       n > 0 ? perf[0].status : -1, n > 0 ? perf[0].memory : (size_t) 0);
    if (st != SDFARM_CUDNN_STATUS_SUCCESS) {
        sdfarm_cudnn_fail(a, st, "algorithm");
        return nullptr;
    }
    for (int k = 0; k < n; k++) {
        if (perf[k].status == SDFARM_CUDNN_STATUS_SUCCESS && perf[k].memory <= max_ws) {
            p.algo      = perf[k].algo;
            p.workspace = perf[k].memory;
            SDFARM_CUDNN_TRACE("chose algorithm %d (rank %d, %zu bytes, %.3f ms)\n", p.algo, k, p.workspace,
                               perf[k].time);
            return &plans.emplace(key, p).first->second;
        }
    }
    sdfarm_cudnn_fail(a, 0, "no algorithm within the workspace");
    return nullptr;
}

static sdfarm_cudnn_handle sdfarm_cudnn_handle_for(const sdfarm_cudnn_api * a, int device) {
    static std::mutex mu;
    static sdfarm_cudnn_handle handles[GGML_CUDA_MAX_DEVICES] = {};
    std::lock_guard<std::mutex> lock(mu);
    if (handles[device] == nullptr) {
        SDFARM_CUDNN_TRACE("cudnnCreate on device %d\n", device);
        const int st = a->create(&handles[device]);
        SDFARM_CUDNN_TRACE("cudnnCreate: %d\n", st);
        if (st != SDFARM_CUDNN_STATUS_SUCCESS) {
            handles[device] = nullptr;
            sdfarm_cudnn_fail(a, st, "cudnnCreate");
        }
    }
    return handles[device];
}

// dst = float(y) (+ bias[c]) over an N x C x plane tensor; blockIdx.y walks the N x C planes.
static __global__ void sdfarm_cudnn_out_kernel(const half * y, float * dst, const float * bias,
                                               int64_t plane, int64_t channels, int64_t planes) {
    for (int64_t pc = blockIdx.y; pc < planes; pc += gridDim.y) {
        const float b = bias != nullptr ? bias[pc % channels] : 0.0f;
        const half * src = y + pc * plane;
        float * out = dst + pc * plane;
        for (int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x; i < plane;
             i += (int64_t) gridDim.x * blockDim.x) {
            out[i] = bias != nullptr ? __fadd_rn(__half2float(src[i]), b) : __half2float(src[i]);
        }
    }
}

// The convolution of `conv` (a GGML_OP_CONV_2D node) through cuDNN into `out`, plus `bias`
// ([1, 1, OC, 1] f32) when given. False, having launched nothing, where cuDNN is off or
// refuses it (the caller then runs ggml's kernel).
static bool sdfarm_cudnn_conv2d(ggml_backend_cuda_context & ctx, const ggml_tensor * conv, ggml_tensor * out,
                                const ggml_tensor * bias) {
    const sdfarm_cudnn_api * a = sdfarm_cudnn();
    if (a == nullptr) {
        return false;
    }
    const ggml_tensor * kernel = conv->src[0];
    const ggml_tensor * input  = conv->src[1];
    const int32_t * p = (const int32_t *) conv->op_params;
    if ((kernel->type != GGML_TYPE_F16 && kernel->type != GGML_TYPE_F32) || input->type != GGML_TYPE_F32 ||
            out->type != GGML_TYPE_F32 || !ggml_is_contiguous(kernel) || !ggml_is_contiguous(input) ||
            !ggml_is_contiguous(out) || p[6] != 0 || p[4] != p[5]) {
        return false;
    }
    if (bias != nullptr && (bias->type != GGML_TYPE_F32 || !ggml_is_contiguous(bias) ||
            ggml_nelements(bias) != kernel->ne[3])) {
        return false;
    }
    const int64_t dims[] = {input->ne[0], input->ne[1], input->ne[2], input->ne[3], conv->ne[0], conv->ne[1],
                            kernel->ne[3], kernel->ne[0], kernel->ne[1]};
    for (int64_t d : dims) {
        if (d < 1 || d > INT32_MAX) {
            return false;
        }
    }
    if (ggml_nelements(input) > INT32_MAX || ggml_nelements(conv) > INT32_MAX) {
        return false;  // cuDNN's 4-d descriptors count elements in int
    }
    const int N = input->ne[3], IC = input->ne[2], IH = input->ne[1], IW = input->ne[0];
    const int OC = kernel->ne[3], KH = kernel->ne[1], KW = kernel->ne[0];
    const int OH = conv->ne[1], OW = conv->ne[0];
    const sdfarm_conv_shape shape{N, IC, IH, IW, OC, KH, KW, OH, OW, p[3], p[2], p[1], p[0], p[4]};
    sdfarm_cudnn_handle h = sdfarm_cudnn_handle_for(a, ctx.device);
    const sdfarm_conv_plan * plan = h != nullptr ? sdfarm_cudnn_plan(a, h, ctx.device, shape) : nullptr;
    if (plan == nullptr) {
        return false;
    }
    cudaStream_t stream = ctx.stream();
    ggml_cuda_pool & pool = ctx.pool();
    ggml_cuda_pool_alloc<half> x16(pool, ggml_nelements(input));
    ggml_get_to_fp16_cuda(GGML_TYPE_F32)(input->data, x16.get(), ggml_nelements(input), stream);
    ggml_cuda_pool_alloc<half> w16(pool);
    const half * w = (const half *) kernel->data;
    if (kernel->type == GGML_TYPE_F32) {
        w16.alloc(ggml_nelements(kernel));
        ggml_get_to_fp16_cuda(GGML_TYPE_F32)(kernel->data, w16.get(), ggml_nelements(kernel), stream);
        w = w16.get();
    }
    ggml_cuda_pool_alloc<half> y16(pool, ggml_nelements(conv));
    ggml_cuda_pool_alloc<char> ws(pool, plan->workspace > 0 ? plan->workspace : 1);
    const float one = 1.0f, zero = 0.0f;
    SDFARM_CUDNN_TRACE("forward algo %d ws %zu x %p w %p y %p\n", plan->algo, plan->workspace, (void *) x16.get(),
                       (const void *) w, (void *) y16.get());
    int st = a->set_stream(h, stream);
    st = st ? st : a->forward(h, &one, plan->x, x16.get(), plan->w, w, plan->conv, plan->algo, ws.get(),
                              plan->workspace, &zero, plan->y, y16.get());
    SDFARM_CUDNN_TRACE("forward: %d\n", st);
    if (st != SDFARM_CUDNN_STATUS_SUCCESS) {
        sdfarm_cudnn_fail(a, st, "cudnnConvolutionForward");
        return false;
    }
    const int64_t plane = (int64_t) OH * OW, planes = (int64_t) N * OC;
    const int threads = 256;
    const int64_t bx = (plane + threads - 1) / threads;
    const dim3 grid((unsigned) (bx < 64 ? bx : 64), (unsigned) (planes < 65535 ? planes : 65535), 1);
    sdfarm_cudnn_out_kernel<<<grid, threads, 0, stream>>>(y16.get(), (float *) out->data,
                                                           bias ? (const float *) bias->data : nullptr, plane, OC,
                                                           planes);
    CUDA_CHECK(cudaGetLastError());
    return true;
}

// The convolution at node i and the bias add after it (sdfarm_conv2d_bias_node), tried by the
// graph loop of ggml-cuda.cu. Returns the index of the add, whose tensor it wrote, or -1
// (nothing launched; the loop goes on at i, and ggml_cuda_op_conv2d tries cuDNN alone).
int sdfarm_conv2d_fuse(ggml_backend_cuda_context & ctx, ggml_cgraph * cgraph, int i) {
    const int j = sdfarm_conv2d_bias_node(cgraph, i);
    if (j < 0) {
        return -1;
    }
    ggml_tensor * add = cgraph->nodes[j];
    if (!sdfarm_cudnn_conv2d(ctx, cgraph->nodes[i], add, add->src[1])) {
        return -1;
    }
    return j;
}
#endif
