/* sdfarm's thin C layer over stable-diffusion.cpp (master-596).
 *
 * Why it exists: sd.cpp's log callback is not thread-safe and fires from loader threads, and
 * Python must never be called back from a native thread. So the shim owns the callbacks and
 * keeps what they report (a numbered ring of log records with a dropped counter, the latest
 * progress, the latest preview frame) behind a mutex; Python drains it between calls. It also
 * reads ggml's devices.
 */
#ifndef SDFARM_SHIM_H
#define SDFARM_SHIM_H

#include <stddef.h>
#include <stdint.h>

#define SDF_LOG_DEBUG 0
#define SDF_LOG_INFO 1
#define SDF_LOG_WARN 2
#define SDF_LOG_ERROR 3

#define SDF_SOURCE_SD 0
#define SDF_SOURCE_GGML 1
#define SDF_SOURCE_SHIM 2

/* Serialized record header written by sdf_log_drain, followed by `len` bytes of text. */
typedef struct {
    uint64_t seq;
    uint32_t len;
    uint8_t level;
    uint8_t source;
    uint16_t reserved;
} sdf_record_header_t;

/* Registers the shim's callbacks with sd.cpp and ggml. Idempotent; call before any device
 * query so ggml's device messages never reach stderr. */
void sdf_install(void);

/* Ring capacity in bytes (default 262144) and the lowest level recorded (errors are always
 * recorded: a failed load's reason comes from them). Clears the ring. */
void sdf_log_configure(size_t capacity, int min_level);
/* Copies whole records (header + text) into out, oldest first, removing them from the ring.
 * Returns the bytes written; *dropped gets the records lost to overflow since the last drain. */
size_t sdf_log_drain(uint8_t *out, size_t out_cap, uint64_t *dropped);
size_t sdf_log_pending_bytes(void);
/* Test hook: records n numbered records at `level` as if the runtime had logged them. */
void sdf_log_test_flood(int n, int level);

void sdf_progress_reset(void);
/* Latest progress reported by the runtime; *updates counts callbacks since the last reset. */
void sdf_progress_get(int *step, int *steps, float *time, uint64_t *updates);

/* Previews. sd.cpp calls its preview callback on the thread that runs generate_image, after
 * each sampling step it decodes a preview for, with frames it frees when the callback returns
 * (master-596: PROJ frames are the latent's size, TAE/VAE frames the image's size). The shim
 * copies the first frame, box-downscaled so its longest side is at most max_side, into one
 * slot that the next frame overwrites (counted). The runtime ignores its own `interval`
 * (it previews every step), so with every > 1 the shim's progress callback turns the
 * runtime's preview on only for the steps it wants: the decode of the other steps is never
 * paid. mode: SDF_PREVIEW_* (sd.cpp's preview_t); every 0 (or mode NONE) turns previews off. */
#define SDF_PREVIEW_NONE 0
#define SDF_PREVIEW_PROJ 1
#define SDF_PREVIEW_TAE 2
#define SDF_PREVIEW_VAE 3

void sdf_preview_configure(int mode, int every, int max_side);
/* The configuration as the runtime got it (a test reads each job parameter back). */
void sdf_preview_config(int *mode, int *every, int *max_side);
/* Copies the latest frame (RGB, width*height*3 bytes) into out when it is newer than the last
 * one fetched; returns the bytes copied, or 0 when there is none new (or out is too small).
 * *overwritten gets the frames replaced before anyone fetched them since the last fetch,
 * *ignored the runtime's callbacks the shim skipped (steps between the wanted ones, a
 * two-evaluation sampler's first evaluation). */
size_t sdf_preview_get(uint64_t *seq, int *step, int *steps, uint32_t *width, uint32_t *height,
                       uint8_t *out, size_t out_cap, uint64_t *overwritten, uint64_t *ignored);
/* Test hook: delivers n frames of width x height (pixel value = (x + y + step) % 256 in each
 * channel) for steps 1..n as if the runtime had called back. */
void sdf_preview_test_frames(int n, uint32_t width, uint32_t height, int channels);

size_t sdf_device_count(void);
/* Fills one device's facts; returns 0, or -1 for a bad index. type: 0 CPU, 1 GPU, 2 IGPU, 3 ACCEL. */
int sdf_device_info(size_t index, char *name, size_t name_cap, char *desc, size_t desc_cap,
                    int *type, size_t *free_bytes, size_t *total_bytes);

#endif
