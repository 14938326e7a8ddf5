/*
 * Decode attention read straight from the paged KV cache, float32, on the CPU.
 *
 * One query token per request attends to that request's context through its block table.
 * Keys and values are read in place, once each: no gathered copy of the context is made,
 * which is what bounds the plain-torch path (a gather writes and re-reads every byte).
 * A task is one request (or, when there are fewer requests than threads, a share of its kv
 * heads); each token row is read once for all the task's query heads.
 *
 * Scores are computed first, then a softmax normalised the same way as torch's, then the
 * weighted sum of values: the same order of operations as the reference, so the rounding
 * differs only in the order of additions.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "thread_pool.c"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define PREFETCH_DISTANCE 8 /* tokens ahead; measured best of 0, 2, 4, 8, 16 */

ALWAYS_INLINE float dot(const float *restrict a, const float *restrict b, const int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

/* Start of token t's row (all kv heads) in a cache laid out [blocks, block_size, kv_heads, head_dim]. */
ALWAYS_INLINE const float *token_row(const float *cache, const int64_t *block_table, int64_t t,
                                     int64_t block_size, int64_t token_stride) {
    return cache + (block_table[t / block_size] * block_size + t % block_size) * token_stride;
}

/* Asks for token t's row ahead of its use: blocks are scattered, so the hardware prefetcher
 * alone stalls at every block boundary. */
ALWAYS_INLINE void prefetch_row(const float *cache, const int64_t *block_table, int64_t t, int64_t length,
                                int64_t block_size, int64_t token_stride, int64_t head_offset, int64_t width) {
    if (t >= length) return;
    const char *row = (const char *)(token_row(cache, block_table, t, block_size, token_stride) + head_offset);
    for (int64_t byte = 0; byte < width * (int64_t)sizeof(float); byte += 64) __builtin_prefetch(row + byte, 0, 3);
}

/*
 * Attention of one request's query heads of kv heads [h0, h1). Each token's row is read once
 * for all those heads, so reads are sequential within a block. head_dim and group are
 * compile-time constants in the specialised callers below, so the compiler unrolls the inner
 * loops. scores holds (h1 - h0) * group * n floats, acc (h1 - h0) * group * head_dim.
 */
ALWAYS_INLINE void attend_one(
    const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
    const int64_t *restrict block_table, int64_t first, int64_t length, int64_t block_size,
    int64_t num_kv_heads, int64_t h0, int64_t h1, const int64_t head_dim, const int64_t group, float scale,
    float *restrict out, float *restrict scores, float *restrict acc) {
    const int64_t n = length - first, rows = (h1 - h0) * group;
    const int64_t token_stride = num_kv_heads * head_dim, head_offset = h0 * head_dim;

    const int64_t width = (h1 - h0) * head_dim;
    for (int64_t t = first; t < length; ++t) {
        prefetch_row(k_cache, block_table, t + PREFETCH_DISTANCE, length, block_size, token_stride, head_offset, width);
        const float *k = token_row(k_cache, block_table, t, block_size, token_stride) + head_offset;
        for (int64_t h = 0; h < h1 - h0; ++h)
            for (int64_t j = 0; j < group; ++j)
                scores[(h * group + j) * n + (t - first)] =
                    dot(q + (h * group + j) * head_dim, k + h * head_dim, head_dim) * scale;
    }

    for (int64_t row = 0; row < rows; ++row) {
        float *s = scores + row * n;
        float peak = s[0];
        for (int64_t i = 1; i < n; ++i) peak = s[i] > peak ? s[i] : peak;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < n; ++i) {
            s[i] = expf(s[i] - peak);
            total += s[i];
        }
        const float inverse = 1.0f / total;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) s[i] *= inverse;
    }

    for (int64_t i = 0; i < rows * head_dim; ++i) acc[i] = 0.0f;
    for (int64_t t = first; t < length; ++t) {
        prefetch_row(v_cache, block_table, t + PREFETCH_DISTANCE, length, block_size, token_stride, head_offset, width);
        const float *v = token_row(v_cache, block_table, t, block_size, token_stride) + head_offset;
        for (int64_t h = 0; h < h1 - h0; ++h)
            for (int64_t j = 0; j < group; ++j) {
                const float w = scores[(h * group + j) * n + (t - first)];
                float *a = acc + (h * group + j) * head_dim;
                const float *vh = v + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += w * vh[d];
            }
    }
    for (int64_t i = 0; i < rows * head_dim; ++i) out[i] = acc[i];
}

typedef void (*attend_fn)(const float *, const float *, const float *, const int64_t *, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float *, float *, float *);

#define SPECIALISE(D, G)                                                                              \
    static void attend_d##D##_g##G(const float *q, const float *k_cache, const float *v_cache,         \
                                   const int64_t *block_table, int64_t first, int64_t length,          \
                                   int64_t block_size, int64_t num_kv_heads, int64_t h0, int64_t h1,   \
                                   int64_t head_dim, int64_t group, float scale, float *out,           \
                                   float *scores, float *acc) {                                        \
        (void)head_dim, (void)group;                                                                   \
        attend_one(q, k_cache, v_cache, block_table, first, length, block_size, num_kv_heads, h0, h1,  \
                   D, G, scale, out, scores, acc);                                                     \
    }

SPECIALISE(64, 1)
SPECIALISE(64, 2)
SPECIALISE(64, 3)
SPECIALISE(64, 4)
SPECIALISE(64, 8)
SPECIALISE(128, 1)
SPECIALISE(128, 2)
SPECIALISE(128, 3)
SPECIALISE(128, 4)
SPECIALISE(128, 8)

static void attend_any(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_table,
                       int64_t first, int64_t length, int64_t block_size, int64_t num_kv_heads, int64_t h0,
                       int64_t h1, int64_t head_dim, int64_t group, float scale, float *out, float *scores,
                       float *acc) {
    attend_one(q, k_cache, v_cache, block_table, first, length, block_size, num_kv_heads, h0, h1, head_dim,
               group, scale, out, scores, acc);
}

static attend_fn pick(int64_t head_dim, int64_t group) {
    static const attend_fn d64[] = {0, attend_d64_g1, attend_d64_g2, attend_d64_g3, attend_d64_g4, 0, 0, 0, attend_d64_g8};
    static const attend_fn d128[] = {0, attend_d128_g1, attend_d128_g2, attend_d128_g3, attend_d128_g4, 0, 0, 0, attend_d128_g8};
    attend_fn fn = 0;
    if (group >= 1 && group <= 8) fn = head_dim == 64 ? d64[group] : head_dim == 128 ? d128[group] : 0;
    return fn ? fn : attend_any;
}

/*
 * q:            [num_requests, num_heads, head_dim], rows q_row_stride apart, heads contiguous
 * k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 * block_tables: [num_requests, max_blocks], int64
 * lengths:      [num_requests], context length including the new token
 * out:          [num_requests, num_heads * head_dim], rows out_row_stride apart
 * window:       sliding window in tokens, 0 for none
 * Returns 0, or -1 when scratch memory could not be allocated.
 */
static int64_t longest_length(const int64_t *lengths, int64_t num_requests) {
    int64_t longest = 1;
    for (int64_t r = 0; r < num_requests; ++r) longest = lengths[r] > longest ? lengths[r] : longest;
    return longest;
}

/* One call's inputs, for its tasks (a task: one request's share of kv heads). k_cache, v_cache:
 * float or int8 rows; codes: the 8-bit cache's code values (NULL for float); per_slot: scratch
 * floats of each thread, scores first (`scores` of them), then the accumulator. */
typedef struct {
    const float *q;
    int64_t q_row_stride;
    const void *k_cache, *v_cache;
    const int64_t *block_tables;
    int64_t max_blocks;
    const int64_t *lengths;
    int64_t splits, heads_per_task, group, num_kv_heads, head_dim, block_size, window;
    float scale;
    float *out;
    int64_t out_row_stride;
    float *scratch;
    size_t per_slot, scores;
    const float *codes;
    attend_fn attend;
} attention_args;

/* The task's request, its first kv head and the first key it sees. */
ALWAYS_INLINE void task_span(const attention_args *a, int64_t task, int64_t *r, int64_t *h0, int64_t *first) {
    *r = task / a->splits;
    *h0 = (task % a->splits) * a->heads_per_task;
    const int64_t length = a->lengths[*r];
    *first = a->window > 0 && length > a->window ? length - a->window : 0;
}

static void attention_task_f32(void *ctx, int64_t task, int slot) {
    const attention_args *a = ctx;
    int64_t r, h0, first;
    task_span(a, task, &r, &h0, &first);
    float *scratch = a->scratch + (size_t)slot * a->per_slot;
    a->attend(a->q + r * a->q_row_stride + h0 * a->group * a->head_dim, a->k_cache, a->v_cache,
              a->block_tables + r * a->max_blocks, first, a->lengths[r], a->block_size, a->num_kv_heads, h0,
              h0 + a->heads_per_task, a->head_dim, a->group, a->scale,
              a->out + r * a->out_row_stride + h0 * a->group * a->head_dim, scratch, scratch + a->scores);
}

/* Tasks per request: with few requests, each one's kv heads split over tasks so every thread has work. */
static int64_t head_splits(int num_threads, int64_t num_requests, int64_t num_kv_heads) {
    int64_t splits = num_threads > 1 ? (4 * num_threads + num_requests - 1) / num_requests : 1;
    if (splits > num_kv_heads) splits = num_kv_heads;
    while (num_kv_heads % splits) --splits;
    return splits;
}

/* Cuts a call into tasks (a request's share of kv heads each), gives each thread its scratch and
 * runs them on the pool; codes: an 8-bit cache's code values, NULL for a float cache. 0, or -1
 * when the scratch memory could not be allocated. */
static int run_attention(const float *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                         const int64_t *block_tables, int64_t max_blocks, const int64_t *lengths, int64_t num_requests,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
                         float scale, float *out, int64_t out_row_stride, int num_threads, const float *codes,
                         pool_task task) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t longest = longest_length(lengths, num_requests);
    const int64_t splits = head_splits(num_threads, num_requests, num_kv_heads);
    const int64_t heads_per_task = num_kv_heads / splits;
    const size_t rows = (size_t)(heads_per_task * group);
    const size_t per_slot = rows * (size_t)(longest + head_dim) + (codes ? (size_t)head_dim : 0); /* + widened row */
    float *scratch = malloc(sizeof(float) * per_slot * (size_t)(num_threads > 1 ? num_threads : 1));
    if (!scratch) return -1;
    attention_args args = {q, q_row_stride, k_cache, v_cache, block_tables, max_blocks, lengths, splits,
                           heads_per_task, group, num_kv_heads, head_dim, block_size, window, scale, out,
                           out_row_stride, scratch, per_slot, rows * (size_t)longest, codes,
                           codes ? NULL : pick(head_dim, group)};
    pool_run(num_requests * splits, task, &args, num_threads);
    free(scratch);
    return 0;
}

int paged_decode_attention_f32(
    const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *lengths, int64_t num_requests,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
    float scale, float *out, int64_t out_row_stride, int num_threads) {
    return run_attention(q, q_row_stride, k_cache, v_cache, block_tables, max_blocks, lengths, num_requests, num_heads,
                         num_kv_heads, head_dim, block_size, window, scale, out, out_row_stride, num_threads, NULL,
                         attention_task_f32);
}

/*
 * The same attention over an 8-bit cache (cluster/engine/quantization/kv_format.py): each token's
 * head row is head_dim codes then its float32 scale, x = scale * value(code). `codes` maps a
 * code byte to its value (int8 or e4m3fn), built once per call. Scores and weights are computed
 * as above; the scale multiplies each row's dot product and each value row's weight.
 */
#include <string.h>

ALWAYS_INLINE const int8_t *row8(const int8_t *cache, const int64_t *block_table, int64_t t, int64_t block_size,
                                 int64_t token_stride) {
    return cache + (block_table[t / block_size] * block_size + t % block_size) * token_stride;
}

ALWAYS_INLINE float row_scale(const int8_t *row, int64_t head_dim) {
    float scale;
    memcpy(&scale, row + head_dim, sizeof scale);
    return scale;
}

static void attend_one_8bit(const float *restrict q, const int8_t *restrict k_cache, const int8_t *restrict v_cache,
                            const int64_t *restrict block_table, int64_t first, int64_t length, int64_t block_size,
                            int64_t num_kv_heads, int64_t h0, int64_t h1, int64_t head_dim, int64_t group,
                            float scale, const float *restrict codes, float *restrict out, float *restrict scores,
                            float *restrict acc, float *restrict widened) {
    const int64_t n = length - first, rows = (h1 - h0) * group, row_width = head_dim + 4;
    const int64_t token_stride = num_kv_heads * row_width;
    for (int64_t t = first; t < length; ++t) {
        const int8_t *k = row8(k_cache, block_table, t, block_size, token_stride);
        for (int64_t h = 0; h < h1 - h0; ++h) {
            const int8_t *kh = k + (h0 + h) * row_width;
            for (int64_t d = 0; d < head_dim; ++d) widened[d] = codes[(uint8_t)kh[d]];
            const float row = row_scale(kh, head_dim) * scale;
            for (int64_t j = 0; j < group; ++j)
                scores[(h * group + j) * n + (t - first)] = dot(q + (h * group + j) * head_dim, widened, head_dim) * row;
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        float *s = scores + r * n;
        float peak = s[0];
        for (int64_t i = 1; i < n; ++i) peak = s[i] > peak ? s[i] : peak;
        float total = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
            s[i] = expf(s[i] - peak);
            total += s[i];
        }
        const float inverse = 1.0f / total;
        for (int64_t i = 0; i < n; ++i) s[i] *= inverse;
    }
    for (int64_t i = 0; i < rows * head_dim; ++i) acc[i] = 0.0f;
    for (int64_t t = first; t < length; ++t) {
        const int8_t *v = row8(v_cache, block_table, t, block_size, token_stride);
        for (int64_t h = 0; h < h1 - h0; ++h) {
            const int8_t *vh = v + (h0 + h) * row_width;
            const float row = row_scale(vh, head_dim);
            for (int64_t d = 0; d < head_dim; ++d) widened[d] = codes[(uint8_t)vh[d]] * row;
            for (int64_t j = 0; j < group; ++j) {
                const float w = scores[(h * group + j) * n + (t - first)];
                float *a = acc + (h * group + j) * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += w * widened[d];
            }
        }
    }
    for (int64_t i = 0; i < rows * head_dim; ++i) out[i] = acc[i];
}

static float e4m3fn_value(uint8_t byte) {
    const int exponent = (byte >> 3) & 15, mantissa = byte & 7;
    if (exponent == 15 && mantissa == 7) return NAN;
    const float magnitude = exponent ? ldexpf(1.0f + mantissa / 8.0f, exponent - 7) : ldexpf(mantissa / 8.0f, -6);
    return byte & 0x80 ? -magnitude : magnitude;
}

/* As paged_decode_attention_f32, over an 8-bit cache ([blocks, block_size, kv_heads, head_dim + 4]
 * int8); fp8 nonzero: codes are e4m3fn, else int8. */
static void attention_task_8bit(void *ctx, int64_t task, int slot) {
    const attention_args *a = ctx;
    int64_t r, h0, first;
    task_span(a, task, &r, &h0, &first);
    float *scratch = a->scratch + (size_t)slot * a->per_slot;
    attend_one_8bit(a->q + r * a->q_row_stride + h0 * a->group * a->head_dim, a->k_cache, a->v_cache,
                    a->block_tables + r * a->max_blocks, first, a->lengths[r], a->block_size, a->num_kv_heads, h0,
                    h0 + a->heads_per_task, a->head_dim, a->group, a->scale, a->codes,
                    a->out + r * a->out_row_stride + h0 * a->group * a->head_dim, scratch, scratch + a->scores,
                    scratch + a->scores + (size_t)(a->heads_per_task * a->group * a->head_dim));
}

int paged_decode_attention_8bit(
    const float *q, int64_t q_row_stride, const int8_t *k_cache, const int8_t *v_cache,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *lengths, int64_t num_requests,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
    float scale, int fp8, float *out, int64_t out_row_stride, int num_threads) {
    float codes[256];
    for (int b = 0; b < 256; ++b) codes[b] = fp8 ? e4m3fn_value((uint8_t)b) : (float)(int8_t)b;
    return run_attention(q, q_row_stride, k_cache, v_cache, block_tables, max_blocks, lengths, num_requests, num_heads,
                         num_kv_heads, head_dim, block_size, window, scale, out, out_row_stride, num_threads, codes,
                         attention_task_8bit);
}
