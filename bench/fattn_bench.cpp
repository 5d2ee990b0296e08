// Times ggml's CUDA flash attention (GGML_OP_FLASH_ATTN_EXT) at the shapes the SD 2.x UNet of
// stable-diffusion.cpp gives it (ggml_ext_attention_ext: Q f32, K and V cast to f16, head
// size 64, the cross-attention's 77 keys padded to 256 under a -inf mask), so that the
// kernel's configuration can be compared with PyTorch's SDPA at the same shapes
// (bench/fattn_torch.py) without a whole image around it.
//
//   fattn_bench [reps] [dump.bin]   prints one JSON line per case; with dump.bin, writes the
//                                  outputs of the first case (to compare two builds' values)
//
// Built by `bash bench/gpu_run.sh fattn` against the pinned ggml.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cuda.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

struct Case {
    const char * name;
    int lq, lk, heads, per_unet_512, per_unet_1024;
    bool cross;
};

// Self- and cross-attention per UNet call of SD 2.x (attention at the latent's first three
// levels, 2 down and 3 up blocks each, and the middle block), for a 64x64 (512 px) and a
// 128x128 (1024 px) latent. The counts say which cases a 512 or a 1024 image has.
static const Case CASES[] = {
    {"self 16384 x 5 heads",  16384, 16384,  5, 0, 5, false},
    {"self 4096 x 10 heads",   4096,  4096, 10, 0, 5, false},
    {"self 1024 x 20 heads",   1024,  1024, 20, 0, 5, false},
    {"self 256 x 20 heads",     256,   256, 20, 5, 1, false},
    {"self 4096 x 5 heads",    4096,  4096,  5, 5, 0, false},
    {"self 1024 x 10 heads",   1024,  1024, 10, 5, 0, false},
    {"self 64 x 20 heads",       64,    64, 20, 1, 0, false},
    {"cross 16384 x 5 heads", 16384,   256,  5, 0, 5, true},
    {"cross 4096 x 10 heads",  4096,   256, 10, 0, 5, true},
    {"cross 1024 x 20 heads",  1024,   256, 20, 0, 5, true},
    {"cross 256 x 20 heads",    256,   256, 20, 5, 1, true},
    {"cross 4096 x 5 heads",   4096,   256,  5, 5, 0, true},
    {"cross 1024 x 10 heads",  1024,   256, 10, 5, 0, true},
    {"cross 64 x 20 heads",      64,   256, 20, 1, 0, true},
};

static void fill(ggml_tensor * t, std::mt19937 & rng, float lo, float hi) {
    std::uniform_real_distribution<float> u(lo, hi);
    const int64_t n = ggml_nelements(t);
    if (t->type == GGML_TYPE_F32) {
        std::vector<float> v(n);
        for (auto & x : v) x = u(rng);
        ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
    } else {
        std::vector<ggml_fp16_t> v(n);
        for (auto & x : v) x = ggml_fp32_to_fp16(u(rng));
        ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
    }
}

int main(int argc, char ** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 20;
    const char * dump = argc > 2 ? argv[2] : nullptr;
    ggml_backend_t backend = ggml_backend_cuda_init(0);
    if (!backend) { fprintf(stderr, "no CUDA backend\n"); return 1; }
    const int d = 64;
    double unet_ms[2] = {0, 0};
    bool first = true;
    for (const Case & c : CASES) {
        ggml_init_params ip = {ggml_tensor_overhead() * 16 + ggml_graph_overhead(), nullptr, true};
        ggml_context * ctx = ggml_init(ip);
        ggml_tensor * q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, c.lq, c.heads);
        ggml_tensor * k = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, d, c.lk, c.heads);
        ggml_tensor * v = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, d, c.lk, c.heads);
        ggml_tensor * m = c.cross ? ggml_new_tensor_2d(ctx, GGML_TYPE_F16, c.lk, c.lq) : nullptr;
        ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, m, 1.0f / std::sqrt((float) d), 0, 0);
        ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
        ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, out);
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
        std::mt19937 rng(1234);
        fill(q, rng, -1.f, 1.f);
        fill(k, rng, -1.f, 1.f);
        fill(v, rng, -1.f, 1.f);
        if (m) {  // 77 real keys, the rest masked, as stable-diffusion.cpp pads them
            std::vector<ggml_fp16_t> mv((size_t) c.lk * c.lq);
            for (int i = 0; i < c.lq; ++i)
                for (int j = 0; j < c.lk; ++j)
                    mv[(size_t) i * c.lk + j] = ggml_fp32_to_fp16(j < 77 ? 0.0f : -INFINITY);
            ggml_backend_tensor_set(m, mv.data(), 0, ggml_nbytes(m));
        }
        for (int i = 0; i < 3; ++i) ggml_backend_graph_compute(backend, gf);
        ggml_backend_synchronize(backend);
        // Rounds of back-to-back calls, one synchronisation a round: the kernels' time, not
        // a launch and a wait per call.
        std::vector<double> ms;
        const int per_round = std::max(1, reps / 5);
        for (int r = 0; r < 5; ++r) {
            auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < per_round; ++i) ggml_backend_graph_compute_async(backend, gf);
            ggml_backend_synchronize(backend);
            ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / per_round);
        }
        std::sort(ms.begin(), ms.end());
        const double med = ms[ms.size() / 2];
        const int nk = c.cross ? 77 : c.lk;  // the work a padded key does not add
        const double flop = 4.0 * c.lq * (double) nk * d * c.heads;
        printf("{\"case\": \"%s\", \"lq\": %d, \"lk\": %d, \"heads\": %d, \"ms\": %.4f, \"min_ms\": %.4f, "
               "\"tflops\": %.1f, \"per_unet_512\": %d, \"per_unet_1024\": %d}\n",
               c.name, c.lq, c.lk, c.heads, med, ms.front(), flop / med / 1e9, c.per_unet_512, c.per_unet_1024);
        unet_ms[0] += med * c.per_unet_512;
        unet_ms[1] += med * c.per_unet_1024;
        if (dump && first) {
            std::vector<float> o(ggml_nelements(out));
            ggml_backend_tensor_get(out, o.data(), 0, ggml_nbytes(out));
            FILE * f = fopen(dump, "wb");
            if (f) { fwrite(o.data(), sizeof(float), o.size(), f); fclose(f); }
        }
        first = false;
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }
    printf("{\"case\": \"per UNet call\", \"ms_512\": %.3f, \"ms_1024\": %.3f}\n", unet_ms[0], unet_ms[1]);
    ggml_backend_free(backend);
    return 0;
}
