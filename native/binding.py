"""The cffi binding: our shim plus the parts of sd.cpp's C API the engine calls.

API mode: the C compiler reads the runtime's own header, so the `...;` struct declarations
below get the real layouts of master-596 and can never drift from them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

CDEF = """
typedef struct sd_ctx_t sd_ctx_t;
typedef struct { uint32_t width; uint32_t height; uint32_t channel; uint8_t* data; } sd_image_t;
enum sample_method_t { EULER_SAMPLE_METHOD, SAMPLE_METHOD_COUNT, ... };
enum scheduler_t { DISCRETE_SCHEDULER, SCHEDULER_COUNT, ... };
enum rng_type_t { STD_DEFAULT_RNG, CUDA_RNG, CPU_RNG, RNG_TYPE_COUNT };
enum sd_type_t { SD_TYPE_COUNT, ... };
enum lora_apply_mode_t { LORA_APPLY_AUTO, LORA_APPLY_IMMEDIATELY, LORA_APPLY_AT_RUNTIME, ... };
typedef struct { bool is_high_noise; float multiplier; const char* path; } sd_lora_t;
typedef struct { const char* name; const char* path; } sd_embedding_t;

typedef struct {
    const char* model_path;
    const char* clip_l_path;
    const char* clip_g_path;
    const char* t5xxl_path;
    const char* llm_path;
    const char* diffusion_model_path;
    const char* vae_path;
    const char* taesd_path;
    const char* control_net_path;
    const sd_embedding_t* embeddings;
    uint32_t embedding_count;
    bool vae_decode_only;
    bool free_params_immediately;
    int n_threads;
    enum rng_type_t rng_type;
    bool offload_params_to_cpu;
    bool enable_mmap;
    bool keep_clip_on_cpu;
    bool keep_control_net_on_cpu;
    bool keep_vae_on_cpu;
    bool tae_preview_only;
    bool flash_attn;
    bool diffusion_flash_attn;
    bool diffusion_conv_direct;
    bool vae_conv_direct;
    float max_vram;
    enum lora_apply_mode_t lora_apply_mode;
    const char* high_noise_diffusion_model_path;
    const char* clip_vision_path;
    ...;
} sd_ctx_params_t;

typedef struct {
    float txt_cfg;
    float img_cfg;
    float distilled_guidance;
    ...;
} sd_guidance_params_t;
typedef struct {
    sd_guidance_params_t guidance;
    enum scheduler_t scheduler;
    enum sample_method_t sample_method;
    int sample_steps;
    float eta;
    float flow_shift;
    ...;
} sd_sample_params_t;
typedef struct {
    bool enabled;
    int tile_size_x;
    int tile_size_y;
    float target_overlap;
    float rel_size_x;
    float rel_size_y;
} sd_tiling_params_t;
enum sd_cache_mode_t { SD_CACHE_DISABLED, ... };
typedef struct { enum sd_cache_mode_t mode; ...; } sd_cache_params_t;
enum sd_hires_upscaler_t { SD_HIRES_UPSCALER_NONE, SD_HIRES_UPSCALER_LATENT,
                           SD_HIRES_UPSCALER_MODEL, ... };
typedef struct {
    bool enabled;
    enum sd_hires_upscaler_t upscaler;
    const char* model_path;
    float scale;
    int target_width;
    int target_height;
    int steps;
    float denoising_strength;
    int upscale_tile_size;
    ...;
} sd_hires_params_t;
typedef struct {
    const sd_lora_t* loras;
    uint32_t lora_count;
    const char* prompt;
    const char* negative_prompt;
    int clip_skip;
    sd_image_t init_image;
    sd_image_t* ref_images;
    int ref_images_count;
    sd_image_t mask_image;
    int width;
    int height;
    sd_sample_params_t sample_params;
    float strength;
    int64_t seed;
    int batch_count;
    sd_image_t control_image;
    float control_strength;
    sd_tiling_params_t vae_tiling_params;
    sd_cache_params_t cache;
    sd_hires_params_t hires;
    ...;
} sd_img_gen_params_t;

typedef struct {
    const sd_lora_t* loras;
    uint32_t lora_count;
    const char* prompt;
    const char* negative_prompt;
    int clip_skip;
    sd_image_t init_image;
    sd_image_t end_image;
    int width;
    int height;
    sd_sample_params_t sample_params;
    sd_sample_params_t high_noise_sample_params;
    float moe_boundary;
    float strength;
    int64_t seed;
    int video_frames;
    sd_tiling_params_t vae_tiling_params;
    sd_cache_params_t cache;
    ...;
} sd_vid_gen_params_t;
void sd_vid_gen_params_init(sd_vid_gen_params_t* sd_vid_gen_params);
sd_image_t* generate_video(sd_ctx_t* sd_ctx, const sd_vid_gen_params_t* sd_vid_gen_params,
                           int* num_frames_out);
bool sd_ctx_supports_image_generation(const sd_ctx_t* sd_ctx);
bool sd_ctx_supports_video_generation(const sd_ctx_t* sd_ctx);

typedef struct upscaler_ctx_t upscaler_ctx_t;
upscaler_ctx_t* new_upscaler_ctx(const char* esrgan_path, bool offload_params_to_cpu, bool direct,
                                 int n_threads, int tile_size);
void free_upscaler_ctx(upscaler_ctx_t* upscaler_ctx);
sd_image_t upscale(upscaler_ctx_t* upscaler_ctx, sd_image_t input_image, uint32_t upscale_factor);
int get_upscale_factor(upscaler_ctx_t* upscaler_ctx);

void sd_ctx_params_init(sd_ctx_params_t* sd_ctx_params);
sd_ctx_t* new_sd_ctx(const sd_ctx_params_t* sd_ctx_params);
void free_sd_ctx(sd_ctx_t* sd_ctx);
void sd_img_gen_params_init(sd_img_gen_params_t* sd_img_gen_params);
sd_image_t* generate_image(sd_ctx_t* sd_ctx, const sd_img_gen_params_t* sd_img_gen_params);
const char* sd_version(void);
const char* sd_commit(void);
const char* sd_get_system_info(void);
int32_t sd_get_num_physical_cores(void);
const char* sd_sample_method_name(enum sample_method_t sample_method);
const char* sd_scheduler_name(enum scheduler_t scheduler);
const char* sd_type_name(enum sd_type_t type);
bool convert(const char* input_path, const char* vae_path, const char* output_path,
             enum sd_type_t output_type, const char* tensor_type_rules, bool convert_name);
void free(void* ptr);

typedef struct {
    uint64_t seq;
    uint32_t len;
    uint8_t level;
    uint8_t source;
    uint16_t reserved;
} sdf_record_header_t;
void sdf_install(void);
void sdf_log_configure(size_t capacity, int min_level);
size_t sdf_log_drain(uint8_t* out, size_t out_cap, uint64_t* dropped);
size_t sdf_log_pending_bytes(void);
void sdf_log_test_flood(int n, int level);
void sdf_progress_reset(void);
void sdf_progress_get(int* step, int* steps, float* time, uint64_t* updates);
void sdf_preview_configure(int mode, int every, int max_side);
void sdf_preview_config(int* mode, int* every, int* max_side);
size_t sdf_preview_get(uint64_t* seq, int* step, int* steps, uint32_t* width, uint32_t* height,
                       uint8_t* out, size_t out_cap, uint64_t* overwritten, uint64_t* ignored);
void sdf_preview_test_frames(int n, uint32_t width, uint32_t height, int channels);
size_t sdf_device_count(void);
int sdf_device_info(size_t index, char* name, size_t name_cap, char* desc, size_t desc_cap,
                    int* type, size_t* free_bytes, size_t* total_bytes);
"""

SHIM_DIR = Path(__file__).resolve().parent / "shim"
MODULE_NAME = "_sdfarm_native"
_loaded: dict[str, Any] = {}


def make_ffibuilder(libdir: Path) -> Any:
    """The cffi builder for our module, linked against the runtime in `libdir` with an
    $ORIGIN-relative rpath (the module is installed in a subfolder of libdir)."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        MODULE_NAME,
        '#include <stdlib.h>\n#include "stable-diffusion.h"\n#include "sdfarm_shim.h"\n',
        sources=[str(SHIM_DIR / "sdfarm_shim.c")],
        include_dirs=[str(libdir / "include"), str(SHIM_DIR)],
        library_dirs=[str(libdir)],
        libraries=["stable-diffusion"],
        extra_compile_args=["-O2", "-std=c11"],
        extra_link_args=["-Wl,-rpath,$ORIGIN/..", "-lpthread"]
        if sys.platform != "darwin"
        else ["-Wl,-rpath,@loader_path/.."],
    )
    return ffi


def load(backend: str | None = None) -> tuple[Any, Any]:
    """Return (ffi, lib) for the runtime of `backend` (default `$SDFARM_BACKEND` or cpu),
    building it on first use; with `$SDFARM_RUNTIME_DIR` set, the runtime built elsewhere in
    that folder instead (its backend must match one asked for). Installs the shim's callbacks
    before anything else runs, so ggml's device messages never reach stderr."""
    backend = backend or os.environ.get("SDFARM_BACKEND") or None
    prebuilt = os.environ.get("SDFARM_RUNTIME_DIR")
    if backend is None and not prebuilt:
        backend = "cpu"
    if backend is not None and backend in _loaded:
        return _loaded[backend]
    if _loaded:
        raise RuntimeError(f"the {next(iter(_loaded))} runtime is already loaded in this process")
    from sdfarm.native.build import MODULE_NAME as _name
    from sdfarm.native.build import BuildError, ensure_runtime, prebuilt_runtime

    if prebuilt:
        build = prebuilt_runtime(prebuilt)
        if backend is not None and build.backend != backend:
            raise BuildError(
                f"SDFARM_RUNTIME_DIR={prebuilt} holds a {build.backend} build, not {backend} "
                f"(unset one of SDFARM_RUNTIME_DIR or SDFARM_BACKEND)"
            )
        backend = build.backend
    else:
        assert backend is not None
        build = ensure_runtime(backend)
    path = next(Path(build.module_dir).glob(_name + "*"))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.lib.sdf_install()
    _loaded[backend] = (module.ffi, module.lib)
    return module.ffi, module.lib
