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

static void on_progress(int step, int steps, float time, void *data) {
    (void)data;
    pthread_mutex_lock(&g_lock);
    g_step = step;
    g_steps = steps;
    g_time = time;
    g_updates++;
    pthread_mutex_unlock(&g_lock);
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
