/* See sdfarm_shim.h for why this exists. */
#include "sdfarm_shim.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "ggml.h"
#include "stable-diffusion.h"

#define DEFAULT_CAPACITY (256 * 1024)
#define HEADER_SIZE sizeof(sdf_record_header_t)

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *g_ring = NULL;
static size_t g_cap = 0;
static size_t g_head = 0; /* where the next record is written */
static size_t g_tail = 0; /* oldest record */
static size_t g_used = 0;
static uint64_t g_next_seq = 1;
static uint64_t g_dropped = 0;
static int g_min_level = SDF_LOG_ERROR;
static int g_last_ggml_level = SDF_LOG_INFO;

static int g_step = 0, g_steps = 0;
static float g_time = 0.0f;
static uint64_t g_updates = 0;

/* Previews have their own lock: a frame's copy never holds up a log record. */
static pthread_mutex_t g_prev_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_prev_mode = SDF_PREVIEW_NONE;
static int g_prev_every = 0;
static int g_prev_side = 256;
static int g_prev_on = 0;          /* whether the runtime's preview is on for the next step */
static uint8_t *g_prev_buf = NULL; /* the latest frame, RGB, g_prev_side^2 * 3 bytes */
static uint8_t *g_prev_work = NULL; /* the frame being downscaled (the runtime's thread only) */
static uint32_t g_prev_w = 0, g_prev_h = 0;
static int g_prev_step = 0, g_prev_steps = 0;
static uint64_t g_prev_seq = 0;   /* frames stored since the last configure */
static uint64_t g_prev_taken = 0; /* seq of the last frame fetched */
static uint64_t g_prev_overwritten = 0;
static uint64_t g_prev_ignored = 0;

static void ring_read(size_t pos, void *dst, size_t n) {
    size_t first = g_cap - pos < n ? g_cap - pos : n;
    memcpy(dst, g_ring + pos, first);
    if (n > first) memcpy((uint8_t *)dst + first, g_ring, n - first);
}

static void ring_write(size_t pos, const void *src, size_t n) {
    size_t first = g_cap - pos < n ? g_cap - pos : n;
    memcpy(g_ring + pos, src, first);
    if (n > first) memcpy(g_ring, (const uint8_t *)src + first, n - first);
}

static void ensure_ring_locked(void) {
    if (g_ring == NULL) {
        g_cap = DEFAULT_CAPACITY;
        g_ring = (uint8_t *)malloc(g_cap);
        if (g_ring == NULL) g_cap = 0;
    }
}

static void drop_oldest_locked(void) {
    sdf_record_header_t h;
    ring_read(g_tail, &h, HEADER_SIZE);
    size_t n = HEADER_SIZE + h.len;
    g_tail = (g_tail + n) % g_cap;
    g_used -= n;
    g_dropped++;
}

static void record(int level, int source, const char *text) {
    if (text == NULL) return;
    size_t len = strlen(text);
    while (len > 0 && (text[len - 1] == '\n' || text[len - 1] == '\r')) len--;
    pthread_mutex_lock(&g_lock);
    ensure_ring_locked();
    if (level < g_min_level || g_cap <= HEADER_SIZE) {
        pthread_mutex_unlock(&g_lock);
        return;
    }
    if (HEADER_SIZE + len > g_cap) len = g_cap - HEADER_SIZE; /* one record never exceeds the ring */
    while (g_cap - g_used < HEADER_SIZE + len) drop_oldest_locked();
    sdf_record_header_t h = {g_next_seq++, (uint32_t)len, (uint8_t)level, (uint8_t)source, 0};
    ring_write(g_head, &h, HEADER_SIZE);
    ring_write((g_head + HEADER_SIZE) % g_cap, text, len);
    g_head = (g_head + HEADER_SIZE + len) % g_cap;
    g_used += HEADER_SIZE + len;
    pthread_mutex_unlock(&g_lock);
}

static void on_sd_log(enum sd_log_level_t level, const char *text, void *data) {
    (void)data;
    record((int)level, SDF_SOURCE_SD, text);
}

static void on_ggml_log(enum ggml_log_level level, const char *text, void *data) {
    (void)data;
    int lv;
    switch (level) {
        case GGML_LOG_LEVEL_DEBUG: lv = SDF_LOG_DEBUG; break;
        case GGML_LOG_LEVEL_WARN: lv = SDF_LOG_WARN; break;
        case GGML_LOG_LEVEL_ERROR: lv = SDF_LOG_ERROR; break;
        case GGML_LOG_LEVEL_CONT: lv = g_last_ggml_level; break;
        default: lv = SDF_LOG_INFO; break;
    }
    g_last_ggml_level = lv;
    record(lv, SDF_SOURCE_GGML, text);
}

static void on_preview(int step, int frame_count, sd_image_t *frames, bool is_noisy, void *data);

/* With every > 1, turn the runtime's preview on only for the step that comes next when it is
 * one we want. sd.cpp reads its `denoised` flag at every step on the thread that samples, and
 * reports progress (step 0 before the first, then each step) on that same thread. */
static void preview_follow_step(int step) {
    pthread_mutex_lock(&g_prev_lock);
    int mode = g_prev_mode, every = g_prev_every, change = 0, want = 0;
    if (mode != SDF_PREVIEW_NONE && every > 1 && step >= 0) {
        want = (step + 1) % every == 0;
        change = want != g_prev_on;
        g_prev_on = want;
    }
    pthread_mutex_unlock(&g_prev_lock);
    if (change) sd_set_preview_callback(on_preview, (enum preview_t)mode, every, want, false, NULL);
}

static void on_progress(int step, int steps, float time, void *data) {
    (void)data;
    pthread_mutex_lock(&g_lock);
    g_step = step;
    g_steps = steps;
    g_time = time;
    g_updates++;
    pthread_mutex_unlock(&g_lock);
    preview_follow_step(step);
}

/* Box-average `src` (w x h, `channels` bytes a pixel) into `dst` as RGB, dw x dh. */
static void downscale(const uint8_t *src, uint32_t w, uint32_t h, uint32_t channels, uint8_t *dst,
                      uint32_t dw, uint32_t dh) {
    for (uint32_t y = 0; y < dh; y++) {
        uint32_t y0 = (uint32_t)((uint64_t)y * h / dh), y1 = (uint32_t)((uint64_t)(y + 1) * h / dh);
        if (y1 <= y0) y1 = y0 + 1;
        for (uint32_t x = 0; x < dw; x++) {
            uint32_t x0 = (uint32_t)((uint64_t)x * w / dw);
            uint32_t x1 = (uint32_t)((uint64_t)(x + 1) * w / dw);
            if (x1 <= x0) x1 = x0 + 1;
            uint64_t sum[3] = {0, 0, 0};
            for (uint32_t sy = y0; sy < y1; sy++) {
                const uint8_t *row = src + ((size_t)sy * w) * channels;
                for (uint32_t sx = x0; sx < x1; sx++) {
                    const uint8_t *px = row + (size_t)sx * channels;
                    for (int c = 0; c < 3; c++) sum[c] += px[channels >= 3 ? c : 0];
                }
            }
            uint64_t n = (uint64_t)(y1 - y0) * (x1 - x0);
            uint8_t *out = dst + ((size_t)y * dw + x) * 3;
            for (int c = 0; c < 3; c++) out[c] = (uint8_t)((sum[c] + n / 2) / n);
        }
    }
}

static void on_preview(int step, int frame_count, sd_image_t *frames, bool is_noisy, void *data) {
    (void)is_noisy;
    (void)data;
    pthread_mutex_lock(&g_prev_lock);
    int every = g_prev_every, side = g_prev_side;
    uint8_t *work = g_prev_work;
    int wanted = g_prev_mode != SDF_PREVIEW_NONE && every > 0 && step > 0 && step % every == 0;
    int usable = frames != NULL && frame_count > 0 && frames[0].data != NULL &&
                 frames[0].width > 0 && frames[0].height > 0 && frames[0].channel > 0;
    if (!wanted || !usable || work == NULL) g_prev_ignored++;
    pthread_mutex_unlock(&g_prev_lock);
    if (!wanted || !usable || work == NULL) return;

    /* The runtime frees the frames when this returns: copy now, outside the lock (only this
     * thread writes `work`; configure never runs during a generation). */
    uint32_t w = frames[0].width, h = frames[0].height, m = w > h ? w : h;
    uint32_t dw = w, dh = h;
    if (m > (uint32_t)side) {
        dw = (uint32_t)((uint64_t)w * side / m);
        dh = (uint32_t)((uint64_t)h * side / m);
        if (dw == 0) dw = 1;
        if (dh == 0) dh = 1;
    }
    downscale(frames[0].data, w, h, frames[0].channel, work, dw, dh);

    pthread_mutex_lock(&g_lock);
    int steps = g_steps;
    pthread_mutex_unlock(&g_lock);
    pthread_mutex_lock(&g_prev_lock);
    if (g_prev_buf != NULL && g_prev_work == work) {
        memcpy(g_prev_buf, work, (size_t)dw * dh * 3);
        if (g_prev_seq > g_prev_taken) g_prev_overwritten++;
        g_prev_seq++;
        g_prev_w = dw;
        g_prev_h = dh;
        g_prev_step = step;
        g_prev_steps = steps;
    }
    pthread_mutex_unlock(&g_prev_lock);
}

void sdf_preview_configure(int mode, int every, int max_side) {
    if (mode < SDF_PREVIEW_NONE || mode > SDF_PREVIEW_VAE || every <= 0) mode = SDF_PREVIEW_NONE;
    if (mode == SDF_PREVIEW_NONE) every = 0;
    if (max_side < 8) max_side = 8;
    if (max_side > 4096) max_side = 4096;
    size_t bytes = (size_t)max_side * max_side * 3;
    pthread_mutex_lock(&g_prev_lock);
    if (mode != SDF_PREVIEW_NONE && (g_prev_buf == NULL || max_side != g_prev_side)) {
        free(g_prev_buf);
        free(g_prev_work);
        g_prev_buf = (uint8_t *)malloc(bytes);
        g_prev_work = (uint8_t *)malloc(bytes);
        if (g_prev_buf == NULL || g_prev_work == NULL) {
            free(g_prev_buf);
            free(g_prev_work);
            g_prev_buf = g_prev_work = NULL;
            mode = SDF_PREVIEW_NONE;
            every = 0;
        }
    }
    g_prev_mode = mode;
    g_prev_every = every;
    g_prev_side = max_side;
    g_prev_on = every == 1;
    g_prev_seq = g_prev_taken = 0;
    g_prev_overwritten = g_prev_ignored = 0;
    g_prev_w = g_prev_h = 0;
    g_prev_step = g_prev_steps = 0;
    pthread_mutex_unlock(&g_prev_lock);
    if (mode == SDF_PREVIEW_NONE)
        sd_set_preview_callback(NULL, PREVIEW_NONE, 1, false, false, NULL);
    else
        sd_set_preview_callback(on_preview, (enum preview_t)mode, every, every == 1, false, NULL);
}

void sdf_preview_config(int *mode, int *every, int *max_side) {
    pthread_mutex_lock(&g_prev_lock);
    *mode = g_prev_mode;
    *every = g_prev_every;
    *max_side = g_prev_side;
    pthread_mutex_unlock(&g_prev_lock);
}

size_t sdf_preview_get(uint64_t *seq, int *step, int *steps, uint32_t *width, uint32_t *height,
                       uint8_t *out, size_t out_cap, uint64_t *overwritten, uint64_t *ignored) {
    size_t n = 0;
    pthread_mutex_lock(&g_prev_lock);
    size_t have = (size_t)g_prev_w * g_prev_h * 3;
    if (g_prev_seq > g_prev_taken && g_prev_buf != NULL && have <= out_cap) {
        memcpy(out, g_prev_buf, have);
        n = have;
        g_prev_taken = g_prev_seq;
        *seq = g_prev_seq;
        *step = g_prev_step;
        *steps = g_prev_steps;
        *width = g_prev_w;
        *height = g_prev_h;
        *overwritten = g_prev_overwritten;
        *ignored = g_prev_ignored;
        g_prev_overwritten = 0;
        g_prev_ignored = 0;
    }
    pthread_mutex_unlock(&g_prev_lock);
    return n;
}

void sdf_preview_test_frames(int n, uint32_t width, uint32_t height, int channels) {
    if (channels < 1 || channels > 4 || width == 0 || height == 0) return;
    uint8_t *data = (uint8_t *)malloc((size_t)width * height * channels);
    if (data == NULL) return;
    for (int i = 1; i <= n; i++) {
        for (uint32_t y = 0; y < height; y++)
            for (uint32_t x = 0; x < width; x++)
                for (int c = 0; c < channels; c++)
                    data[((size_t)y * width + x) * channels + c] = (uint8_t)((x + y + i) % 256);
        sd_image_t frame = {width, height, (uint32_t)channels, data};
        on_preview(i, 1, &frame, false, NULL);
    }
    free(data);
}

void sdf_install(void) {
    sd_set_log_callback(on_sd_log, NULL);
    sd_set_progress_callback(on_progress, NULL);
    ggml_log_set(on_ggml_log, NULL);
}

void sdf_log_configure(size_t capacity, int min_level) {
    pthread_mutex_lock(&g_lock);
    free(g_ring);
    g_cap = capacity < HEADER_SIZE + 64 ? HEADER_SIZE + 64 : capacity;
    g_ring = (uint8_t *)malloc(g_cap);
    if (g_ring == NULL) g_cap = 0;
    g_head = g_tail = g_used = 0;
    g_dropped = 0;
    g_min_level = min_level > SDF_LOG_ERROR ? SDF_LOG_ERROR : min_level;
    pthread_mutex_unlock(&g_lock);
}

size_t sdf_log_drain(uint8_t *out, size_t out_cap, uint64_t *dropped) {
    size_t written = 0;
    pthread_mutex_lock(&g_lock);
    while (g_used > 0) {
        sdf_record_header_t h;
        ring_read(g_tail, &h, HEADER_SIZE);
        size_t n = HEADER_SIZE + h.len;
        if (written + n > out_cap) break;
        ring_read(g_tail, out + written, n);
        written += n;
        g_tail = (g_tail + n) % g_cap;
        g_used -= n;
    }
    if (dropped != NULL) {
        *dropped = g_dropped;
        g_dropped = 0;
    }
    pthread_mutex_unlock(&g_lock);
    return written;
}

size_t sdf_log_pending_bytes(void) {
    pthread_mutex_lock(&g_lock);
    size_t n = g_used;
    pthread_mutex_unlock(&g_lock);
    return n;
}

void sdf_log_test_flood(int n, int level) {
    char text[64];
    for (int i = 0; i < n; i++) {
        snprintf(text, sizeof text, "test.cpp:1    - flood record %d\n", i);
        record(level, SDF_SOURCE_SHIM, text);
    }
}

void sdf_progress_reset(void) {
    pthread_mutex_lock(&g_lock);
    g_step = g_steps = 0;
    g_time = 0.0f;
    g_updates = 0;
    pthread_mutex_unlock(&g_lock);
}

void sdf_progress_get(int *step, int *steps, float *time, uint64_t *updates) {
    pthread_mutex_lock(&g_lock);
    *step = g_step;
    *steps = g_steps;
    *time = g_time;
    *updates = g_updates;
    pthread_mutex_unlock(&g_lock);
}

size_t sdf_device_count(void) { return ggml_backend_dev_count(); }

int sdf_device_info(size_t index, char *name, size_t name_cap, char *desc, size_t desc_cap,
                    int *type, size_t *free_bytes, size_t *total_bytes) {
    if (index >= ggml_backend_dev_count()) return -1;
    ggml_backend_dev_t dev = ggml_backend_dev_get(index);
    snprintf(name, name_cap, "%s", ggml_backend_dev_name(dev));
    snprintf(desc, desc_cap, "%s", ggml_backend_dev_description(dev));
    *type = (int)ggml_backend_dev_type(dev);
    *free_bytes = 0;
    *total_bytes = 0;
    ggml_backend_dev_memory(dev, free_bytes, total_bytes);
    return 0;
}
