/*
 * y = x @ W^T with W stored quantized, float32 activations and outputs, on the CPU.
 *
 * Three weight layouts, each row of W (an output feature) cut into groups along K:
 *   q4: 32 weights per group in 16 bytes; byte j holds weight j (low nibble) and j + 16 (high
 *       nibble), GGUF's Q4_0/Q4_1 order; w = scale * q + min, q in 0..15.
 *   q8: `group` (16 or 32) signed bytes per group; w = scale * q (+ min when mins is given).
 *   f8: 32 bytes per group, each an FP8 e4m3fn code; w = scale * e4m3(code), widened exactly (see
 *       f8_value; the NaN codes 0x7F/0xFF read as +-480, and are refused at load).
 * scales and mins are float32 [N, K / group]; K is a multiple of 32.
 *
 * A group of weights is widened to float32 with its scale applied once and multiplied into every
 * activation row of the tile, so each product is the dequantized weight times x. The min term is
 * summed apart, as min . (sum of x over the group); results differ from a float32 matmul of the
 * dequantized weight only in the order of additions.
 *
 * A tile is up to 4 output features by up to 4 activation rows, or for q4 weights (5 to 8 rows)
 * up to 2 features by up to 8 rows: each widened weight is used for every row of the tile, so a
 * step that checks speculative guesses (5-8 rows) widens its q4 weights once, not twice
 * (single-threaded, caches flushed, q4 3072 x 576: 5 rows 193 us against 230, 8 rows 288 against
 * 339). Other weights keep 4 features a tile: 8-row tiles 2 features wide took 30% longer at 5-7
 * rows for q8; but where 5 or 6 rows are left they go in one tile 4 features wide (the default
 * model's q8 output layer, 49152 x 576, one thread: 5 rows 2.23 ms against 3.04 in a 4-row and a
 * 1-row tile, 6 rows 2.38 against 3.08, 4 rows 2.0). Each accumulator takes the low half of a group,
 * then the high half, in the same order whatever the tile's shape, so a row's result does not depend
 * on how many rows share its call (a guess checked in a 6-row step gives the token a 1-row step would).
 * The pool's threads (thread_pool.c) take 16 features at a time, each from its own share first.
 *
 * bfloat16 dot products (x_bf16 given, on a CPU with AVX512_BF16): each group's 32 weights are
 * dequantized (min included) and rounded once to bfloat16 (to nearest even), the activation rows
 * are rounded to bfloat16 once per call, and vdpbf16ps adds the exact products of a group's pairs
 * into float32 accumulators: 32 products an instruction where an FMA takes 16, no min term, and a
 * q4 group widens in fewer instructions (a table of scale * 0..15 + min, looked up by its nibbles).
 * One thread, the default model's q4 3072 x 576 (benchmarks/cpu_dot_products.py): 1 row 0.040 ms
 * against 0.047 in float32, 8 rows 0.104 against 0.253, 64 rows 0.84 against 2.05. The arithmetic is
 * a bfloat16 engine's (weights and activations in bfloat16, float32 sums); a row's result still does
 * not depend on the rows that share its call. Float weights (F32) always multiply in float32.
 *
 * A tile's loop walks pointers that move with the group block (its first feature's codes, scales and
 * mins; feature j's are j row strides on), not indexes from the tile's start: with indexes, 4 features'
 * 12 addresses spilled the loop's registers. One thread, same sitting (2026-11-28): q4 3072 x 576 in
 * bfloat16, 1 row 0.087 ms against 0.099, 8 rows 0.220 against 0.246, 32 rows 0.88 against 0.99; the q8
 * output layer (49152 x 576) in float32, 1 row 4.3 ms against 5.1.
 *
 * Why not torch's packed kernels: on a 2-core AVX-512 machine (torch 2.13) _weight_int8pack_mm
 * takes 564 us and _weight_int4pack_mm_for_cpu 1267 us for a 576 x 3072 weight at one row, against
 * 93 us for the float32 matmul; both grow linearly with the rows (5.0 ms and 10.3 ms at 8).
 */
#include <stdint.h>
#include <string.h>

#include "thread_pool.c"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define TILE 4      /* features of a tile of up to 4 rows */
#define WIDE_TILE 2 /* features of a tile of 5 to 8 rows */
#define TILE_ROWS 8

enum { Q4 = 0, Q8_G32 = 1, Q8_G16 = 2, F32 = 3, F8 = 4 }; /* F32: plain float weights, for the fused decode step */

/* Sums of x over each group of 32, [rows, k / 32] (groups of 16 sum in pairs: see min_term). */
static void group_sums(const float *x, int64_t x_stride, int64_t rows, int64_t k, int64_t group, float *out) {
    const int64_t groups = k / group;
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t g = 0; g < groups; ++g) {
            float total = 0.0f;
            const float *p = x + m * x_stride + g * group;
            for (int64_t i = 0; i < group; ++i) total += p[i];
            out[m * groups + g] = total;
        }
}

ALWAYS_INLINE float min_term(const float *mins, const float *sums, int64_t groups) {
    float total = 0.0f;
    for (int64_t g = 0; g < groups; ++g) total += mins[g] * sums[g];
    return total;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define BF16_DOTS 1
#endif

/* 16 e4m3fn codes as the fp16 bits ((c & 0x80) << 8) | ((c & 0x7F) << 7): each value / 2^8. */
ALWAYS_INLINE __m256i f8_as_half(__m128i bytes) {
    const __m256i wide = _mm256_cvtepu8_epi16(bytes);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7F)), 7);
    return _mm256_or_si256(sign, rest);
}

/* Half `half` (0: weights 0-15, 1: 16-31) of the group block (32 columns) that codes and scales
 * point at, in one row, scaled. */
ALWAYS_INLINE __m512 widen(const int kind, const uint8_t *codes, const float *scales, const int half) {
    if (kind == F32) return _mm512_loadu_ps((const float *)codes + half * 16);
    if (kind == F8) {
        /* e4m3 bits s.eeee.mmm moved into fp16 as s.0eeee.mmm0000000: the same exponent field
         * under a bias of 15 instead of 7 (subnormals included), so the fp16 is the code's value / 2^8;
         * the 2^8 goes into the scale (exact: a power of two), so each widened weight is the one
         * rounding of scale * value that dequantize does. */
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + half * 16));
        return _mm512_mul_ps(_mm512_cvtph_ps(f8_as_half(bytes)), _mm512_set1_ps(scales[0] * 256.0f));
    }
    if (kind == Q4) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)codes);
        if (half) bytes = _mm_srli_epi16(bytes, 4);
        const __m128i nibbles = _mm_and_si128(bytes, _mm_set1_epi8(15));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles)), _mm512_set1_ps(scales[0]));
    }
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + half * 16));
    const float scale = kind == Q8_G32 ? scales[0] : scales[half];
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), _mm512_set1_ps(scale));
}

/* Prefetches, as a tile goes through its NB features' rows, the same bytes of the next NB
 * features' rows (the next tile's): a cache line of codes each time a tile's reads of a row enter
 * one (`code_offset`, `scale_offset`: the bytes of the row read before this block), and of scales
 * and mins. The hardware prefetcher did not keep up with 4 rows read side by side: one row, 2
 * threads, the default model's 30 layers of q4 weights took 3.6 ms (22 GB/s) without, 3.0-3.4 with
 * (24-26.5 GB/s; the machine reads 27), its q8 output layer 2.1 ms without, 1.3 with; one thread,
 * weights that fit in the caches, no change. */
ALWAYS_INLINE void prefetch_next_tile(const int NB, const uint8_t *codes, int64_t code_stride, int64_t code_offset,
                                      const int64_t code_step, const float *scales, const float *mins,
                                      int64_t scale_stride, int64_t scale_offset) {
    for (int64_t line = 0; line < code_step; line += 64) /* F32 rows read 128 bytes a block */
        if ((code_offset + line) % 64 == 0)
            for (int j = 0; j < NB; ++j)
                _mm_prefetch((const char *)(codes + (NB + j) * code_stride + line), _MM_HINT_T0);
    if (scales && scale_offset % 64 == 0)
        for (int j = 0; j < NB; ++j) {
            _mm_prefetch((const char *)(scales + (NB + j) * scale_stride), _MM_HINT_T0);
            if (mins) _mm_prefetch((const char *)(mins + (NB + j) * scale_stride), _MM_HINT_T0);
        }
}

/* Dot products of features [n0, n0 + NB) with activation rows [m0, m0 + MB), into out. Per
 * group block, the low halves of the NB features are widened and multiplied into every row, then
 * the high halves: MB * NB accumulators, NB widened vectors and one x vector live at a time. */
ALWAYS_INLINE void tile_f32(const int kind, const int MB, const int NB, const float *x, int64_t x_stride, int64_t m0,
                        int64_t k, const uint8_t *codes, int64_t code_stride, const float *scales,
                        int64_t scale_stride, int64_t n0, float out[TILE_ROWS][TILE]) {
    __m512 acc[TILE_ROWS][TILE];
    for (int r = 0; r < MB; ++r)
        for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    /* The tile's first feature's codes and scales, and its first row, at block b; feature j's are j
     * strides on (pointers that move with the block: see the header). */
    const uint8_t *c = codes + n0 * code_stride;
    const float *s = scales + n0 * scale_stride, *xp = x + m0 * x_stride;
    const int64_t code_step = kind == F32 ? 128 : kind == Q4 ? 16 : 32, scale_step = kind == Q8_G16 ? 2 : 1;
    for (int64_t b = 0; b < k / 32; ++b, c += code_step, s += scale_step, xp += 32) {
        prefetch_next_tile(NB, c, code_stride, b * code_step, code_step, kind == F32 ? 0 : s, 0, scale_stride,
                           b * scale_step * 4);
        for (int half = 0; half < 2; ++half) {
            __m512 w[TILE];
            for (int j = 0; j < NB; ++j) w[j] = widen(kind, c + j * code_stride, s + j * scale_stride, half);
            for (int r = 0; r < MB; ++r) {
                const __m512 xv = _mm512_loadu_ps(xp + r * x_stride + half * 16);
                for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(w[j], xv, acc[r][j]);
            }
        }
    }
    for (int r = 0; r < MB; ++r)
        for (int j = 0; j < NB; ++j) out[r][j] = _mm512_reduce_add_ps(acc[r][j]);
}

#ifdef BF16_DOTS
/* Group block `b` of one row as 32 bfloat16 weights, in column order: each dequantized weight
 * (scale * q + min, one float32 rounding by FMA; scale * q where there are no mins) rounded once to
 * bfloat16, so the min is part of the weight and there is no min term. A q4 group comes from a
 * table (scale * 0..15 + min rounded, looked up by the 32 nibbles with one vpermw): the same values
 * in fewer instructions. The 16 bytes are widened to 16-bit indexes twice, the second copy shifted
 * right by 4; the first keeps each high nibble in its bits 4-7, of which vpermw reads bit 4 alone,
 * and the table repeats its 16 values in entries 16-31, so no mask is needed. */
ALWAYS_INLINE __m512bh widen_bf16(const int kind, const uint8_t *codes, const float *scales, const float *mins) {
    if (kind == Q4) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)codes);
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(bytes));
        const __m512i nibbles = _mm512_srlv_epi16(words, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1));
        const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512 scale = _mm512_set1_ps(scales[0]);
        const __m512 values = mins ? _mm512_fmadd_ps(iota, scale, _mm512_set1_ps(mins[0])) : _mm512_mul_ps(iota, scale);
        return (__m512bh)_mm512_permutexvar_epi16(nibbles, (__m512i)_mm512_cvtne2ps_pbh(values, values));
    }
    if (kind == F8 || !mins) return _mm512_cvtne2ps_pbh(widen(kind, codes, scales, 1), widen(kind, codes, scales, 0));
    __m512 half[2];
    for (int h = 0; h < 2; ++h) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + h * 16));
        const int g = kind == Q8_G32 ? 0 : h;
        half[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), _mm512_set1_ps(scales[g]),
                                  _mm512_set1_ps(mins[g]));
    }
    return _mm512_cvtne2ps_pbh(half[1], half[0]);
}

/* As tile_f32 with bfloat16 weights (mins folded in) and activations (xb: the m rows rounded,
 * group by group, see round_rows_bf16): per group block one widened vector per feature and one
 * vdpbf16ps per row and feature. has_mins is a constant (see tile_bf16), so the loop tests nothing. */
ALWAYS_INLINE void tile_bf16_mins(const int kind, const int MB, const int NB, const int has_mins, const uint16_t *xb,
                                  int64_t m, int64_t m0, int64_t k, const uint8_t *codes, int64_t code_stride,
                                  const float *scales, const float *mins, int64_t scale_stride, int64_t n0,
                                  float out[TILE_ROWS][TILE]) {
    __m512 acc[TILE_ROWS][TILE];
    for (int r = 0; r < MB; ++r)
        for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    const uint16_t *group = xb + m0 * 32; /* this tile's rows of group block b: 32 values each, in a row */
    /* The tile's first feature's codes, scales and mins at block b, as in tile_f32. */
    const uint8_t *c = codes + n0 * code_stride;
    const float *s = scales + n0 * scale_stride, *mn = has_mins ? mins + n0 * scale_stride : 0;
    const int64_t code_step = kind == Q4 ? 16 : 32, scale_step = kind == Q8_G16 ? 2 : 1;
    for (int64_t b = 0; b < k / 32; ++b, group += m * 32, c += code_step, s += scale_step) {
        __m512bh w[TILE];
        for (int j = 0; j < NB; ++j)
            w[j] = widen_bf16(kind, c + j * code_stride, s + j * scale_stride, has_mins ? mn + j * scale_stride : 0);
        prefetch_next_tile(NB, c, code_stride, b * code_step, code_step, s, has_mins ? mn : 0, scale_stride,
                           b * scale_step * 4);
        if (has_mins) mn += scale_step;
        for (int r = 0; r < MB; ++r) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(group + r * 32));
            for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], xv);
        }
    }
    for (int r = 0; r < MB; ++r)
        for (int j = 0; j < NB; ++j) out[r][j] = _mm512_reduce_add_ps(acc[r][j]);
}

ALWAYS_INLINE void tile_bf16(const int kind, const int MB, const int NB, const uint16_t *xb, int64_t m, int64_t m0,
                             int64_t k, const uint8_t *codes, int64_t code_stride, const float *scales,
                             const float *mins, int64_t scale_stride, int64_t n0, float out[TILE_ROWS][TILE]) {
    if (mins) tile_bf16_mins(kind, MB, NB, 1, xb, m, m0, k, codes, code_stride, scales, mins, scale_stride, n0, out);
    else tile_bf16_mins(kind, MB, NB, 0, xb, m, m0, k, codes, code_stride, scales, mins, scale_stride, n0, out);
}

/* x's m rows rounded to bfloat16 (to nearest even), group block by group block: [k / 32, m, 32], so
 * that a tile finds its rows' values of a block at fixed offsets from one pointer. */
static void round_rows_bf16(const float *x, int64_t x_stride, int64_t m, int64_t k, uint16_t *out) {
    for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < k; i += 16)
            _mm256_storeu_si256((__m256i *)(out + ((i / 32) * m + r) * 32 + i % 32),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * x_stride + i)));
}
#endif

#else /* portable: plain loops the compiler vectorises */

/* An e4m3fn code's value: normals as float32 bits (exponent rebiased from 7 to 127), subnormals
 * as m * 2^-9; exact either way. */
ALWAYS_INLINE float f8_value(uint8_t code) {
    const uint32_t exponent = (code >> 3) & 15, mantissa = code & 7;
    float magnitude;
    if (exponent) {
        const uint32_t bits = ((exponent + 120) << 23) | (mantissa << 20);
        memcpy(&magnitude, &bits, sizeof magnitude);
    } else {
        magnitude = (float)mantissa * 0x1p-9f;
    }
    return code & 0x80 ? -magnitude : magnitude;
}

ALWAYS_INLINE float weight_at(const int kind, const uint8_t *codes, const float *scales, int64_t i) {
    if (kind == F32) return ((const float *)codes)[i];
    if (kind == F8) return f8_value(codes[i]) * scales[i / 32];
    if (kind == Q4) {
        const int64_t b = i / 32, j = i % 32;
        const uint8_t byte = codes[b * 16 + (j & 15)];
        return (float)(j < 16 ? byte & 15 : byte >> 4) * scales[b];
    }
    return (float)((const int8_t *)codes)[i] * scales[kind == Q8_G32 ? i / 32 : i / 16];
}

ALWAYS_INLINE void tile_f32(const int kind, const int MB, const int NB, const float *x, int64_t x_stride, int64_t m0,
                        int64_t k, const uint8_t *codes, int64_t code_stride, const float *scales,
                        int64_t scale_stride, int64_t n0, float out[TILE_ROWS][TILE]) {
    for (int r = 0; r < MB; ++r)
        for (int j = 0; j < NB; ++j) {
            const uint8_t *row = codes + (n0 + j) * code_stride;
            const float *row_scales = scales + (n0 + j) * scale_stride, *xp = x + (m0 + r) * x_stride;
            float total = 0.0f;
            for (int64_t i = 0; i < k; ++i) total += weight_at(kind, row, row_scales, i) * xp[i];
            out[r][j] = total;
        }
}
#endif

/* bfloat16 dot products where asked (xb) and built for; float32 FMAs otherwise. */
ALWAYS_INLINE void tile(const int kind, const int bf16, const int MB, const int NB, const float *x, int64_t x_stride,
                        const uint16_t *xb, int64_t m, int64_t m0, int64_t k, const uint8_t *codes, int64_t code_stride,
                        const float *scales, const float *mins, int64_t scale_stride, int64_t n0,
                        float out[TILE_ROWS][TILE]) {
#ifdef BF16_DOTS
    if (bf16) {
        tile_bf16(kind, MB, NB, xb, m, m0, k, codes, code_stride, scales, mins, scale_stride, n0, out);
        return;
    }
#else
    (void)bf16, (void)xb, (void)m;
#endif
    (void)mins;
    tile_f32(kind, MB, NB, x, x_stride, m0, k, codes, code_stride, scales, scale_stride, n0, out);
}

#define TILE_CASE(KIND, MB, NB) \
    tile(KIND, bf16, MB, NB, x, x_stride, xb, m, m0, k, codes, code_stride, scales, mins, scale_stride, n0, out)

/* One tile of up to 4 rows by TILE features or 5-8 rows by WIDE_TILE features (q4), with the sizes
 * made compile-time constants. */
ALWAYS_INLINE void any_tile(const int kind, const int bf16, int mb, int nb, const float *x, int64_t x_stride,
                            const uint16_t *xb, int64_t m, int64_t m0, int64_t k,
                            const uint8_t *codes, int64_t code_stride, const float *scales, const float *mins,
                            int64_t scale_stride,
                            int64_t n0, float out[TILE_ROWS][TILE]) {
    switch (mb * 8 + nb) {
    case 9: TILE_CASE(kind, 1, 1); break;
    case 10: TILE_CASE(kind, 1, 2); break;
    case 11: TILE_CASE(kind, 1, 3); break;
    case 12: TILE_CASE(kind, 1, 4); break;
    case 17: TILE_CASE(kind, 2, 1); break;
    case 18: TILE_CASE(kind, 2, 2); break;
    case 19: TILE_CASE(kind, 2, 3); break;
    case 20: TILE_CASE(kind, 2, 4); break;
    case 25: TILE_CASE(kind, 3, 1); break;
    case 26: TILE_CASE(kind, 3, 2); break;
    case 27: TILE_CASE(kind, 3, 3); break;
    case 28: TILE_CASE(kind, 3, 4); break;
    case 33: TILE_CASE(kind, 4, 1); break;
    case 34: TILE_CASE(kind, 4, 2); break;
    case 35: TILE_CASE(kind, 4, 3); break;
    case 36: TILE_CASE(kind, 4, 4); break;
    case 41: TILE_CASE(kind, 5, 1); break;
    case 42: TILE_CASE(kind, 5, 2); break;
    case 43: TILE_CASE(kind, 5, 3); break;
    case 44: TILE_CASE(kind, 5, 4); break;
    case 49: TILE_CASE(kind, 6, 1); break;
    case 50: TILE_CASE(kind, 6, 2); break;
    case 51: TILE_CASE(kind, 6, 3); break;
    case 52: TILE_CASE(kind, 6, 4); break;
    case 57: TILE_CASE(kind, 7, 1); break;
    case 58: TILE_CASE(kind, 7, 2); break;
    case 65: TILE_CASE(kind, 8, 1); break;
    default: TILE_CASE(kind, 8, 2); break;
    }
}

typedef struct {
    int kind;
    const float *x;
    int64_t x_stride, m, k, n;
    const uint8_t *codes;
    int64_t code_stride;
    const float *scales, *mins;
    int64_t groups;
    const float *sums;
    float *y;
    int64_t y_stride;
    const uint16_t *xb; /* x rounded to bfloat16 (round_rows_bf16): bfloat16 dot products; NULL: float32 */
} matmul_args;

/* The rows of the next tile, `left` rows to go: q4 weights up to 8 (2 features wide past 4 rows);
 * other weights 4 features wide, up to 4 rows, but 5 or 6 rows left go in one tile (24 accumulators:
 * a verify of 4-5 guesses widens each weight once, not twice). */
ALWAYS_INLINE int tile_rows(const int kind, int64_t left) {
    if (kind == Q4) return left < TILE_ROWS ? (int)left : TILE_ROWS;
    if (left == 5 || left == 6) return (int)left;
    return left < TILE ? (int)left : TILE;
}

#define TILES_PER_TASK 4 /* 16 features: a thread reads its share in order (thread_pool.c), so tasks can be small */
#define ROW_BLOCK 64     /* rows of x a task's features go through before the next rows: 147 KB of x at K = 576 */

/* Output features [task * TILES_PER_TASK * TILE, ...) for every activation row, ROW_BLOCK rows at a
 * time, so that a long prompt chunk's rows stay in the L2 cache while the task's features go over
 * them (all rows at once re-read x from memory for every 4 features: 512 rows took 15 ms against
 * 4 ms at 256); one function per kind, so each is compiled with its kind a constant. */
ALWAYS_INLINE void matmul_features(const int kind, const int bf16, const matmul_args *a, int64_t task) {
    const float *x = a->x, *scales = a->scales, *mins = a->mins, *sums = a->sums;
    const uint16_t *xb = a->xb;
    const uint8_t *codes = a->codes;
    float *y = a->y;
    const int64_t n = a->n, m = a->m, k = a->k, groups = a->groups, x_stride = a->x_stride;
    const int64_t code_stride = a->code_stride, y_stride = a->y_stride;
    const int64_t first = task * TILES_PER_TASK * TILE;
    const int64_t last = first + TILES_PER_TASK * TILE < n ? first + TILES_PER_TASK * TILE : n;
    for (int64_t block = 0; block < m; block += ROW_BLOCK) {
        const int64_t block_end = block + ROW_BLOCK < m ? block + ROW_BLOCK : m;
        int mb;
        for (int64_t m0 = block; m0 < block_end; m0 += mb) {
            mb = tile_rows(kind, block_end - m0);
            const int width = mb > TILE && kind == Q4 ? WIDE_TILE : TILE;
            for (int64_t n0 = first; n0 < last; n0 += width) {
                const int nb = last - n0 < width ? (int)(last - n0) : width;
                float out[TILE_ROWS][TILE];
                any_tile(kind, bf16, mb, nb, x, x_stride, xb, m, m0, k, codes, code_stride, scales, mins, groups, n0, out);
                for (int r = 0; r < mb; ++r)
                    for (int j = 0; j < nb; ++j) {
                        float total = out[r][j];
                        if (mins && !bf16) total += min_term(mins + (n0 + j) * groups, sums + (m0 + r) * groups, groups);
                        y[(m0 + r) * y_stride + n0 + j] = total;
                    }
            }
        }
    }
}

#define MATMUL_TASK(KIND)                                                                                    \
    static void matmul_task_##KIND(void *ctx, int64_t task, int slot) { (void)slot; matmul_features(KIND, 0, ctx, task); } \
    static void matmul_task_bf16_##KIND(void *ctx, int64_t task, int slot) { (void)slot; matmul_features(KIND, 1, ctx, task); }
MATMUL_TASK(Q4)
MATMUL_TASK(Q8_G32)
MATMUL_TASK(Q8_G16)
MATMUL_TASK(F8)
static void matmul_task_F32(void *ctx, int64_t task, int slot) { (void)slot; matmul_features(F32, 0, ctx, task); }

/* Whether this build multiplies quantized weights with bfloat16 dot products when asked. */
int bf16_dots_supported(void) {
#ifdef BF16_DOTS
    return 1;
#else
    return 0;
#endif
}

/* xb: x's rows already rounded to bfloat16 (see round_rows_bf16), for bfloat16 dot products; NULL
 * (or F32 weights, or a build without them): float32. */
static void matmul(const int kind, const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t n,
                   const uint8_t *codes, int64_t code_stride, const float *scales, const float *mins, int64_t groups,
                   const float *sums, float *y, int64_t y_stride, const uint16_t *xb, int num_threads) {
    matmul_args args = {kind, x, x_stride, m, k, n, codes, code_stride, scales, mins, groups, sums, y, y_stride, xb};
    static const pool_task tasks[] = {[Q4] = matmul_task_Q4, [Q8_G32] = matmul_task_Q8_G32,
                                      [Q8_G16] = matmul_task_Q8_G16, [F32] = matmul_task_F32, [F8] = matmul_task_F8};
    static const pool_task bf16_tasks[] = {[Q4] = matmul_task_bf16_Q4, [Q8_G32] = matmul_task_bf16_Q8_G32,
                                           [Q8_G16] = matmul_task_bf16_Q8_G16, [F32] = matmul_task_F32,
                                           [F8] = matmul_task_bf16_F8};
    const int bf16 = xb != 0 && bf16_dots_supported();
    pool_run(task_count(n, TILES_PER_TASK * TILE), (bf16 ? bf16_tasks : tasks)[kind], &args, num_threads);
}

/* x_bf16 (scratch of m * k halves) for bfloat16 dot products, or NULL: the rows rounded into it. */
static const uint16_t *rounded_rows(const float *x, int64_t x_stride, int64_t m, int64_t k, uint16_t *x_bf16) {
#ifdef BF16_DOTS
    if (x_bf16) round_rows_bf16(x, x_stride, m, k, x_bf16);
    return x_bf16;
#else
    (void)x, (void)x_stride, (void)m, (void)k, (void)x_bf16;
    return 0;
#endif
}

/* x: [m, k] (rows x_stride apart), y: [m, n] (rows y_stride apart), sums: scratch of m * k / 32 floats;
 * x_bf16: scratch of m * k halves for bfloat16 dot products, or NULL for float32. */
int quantized_matmul_q4(const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t n, const uint8_t *codes,
                        const float *scales, const float *mins, float *sums, float *y, int64_t y_stride,
                        uint16_t *x_bf16, int num_threads) {
    if (k % 32) return 1;
    const uint16_t *xb = rounded_rows(x, x_stride, m, k, x_bf16);
    if (!xb) group_sums(x, x_stride, m, k, 32, sums);
    matmul(Q4, x, x_stride, m, k, n, codes, k / 2, scales, mins, k / 32, sums, y, y_stride, xb, num_threads);
    return 0;
}

/* As above for q8 weights with groups of `group` (16 or 32); sums: m * k / group floats. */
int quantized_matmul_q8(const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t n, int64_t group,
                        const int8_t *codes, const float *scales, const float *mins, float *sums, float *y,
                        int64_t y_stride, uint16_t *x_bf16, int num_threads) {
    if ((group != 16 && group != 32) || k % 32) return 1;
    const uint16_t *xb = rounded_rows(x, x_stride, m, k, x_bf16);
    if (mins && !xb) group_sums(x, x_stride, m, k, group, sums);
    matmul(group == 32 ? Q8_G32 : Q8_G16, x, x_stride, m, k, n, (const uint8_t *)codes, k, scales, mins, k / group,
           sums, y, y_stride, xb, num_threads);
    return 0;
}

/* As above for f8 weights (groups of 32, no mins). */
int quantized_matmul_f8(const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t n, const uint8_t *codes,
                        const float *scales, float *y, int64_t y_stride, uint16_t *x_bf16, int num_threads) {
    if (k % 32) return 1;
    matmul(F8, x, x_stride, m, k, n, codes, k, scales, 0, k / 32, 0, y, y_stride,
           rounded_rows(x, x_stride, m, k, x_bf16), num_threads);
    return 0;
}
