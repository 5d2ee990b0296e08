// Convolutions through cuDNN's legacy API, opened with dlopen as native/patches/conv2d_cudnn.cuh
// opens it, outside ggml and Python: the shapes where the runtime's process crashed (the
// UNet's 4 -> 320 and 320 -> 320 at 8x8, VAE-sized ones), every call's status printed, and 27
// outputs of each checked against a host convolution. A diagnostic for the GPU machine
// (bench/gpu_run.sh cudnnalone; ALGO=N forces an algorithm, LOCALE=X sets LC_CTYPE first;
// PRELOAD, CODECVT and DEEPBIND below reproduce parts of the runtime's process):
//   g++ -O1 -I/usr/local/cuda/include bench/cudnn_check.cpp -o /tmp/cudnn_check
//       -L/usr/local/cuda/lib64 -lcudart -ldl; /tmp/cudnn_check /path/to/libcudnn.so.9
// On the H200 (2026-12-02, cuDNN 9.19 of PyTorch 2.11 cu130) every shape ran and matched.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <clocale>
#include <cmath>
#include <codecvt>
#include <locale>
#include <string>
#include <cstdio>
#include <cstdlib>
#include <vector>

struct perf_t {
    int algo, status;
    float time;
    size_t memory;
    int determinism, math_type, reserved[3];
};

typedef int (*fn_create)(void **);
typedef int (*fn_p)(void *);
typedef int (*fn_stream)(void *, cudaStream_t);
typedef int (*fn_t4d)(void *, int, int, int, int, int, int);
typedef int (*fn_c2d)(void *, int, int, int, int, int, int, int, int);
typedef int (*fn_math)(void *, int);
typedef int (*fn_algo)(void *, void *, void *, void *, void *, int, int *, perf_t *);
typedef int (*fn_fwd)(void *, const void *, void *, const void *, void *, const void *, void *, int, void *, size_t,
                      const void *, void *, void *);

// Built with -DCUDNN_CHECK_LIBRARY -shared -fPIC, cudnn_check_main runs the same inside another
// process (bench/cudnn_check_in_python.py calls it from Python, after a CUDA engine if asked).
extern "C" int cudnn_check_main(int argc, char ** argv) {
    const char * lib = argc > 1 ? argv[1] : "libcudnn.so.9";
    if (getenv("LOCALE")) printf("setlocale: %s\n", setlocale(LC_CTYPE, getenv("LOCALE")));
    // PRELOAD=a.so:b.so opens those first (as the runtime's process has libstable-diffusion.so),
    // RTLD_GLOBAL with PRELOAD_GLOBAL=1; CODECVT=1 converts strings the way stable-diffusion.cpp's
    // tokenizer does (util.cpp) before cuDNN and between shapes; DEEPBIND=1 opens cuDNN's
    // sub-libraries and the shim with RTLD_DEEPBIND (each binds its own symbols first).
    if (const char * pre = getenv("PRELOAD")) {
        std::string all(pre);
        for (size_t a = 0; a < all.size();) {
            size_t b = all.find(':', a);
            if (b == std::string::npos) b = all.size();
            const std::string one = all.substr(a, b - a);
            void * d = dlopen(one.c_str(), RTLD_NOW | (getenv("PRELOAD_GLOBAL") ? RTLD_GLOBAL : RTLD_LOCAL));
            printf("preload %s: %s\n", one.c_str(), d ? "ok" : dlerror());
            a = b + 1;
        }
    }
    auto convert = [] {
        if (!getenv("CODECVT")) return;
        std::wstring_convert<std::codecvt_utf8<char32_t>, char32_t> c;
        std::u32string u = c.from_bytes("a photo of a cat, \xc3\xa9t\xc3\xa9");
        printf("codecvt: %zu code points, %zu bytes back\n", u.size(), c.to_bytes(u).size());
    };
    convert();
    int flags = RTLD_NOW | RTLD_LOCAL;
    if (getenv("DEEPBIND")) {
        flags |= RTLD_DEEPBIND;
        std::string dir(lib);
        dir = dir.substr(0, dir.rfind('/') + 1);
        for (const char * sub : {"libcudnn_graph.so.9", "libcudnn_engines_runtime_compiled.so.9",
                                 "libcudnn_engines_precompiled.so.9", "libcudnn_heuristic.so.9",
                                 "libcudnn_ops.so.9", "libcudnn_cnn.so.9"}) {
            void * d = dlopen((dir + sub).c_str(), flags);
            printf("deepbind %s: %s\n", sub, d ? "ok" : dlerror());
        }
    }
    void * h = dlopen(lib, flags);
    if (!h) { printf("dlopen: %s\n", dlerror()); return 1; }
    auto S = [&](const char * n) { void * p = dlsym(h, n); printf("%s %p\n", n, p); fflush(stdout); return p; };
    auto create = (fn_create) S("cudnnCreate");
    auto set_stream = (fn_stream) S("cudnnSetStream");
    auto ct = (fn_create) S("cudnnCreateTensorDescriptor");
    auto st4 = (fn_t4d) S("cudnnSetTensor4dDescriptor");
    auto cf = (fn_create) S("cudnnCreateFilterDescriptor");
    auto sf4 = (fn_t4d) S("cudnnSetFilter4dDescriptor");
    auto cc = (fn_create) S("cudnnCreateConvolutionDescriptor");
    auto sc2 = (fn_c2d) S("cudnnSetConvolution2dDescriptor");
    auto sm = (fn_math) S("cudnnSetConvolutionMathType");
    auto ga = (fn_algo) S("cudnnGetConvolutionForwardAlgorithm_v7");
    auto fwd = (fn_fwd) S("cudnnConvolutionForward");
    void * handle = nullptr;
    cudaStream_t stream;
    cudaStreamCreate(&stream);
    printf("create %d\n", create(&handle)); fflush(stdout);
    printf("set_stream %d\n", set_stream(handle, stream)); fflush(stdout);
    const int forced = getenv("ALGO") ? atoi(getenv("ALGO")) : -1;
    // the shapes of stable-diffusion.cpp's UNet check and the VAE at 512: C -> K at H x W
    const int shapes[][4] = {{4, 320, 8, 8}, {320, 320, 8, 8}, {128, 128, 256, 256}, {256, 256, 512, 512}};
    for (const auto & sh : shapes) {
        convert();
        const int N = 1, C = sh[0], K = sh[1], H = sh[2], W = sh[3];
        void *x = nullptr, *y = nullptr, *w = nullptr, *cv = nullptr;
        int r[9];
        r[0] = ct(&x); r[1] = st4(x, 0, 2, N, C, H, W); r[2] = ct(&y); r[3] = st4(y, 0, 2, N, K, H, W);
        r[4] = cf(&w); r[5] = sf4(w, 2, 0, K, C, 3, 3); r[6] = cc(&cv); r[7] = sc2(cv, 1, 1, 1, 1, 1, 1, 1, 0);
        r[8] = sm(cv, 1);
        printf("shape %d->%d %dx%d: descriptors", C, K, H, W);
        for (int v : r) printf(" %d", v);
        printf("\n"); fflush(stdout);
        perf_t perf[16];
        int n = 0, algo = forced;
        size_t wsz = 0;
        if (forced < 0) {
            const int st = ga(handle, x, w, cv, y, 16, &n, perf);
            printf("  algo_v7 %d n=%d:", st, n);
            for (int i = 0; i < n; i++) printf(" [%d st%d %zuB]", perf[i].algo, perf[i].status, perf[i].memory);
            printf("\n"); fflush(stdout);
            for (int i = 0; i < n; i++) if (perf[i].status == 0) { algo = perf[i].algo; wsz = perf[i].memory; break; }
        }
        std::vector<__half> hx((size_t) N * C * H * W), hw((size_t) K * C * 9), hy((size_t) N * K * H * W);
        for (size_t i = 0; i < hx.size(); i++) hx[i] = __float2half(std::sin(0.1f * i));
        for (size_t i = 0; i < hw.size(); i++) hw[i] = __float2half(std::cos(0.07f * i) * 0.05f);
        __half *dx, *dw, *dy;
        void * ws = nullptr;
        cudaMalloc(&dx, hx.size() * 2); cudaMalloc(&dw, hw.size() * 2); cudaMalloc(&dy, hy.size() * 2);
        cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice);
        cudaMemcpy(dw, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice);
        if (wsz) cudaMalloc(&ws, wsz);
        const float one = 1.0f, zero = 0.0f;
        printf("  forward algo %d ws %zu ...", algo, wsz); fflush(stdout);
        const int fst = fwd(handle, &one, x, dx, w, dw, cv, algo, ws, wsz, &zero, y, dy);
        printf(" %d, sync %d\n", fst, (int) cudaStreamSynchronize(stream)); fflush(stdout);
        cudaMemcpy(hy.data(), dy, hy.size() * 2, cudaMemcpyDeviceToHost);
        double worst = 0;
        for (int k : {0, K / 2, K - 1}) for (int yy : {0, H / 2, H - 1}) for (int xx : {0, W / 2, W - 1}) {
            double s = 0;
            for (int c = 0; c < C; c++) for (int rr = 0; rr < 3; rr++) for (int q = 0; q < 3; q++) {
                int iy = yy + rr - 1, ix = xx + q - 1;
                if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
                s += (double) __half2float(hx[((size_t) c * H + iy) * W + ix]) *
                     __half2float(hw[(((size_t) k * C + c) * 3 + rr) * 3 + q]);
            }
            double got = __half2float(hy[((size_t) k * H + yy) * W + xx]);
            worst = std::fmax(worst, std::fabs(got - s) / (1 + std::fabs(s)));
        }
        printf("  worst relative error %.3g: %s\n", worst, worst < 1e-2 ? "ok" : "WRONG"); fflush(stdout);
        cudaFree(dx); cudaFree(dw); cudaFree(dy); if (ws) cudaFree(ws);
    }
    return 0;
}

#ifndef CUDNN_CHECK_LIBRARY
int main(int argc, char ** argv) {
    return cudnn_check_main(argc, argv);
}
#endif
