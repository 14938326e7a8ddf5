/*
 * Decode attention read straight from the paged KV cache, float32, on the CPU.
 *
 * Each row (a query token) attends to its request's context through its block table. Keys and
 * values are read in place: no gathered copy of the context is made, which is what bounds the
 * plain-torch path (a gather writes and re-reads every byte). Consecutive rows that read the same
 * blocks (a speculative verify's rows, a prompt chunk's, each at its own length) form a group of
 * up to MAX_GROUP_ROWS, and the group reads each token's keys and values once for all its rows:
 * beyond a few hundred tokens of context a row's attention is bound by reading the cache (the
 * default model's 30 layers hold 1.5 KB a token), so a verify of 5 rows at 1,800 tokens read
 * 5 x 81 MB where it now reads 81 MB. A task is one group (or, when there are fewer groups than
 * threads, a share of its kv heads); each token row is read once for all the task's query heads.
 *
 * Scores are computed first, then a softmax normalised the same way as torch's, then the
 * weighted sum of values: the same order of operations as the reference, so the rounding
 * differs only in the order of additions. A row's arithmetic is the same whatever group it is in
 * (the same code, the same order over its tokens), so a row's result does not depend on the rows
 * beside it: a guess checked in a verify gets the bits a one-row decode step would.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

#define MAX_GROUP_ROWS 16 /* rows of a group: a verify's rows fit, a prompt chunk goes 16 rows at a time */

/* The first key a row of context length `length` sees. */
ALWAYS_INLINE int64_t first_key(int64_t length, int64_t window) {
    return window > 0 && length > window ? length - window : 0;
}

/* Each of a group's query rows (nrows rows of `rows` query heads, score_stride apart) softmaxed
 * over its row's keys, lengths[i] - first[i] of them, as torch normalises. */
static void softmax_rows(float *restrict scores, int64_t nrows, int64_t rows, int64_t score_stride,
                         const int64_t *restrict lengths, const int64_t *restrict first) {
    for (int64_t i = 0; i < nrows; ++i) {
        const int64_t n = lengths[i] - first[i];
        for (int64_t row = 0; row < rows; ++row) {
            float *s = scores + (i * rows + row) * score_stride;
            float peak = s[0];
            for (int64_t x = 1; x < n; ++x) peak = s[x] > peak ? s[x] : peak;
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t x = 0; x < n; ++x) {
                s[x] = expf(s[x] - peak);
                total += s[x];
            }
            const float inverse = 1.0f / total;
#pragma omp simd
            for (int64_t x = 0; x < n; ++x) s[x] *= inverse;
        }
    }
}

/* The first row of cache tokens [t, ...) that lie in t's block, and how many of them (up to `count`). */
ALWAYS_INLINE const float *block_run(const float *cache, const int64_t *block_table, int64_t t, int64_t count,
                                     int64_t block_size, int64_t token_stride, int64_t *run) {
    const int64_t b = t / block_size, offset = t - b * block_size;
    *run = block_size - offset < count ? block_size - offset : count;
    return cache + (block_table[b] * block_size + offset) * token_stride;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* Lane i of the result: the sum of p[i]'s 16 lanes, added in the same tree for every i (pairs of
 * lanes, then 128-bit quarters), so a dot product's rounding does not depend on its place. */
ALWAYS_INLINE __m512 sum_lanes16(const __m512 p[16]) {
    __m512 s1[8], s2[4];
    for (int i = 0; i < 8; ++i)
        s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2], s2[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(s2[2], s2[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* out[x] = scale * (q . k[x]) for the `count` (<= 16) key rows k, stride floats apart: each key's
 * products summed lane-wise over head_dim, then across lanes by sum_lanes16, sixteen keys at once
 * (one horizontal sum per key cost more than the products). */
ALWAYS_INLINE void scaled_dots(const float *restrict q, const float *restrict k, int64_t stride, int64_t count,
                               const int64_t head_dim, float scale, float *restrict out) {
    __m512 qv[8], p[16];
    for (int64_t c = 0; c < head_dim / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int64_t x = 0; x < 16; ++x) {
        if (x >= count) {
            p[x] = _mm512_setzero_ps();
            continue;
        }
        const float *kx = k + x * stride;
        __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kx));
        for (int64_t c = 1; c < head_dim / 16; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kx + 16 * c), a);
        p[x] = a;
    }
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << count) - 1), _mm512_mul_ps(sum_lanes16(p), _mm512_set1_ps(scale)));
}

/* acc[j] = sum over the row's keys t of w[j][t] * v[t], for the `group` query heads of one kv head
 * (w: their softmaxed scores, score_stride apart; v: the head's value rows), in registers, keys
 * in order: the same sums, in the same order, as the portable loop. */
ALWAYS_INLINE void weighted_values(const float *restrict w, int64_t score_stride, const float *restrict v_cache,
                                   const int64_t *restrict block_table, int64_t first, int64_t length,
                                   int64_t block_size, int64_t token_stride, const int64_t head_dim,
                                   const int64_t group, float *restrict out) {
    __m512 acc[8][8];
    for (int64_t j = 0; j < group; ++j)
        for (int64_t c = 0; c < head_dim / 16; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t t = first; t < length;) {
        int64_t run;
        const float *v = block_run(v_cache, block_table, t, length - t, block_size, token_stride, &run);
        for (int64_t x = 0; x < run; ++x, v += token_stride) {
            const float *wt = w + (t + x - first);
            for (int64_t j = 0; j < group; ++j) {
                const __m512 weight = _mm512_set1_ps(wt[j * score_stride]);
                for (int64_t c = 0; c < head_dim / 16; ++c)
                    acc[j][c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v + 16 * c), acc[j][c]);
            }
        }
        t += run;
    }
    for (int64_t j = 0; j < group; ++j)
        for (int64_t c = 0; c < head_dim / 16; ++c) _mm512_storeu_ps(out + j * head_dim + 16 * c, acc[j][c]);
}
#define SIMD_ATTENTION(head_dim, group) ((head_dim) % 16 == 0 && (head_dim) <= 128 && (group) <= 8)
#else
#define SIMD_ATTENTION(head_dim, group) 0
#endif

/*
 * Attention of a group's rows (nrows, each with its own length), query heads of kv heads [h0, h1).
 * Each token's row is read once for all the rows and heads, so reads are sequential within a
 * block. head_dim and group are compile-time constants in the specialised callers below, so the
 * compiler unrolls the inner loops. Row i's queries start at q + i * q_stride and its output at
 * out + i * out_stride; scores holds nrows * (h1 - h0) * group * score_stride floats (score_stride:
 * the longest row's tokens), acc nrows * (h1 - h0) * group * head_dim.
 */
ALWAYS_INLINE void attend_rows(
    const float *restrict q, int64_t q_stride, int64_t nrows, const int64_t *restrict lengths, int64_t window,
    const float *restrict k_cache, const float *restrict v_cache, const int64_t *restrict block_table,
    int64_t block_size, int64_t num_kv_heads, int64_t h0, int64_t h1, const int64_t head_dim, const int64_t group,
    float scale, float *restrict out, int64_t out_stride, float *restrict scores, int64_t score_stride,
    float *restrict acc) {
    const int64_t rows = (h1 - h0) * group; /* query heads per row */
    const int64_t token_stride = num_kv_heads * head_dim, head_offset = h0 * head_dim;
    int64_t first[MAX_GROUP_ROWS], lo = INT64_MAX, hi = 0;
    for (int64_t i = 0; i < nrows; ++i) {
        first[i] = first_key(lengths[i], window);
        lo = first[i] < lo ? first[i] : lo;
        hi = lengths[i] > hi ? lengths[i] : hi;
    }

    if (SIMD_ATTENTION(head_dim, group)) {
#if defined(__AVX512F__)
        for (int64_t t = lo; t < hi;) { /* up to 16 keys of one block at a time */
            int64_t run;
            const float *k = block_run(k_cache, block_table, t, hi - t < 16 ? hi - t : 16, block_size, token_stride, &run);
            k += head_offset;
            for (int64_t i = 0; i < nrows; ++i) {
                const int64_t a = first[i] > t ? first[i] : t, b = lengths[i] < t + run ? lengths[i] : t + run;
                if (a >= b) continue;
                const float *qi = q + i * q_stride;
                float *s = scores + i * rows * score_stride + (a - first[i]);
                for (int64_t h = 0; h < h1 - h0; ++h)
                    for (int64_t j = 0; j < group; ++j)
                        scaled_dots(qi + (h * group + j) * head_dim, k + (a - t) * token_stride + h * head_dim,
                                    token_stride, b - a, head_dim, scale, s + (h * group + j) * score_stride);
            }
            t += run;
        }
#endif
    } else {
        const int64_t width = (h1 - h0) * head_dim;
        for (int64_t t = lo; t < hi; ++t) {
            prefetch_row(k_cache, block_table, t + PREFETCH_DISTANCE, hi, block_size, token_stride, head_offset, width);
            const float *k = token_row(k_cache, block_table, t, block_size, token_stride) + head_offset;
            for (int64_t i = 0; i < nrows; ++i) {
                if (t < first[i] || t >= lengths[i]) continue;
                const float *qi = q + i * q_stride;
                float *s = scores + i * rows * score_stride + (t - first[i]);
                for (int64_t h = 0; h < h1 - h0; ++h)
                    for (int64_t j = 0; j < group; ++j)
                        s[(h * group + j) * score_stride] =
                            dot(qi + (h * group + j) * head_dim, k + h * head_dim, head_dim) * scale;
            }
        }
    }

    softmax_rows(scores, nrows, rows, score_stride, lengths, first);

    if (SIMD_ATTENTION(head_dim, group)) {
#if defined(__AVX512F__)
        for (int64_t i = 0; i < nrows; ++i)
            for (int64_t h = 0; h < h1 - h0; ++h)
                weighted_values(scores + (i * rows + h * group) * score_stride, score_stride,
                                v_cache + head_offset + h * head_dim, block_table, first[i], lengths[i], block_size,
                                token_stride, head_dim, group, out + i * out_stride + h * group * head_dim);
#endif
        return;
    }
    const int64_t width = (h1 - h0) * head_dim;
    for (int64_t x = 0; x < nrows * rows * head_dim; ++x) acc[x] = 0.0f;
    for (int64_t t = lo; t < hi; ++t) {
        prefetch_row(v_cache, block_table, t + PREFETCH_DISTANCE, hi, block_size, token_stride, head_offset, width);
        const float *v = token_row(v_cache, block_table, t, block_size, token_stride) + head_offset;
        for (int64_t i = 0; i < nrows; ++i) {
            if (t < first[i] || t >= lengths[i]) continue;
            const float *s = scores + i * rows * score_stride + (t - first[i]);
            for (int64_t h = 0; h < h1 - h0; ++h)
                for (int64_t j = 0; j < group; ++j) {
                    const float w = s[(h * group + j) * score_stride];
                    float *a = acc + (i * rows + h * group + j) * head_dim;
                    const float *vh = v + h * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) a[d] += w * vh[d];
                }
        }
    }
    for (int64_t i = 0; i < nrows; ++i)
        for (int64_t x = 0; x < rows * head_dim; ++x) out[i * out_stride + x] = acc[i * rows * head_dim + x];
}

typedef void (*attend_fn)(const float *, int64_t, int64_t, const int64_t *, int64_t, const float *, const float *,
                          const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float *,
                          int64_t, float *, int64_t, float *);

#define ATTEND_PARAMS                                                                                             \
    const float *q, int64_t q_stride, int64_t nrows, const int64_t *lengths, int64_t window, const float *k_cache, \
        const float *v_cache, const int64_t *block_table, int64_t block_size, int64_t num_kv_heads, int64_t h0,    \
        int64_t h1, int64_t head_dim, int64_t group, float scale, float *out, int64_t out_stride, float *scores,   \
        int64_t score_stride, float *acc

#define SPECIALISE(D, G)                                                                                    \
    static void attend_d##D##_g##G(ATTEND_PARAMS) {                                                          \
        (void)head_dim, (void)group;                                                                         \
        attend_rows(q, q_stride, nrows, lengths, window, k_cache, v_cache, block_table, block_size,          \
                    num_kv_heads, h0, h1, D, G, scale, out, out_stride, scores, score_stride, acc);          \
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

static void attend_any(ATTEND_PARAMS) {
    attend_rows(q, q_stride, nrows, lengths, window, k_cache, v_cache, block_table, block_size, num_kv_heads, h0, h1,
                head_dim, group, scale, out, out_stride, scores, score_stride, acc);
}

static attend_fn pick(int64_t head_dim, int64_t group) {
    static const attend_fn d64[] = {0, attend_d64_g1, attend_d64_g2, attend_d64_g3, attend_d64_g4, 0, 0, 0, attend_d64_g8};
    static const attend_fn d128[] = {0, attend_d128_g1, attend_d128_g2, attend_d128_g3, attend_d128_g4, 0, 0, 0, attend_d128_g8};
    attend_fn fn = 0;
    if (group >= 1 && group <= 8) fn = head_dim == 64 ? d64[group] : head_dim == 128 ? d128[group] : 0;
    return fn ? fn : attend_any;
}

/* One call's inputs, for its tasks (a task: one group's share of kv heads). Group g is rows
 * [group_first[g], group_first[g + 1]), read through the first row's block table. k_cache, v_cache:
 * float or int8 rows; codes: the 8-bit cache's code values (NULL for float); per_slot: scratch
 * floats of each thread, scores first (`scores` of them: group_rows query rows of score_stride),
 * then the accumulator (and for 8 bits a widened row). */
typedef struct {
    const float *q;
    int64_t q_row_stride;
    const void *k_cache, *v_cache;
    const int64_t *block_tables;
    int64_t max_blocks;
    const int64_t *lengths;
    const int64_t *group_first;
    int64_t splits, heads_per_task, group, num_kv_heads, head_dim, block_size, window;
    float scale;
    float *out;
    int64_t out_row_stride;
    float *scratch;
    size_t per_slot, scores;
    int64_t score_stride;
    const float *codes;
    attend_fn attend;
} attention_args;

/* The task's first row, its rows and its first kv head. */
ALWAYS_INLINE void task_span(const attention_args *a, int64_t task, int64_t *r, int64_t *nrows, int64_t *h0) {
    const int64_t g = task / a->splits;
    *r = a->group_first[g];
    *nrows = a->group_first[g + 1] - *r;
    *h0 = (task % a->splits) * a->heads_per_task;
}

static void attention_task_f32(void *ctx, int64_t task, int slot) {
    const attention_args *a = ctx;
    int64_t r, nrows, h0;
    task_span(a, task, &r, &nrows, &h0);
    float *scratch = a->scratch + (size_t)slot * a->per_slot;
    const int64_t offset = h0 * a->group * a->head_dim;
    a->attend(a->q + r * a->q_row_stride + offset, a->q_row_stride, nrows, a->lengths + r, a->window, a->k_cache,
              a->v_cache, a->block_tables + r * a->max_blocks, a->block_size, a->num_kv_heads, h0,
              h0 + a->heads_per_task, a->head_dim, a->group, a->scale, a->out + r * a->out_row_stride + offset,
              a->out_row_stride, scratch, a->score_stride, scratch + a->scores);
}

/* Tasks per group: with few groups, each one's kv heads split over tasks so every thread has work. */
static int64_t head_splits(int num_threads, int64_t num_groups, int64_t num_kv_heads) {
    int64_t splits = num_threads > 1 ? (4 * num_threads + num_groups - 1) / num_groups : 1;
    if (splits > num_kv_heads) splits = num_kv_heads;
    while (num_kv_heads % splits) --splits;
    return splits;
}

/* Whether row b can join the group of row a: the blocks both rows read are the same. */
static int same_blocks(const int64_t *block_tables, int64_t max_blocks, const int64_t *lengths, int64_t block_size,
                       int64_t a, int64_t b) {
    const int64_t longer = lengths[a] > lengths[b] ? lengths[a] : lengths[b];
    const int64_t blocks = (longer + block_size - 1) / block_size;
    if (blocks > max_blocks) return 0;
    return memcmp(block_tables + a * max_blocks, block_tables + b * max_blocks, sizeof(int64_t) * (size_t)blocks) == 0;
}

/* Cuts rows into groups (consecutive rows reading the same blocks, MAX_GROUP_ROWS at most) and the
 * groups into tasks (a group's share of kv heads each), gives each thread its scratch and runs them
 * on the pool; codes: an 8-bit cache's code values, NULL for a float cache. 0, or -1 when the
 * scratch memory could not be allocated. */
static int run_attention(const float *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                         const int64_t *block_tables, int64_t max_blocks, const int64_t *lengths, int64_t num_rows,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
                         float scale, float *out, int64_t out_row_stride, int num_threads, const float *codes,
                         pool_task task) {
    if (num_rows <= 0) return 0;
    int64_t *group_first = malloc(sizeof(int64_t) * (size_t)(num_rows + 1));
    if (!group_first) return -1;
    int64_t num_groups = 0, widest = 0, longest = 1;
    for (int64_t r = 0; r < num_rows; ++r) {
        longest = lengths[r] > longest ? lengths[r] : longest;
        const int64_t start = num_groups ? group_first[num_groups - 1] : 0;
        if (!num_groups || r - start >= MAX_GROUP_ROWS ||
            !same_blocks(block_tables, max_blocks, lengths, block_size, start, r))
            group_first[num_groups++] = r;
        const int64_t size = r + 1 - group_first[num_groups - 1];
        widest = size > widest ? size : widest;
    }
    group_first[num_groups] = num_rows;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t splits = head_splits(num_threads, num_groups, num_kv_heads);
    const int64_t heads_per_task = num_kv_heads / splits;
    const size_t rows = (size_t)(widest * heads_per_task * group); /* query rows of a task */
    const size_t per_slot = rows * (size_t)(longest + head_dim) + (codes ? (size_t)head_dim : 0); /* + widened row */
    float *scratch = malloc(sizeof(float) * per_slot * (size_t)(num_threads > 1 ? num_threads : 1));
    if (!scratch) {
        free(group_first);
        return -1;
    }
    attention_args args = {q, q_row_stride, k_cache, v_cache, block_tables, max_blocks, lengths, group_first, splits,
                           heads_per_task, group, num_kv_heads, head_dim, block_size, window, scale, out,
                           out_row_stride, scratch, per_slot, rows * (size_t)longest, longest, codes,
                           codes ? NULL : pick(head_dim, group)};
    pool_run(num_groups * splits, task, &args, num_threads);
    free(scratch);
    free(group_first);
    return 0;
}

/*
 * q:            [num_rows, num_heads, head_dim], rows q_row_stride apart, heads contiguous
 * k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 * block_tables: [num_rows, max_blocks], int64
 * lengths:      [num_rows], context length including the row's own token
 * out:          [num_rows, num_heads * head_dim], rows out_row_stride apart
 * window:       sliding window in tokens, 0 for none
 * Returns 0, or -1 when scratch memory could not be allocated.
 */
int paged_decode_attention_f32(
    const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *lengths, int64_t num_rows,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
    float scale, float *out, int64_t out_row_stride, int num_threads) {
    return run_attention(q, q_row_stride, k_cache, v_cache, block_tables, max_blocks, lengths, num_rows, num_heads,
                         num_kv_heads, head_dim, block_size, window, scale, out, out_row_stride, num_threads, NULL,
                         attention_task_f32);
}

/*
 * The same attention over an 8-bit cache (cluster/engine/quantization/kv_format.py): each token's
 * head row is head_dim codes then its float32 scale, x = scale * value(code). `codes` maps a
 * code byte to its value (int8 or e4m3fn), built once per call. Scores and weights are computed
 * as above; the scale multiplies each row's dot product and each value row's weight. A head's row
 * is widened once per token for every row of the group.
 */
ALWAYS_INLINE const int8_t *row8(const int8_t *cache, const int64_t *block_table, int64_t t, int64_t block_size,
                                 int64_t token_stride) {
    return cache + (block_table[t / block_size] * block_size + t % block_size) * token_stride;
}

ALWAYS_INLINE float row_scale(const int8_t *row, int64_t head_dim) {
    float scale;
    memcpy(&scale, row + head_dim, sizeof scale);
    return scale;
}

static void attend_rows_8bit(const float *restrict q, int64_t q_stride, int64_t nrows, const int64_t *restrict lengths,
                             int64_t window, const int8_t *restrict k_cache, const int8_t *restrict v_cache,
                             const int64_t *restrict block_table, int64_t block_size, int64_t num_kv_heads, int64_t h0,
                             int64_t h1, int64_t head_dim, int64_t group, float scale, const float *restrict codes,
                             float *restrict out, int64_t out_stride, float *restrict scores, int64_t score_stride,
                             float *restrict acc, float *restrict widened) {
    const int64_t rows = (h1 - h0) * group, row_width = head_dim + 4;
    const int64_t token_stride = num_kv_heads * row_width;
    int64_t first[MAX_GROUP_ROWS], lo = INT64_MAX, hi = 0;
    for (int64_t i = 0; i < nrows; ++i) {
        first[i] = first_key(lengths[i], window);
        lo = first[i] < lo ? first[i] : lo;
        hi = lengths[i] > hi ? lengths[i] : hi;
    }
    for (int64_t t = lo; t < hi; ++t) {
        const int8_t *k = row8(k_cache, block_table, t, block_size, token_stride);
        for (int64_t h = 0; h < h1 - h0; ++h) {
            const int8_t *kh = k + (h0 + h) * row_width;
            for (int64_t d = 0; d < head_dim; ++d) widened[d] = codes[(uint8_t)kh[d]];
            const float row = row_scale(kh, head_dim) * scale;
            for (int64_t i = 0; i < nrows; ++i) {
                if (t < first[i] || t >= lengths[i]) continue;
                const float *qi = q + i * q_stride;
                float *s = scores + i * rows * score_stride + (t - first[i]);
                for (int64_t j = 0; j < group; ++j)
                    s[(h * group + j) * score_stride] = dot(qi + (h * group + j) * head_dim, widened, head_dim) * row;
            }
        }
    }
    softmax_rows(scores, nrows, rows, score_stride, lengths, first);
    for (int64_t x = 0; x < nrows * rows * head_dim; ++x) acc[x] = 0.0f;
    for (int64_t t = lo; t < hi; ++t) {
        const int8_t *v = row8(v_cache, block_table, t, block_size, token_stride);
        for (int64_t h = 0; h < h1 - h0; ++h) {
            const int8_t *vh = v + (h0 + h) * row_width;
            const float row = row_scale(vh, head_dim);
            for (int64_t d = 0; d < head_dim; ++d) widened[d] = codes[(uint8_t)vh[d]] * row;
            for (int64_t i = 0; i < nrows; ++i) {
                if (t < first[i] || t >= lengths[i]) continue;
                const float *s = scores + i * rows * score_stride + (t - first[i]);
                for (int64_t j = 0; j < group; ++j) {
                    const float w = s[(h * group + j) * score_stride];
                    float *a = acc + (i * rows + h * group + j) * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) a[d] += w * widened[d];
                }
            }
        }
    }
    for (int64_t i = 0; i < nrows; ++i)
        for (int64_t x = 0; x < rows * head_dim; ++x) out[i * out_stride + x] = acc[i * rows * head_dim + x];
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
    int64_t r, nrows, h0;
    task_span(a, task, &r, &nrows, &h0);
    float *scratch = a->scratch + (size_t)slot * a->per_slot;
    const int64_t offset = h0 * a->group * a->head_dim;
    const size_t acc_floats = (size_t)(nrows * a->heads_per_task * a->group * a->head_dim);
    attend_rows_8bit(a->q + r * a->q_row_stride + offset, a->q_row_stride, nrows, a->lengths + r, a->window,
                     a->k_cache, a->v_cache, a->block_tables + r * a->max_blocks, a->block_size, a->num_kv_heads, h0,
                     h0 + a->heads_per_task, a->head_dim, a->group, a->scale, a->codes,
                     a->out + r * a->out_row_stride + offset, a->out_row_stride, scratch, a->score_stride,
                     scratch + a->scores, scratch + a->scores + acc_floats);
}

int paged_decode_attention_8bit(
    const float *q, int64_t q_row_stride, const int8_t *k_cache, const int8_t *v_cache,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *lengths, int64_t num_rows,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
    float scale, int fp8, float *out, int64_t out_row_stride, int num_threads) {
    float codes[256];
    for (int b = 0; b < 256; ++b) codes[b] = fp8 ? e4m3fn_value((uint8_t)b) : (float)(int8_t)b;
    return run_attention(q, q_row_stride, k_cache, v_cache, block_tables, max_blocks, lengths, num_rows, num_heads,
                         num_kv_heads, head_dim, block_size, window, scale, out, out_row_stride, num_threads, codes,
                         attention_task_8bit);
}
