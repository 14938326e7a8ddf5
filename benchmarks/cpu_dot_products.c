/*
 * benchmarks/cpu_dot_products.py builds and runs this: one thread, a q4 weight (the default model's
 * shapes) times 1-64 activation rows, two tile kernels side by side:
 *   f32:  the weight widened to float32 per half group and multiplied with float32 FMAs, as
 *         cluster/engine/kernels/quantized_matmul.c does (its AVX-512 tiles: 4 features by up to 4
 *         rows, 2 by 5-8; the min term left out of both);
 *   bf16: the same widened weight rounded to bfloat16, a group's 32 weights in one vector, against
 *         activations rounded to bfloat16 once per call, with vdpbf16ps (AVX512_BF16: 32 products
 *         a vector where an FMA takes 16).
 *   table: the same bfloat16 weights as bf16 made from a table of scale * 0..15 per group (one
 *         vpermw), as cluster/engine/kernels/quantized_matmul.c does with cpu_matmul_dtype bfloat16.
 * Each line: features, columns, rows, the best of 30 calls of each (ms), the mean |difference|
 * of the f32 and bf16 outputs over the mean |output| (bfloat16's rounding of weights and
 * activations), and 1 when table's outputs equal bf16's bit for bit.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <math.h>
#define AI static inline __attribute__((always_inline))
AI __m512 widen_q4(const uint8_t *codes, const float *scales, int64_t b, int half) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + b * 16));
    if (half) bytes = _mm_srli_epi16(bytes, 4);
    const __m128i nib = _mm_and_si128(bytes, _mm_set1_epi8(15));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nib)), _mm512_set1_ps(scales[b]));
}
AI void tile_f32(const int MB, const int NB, const float *x, int64_t k, const uint8_t *codes, const float *scales, int64_t n0, float *out, int64_t n) {
    __m512 acc[8][4];
    for (int r = 0; r < MB; ++r) for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / 32; ++b)
        for (int half = 0; half < 2; ++half) {
            __m512 w[4];
            for (int j = 0; j < NB; ++j) w[j] = widen_q4(codes + (n0 + j) * (k / 2), scales + (n0 + j) * (k / 32), b, half);
            for (int r = 0; r < MB; ++r) {
                const __m512 xv = _mm512_loadu_ps(x + r * k + b * 32 + half * 16);
                for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(w[j], xv, acc[r][j]);
            }
        }
    for (int r = 0; r < MB; ++r) for (int j = 0; j < NB; ++j) out[r * n + n0 + j] = _mm512_reduce_add_ps(acc[r][j]);
}
AI void tile_bf16(const int MB, const int NB, const uint16_t *xb, int64_t k, const uint8_t *codes, const float *scales, int64_t n0, float *out, int64_t n) {
    __m512 acc[8][4];
    for (int r = 0; r < MB; ++r) for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / 32; ++b) {
        __m512bh w[4];
        for (int j = 0; j < NB; ++j) {
            const uint8_t *c = codes + (n0 + j) * (k / 2); const float *s = scales + (n0 + j) * (k / 32);
            w[j] = _mm512_cvtne2ps_pbh(widen_q4(c, s, b, 1), widen_q4(c, s, b, 0));
        }
        for (int r = 0; r < MB; ++r) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + r * k + b * 32));
            for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], xv);
        }
    }
    for (int r = 0; r < MB; ++r) for (int j = 0; j < NB; ++j) out[r * n + n0 + j] = _mm512_reduce_add_ps(acc[r][j]);
}
/* The same bfloat16 weights as tile_bf16 (scale * q rounded once), made from a 16-entry table per
 * group: scale * 0..15 rounded to bfloat16, looked up by the 32 nibbles with one vpermw. */
AI __m512bh q4_bf16(const uint8_t *codes, const float *scales, int64_t b) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + b * 16));
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(15));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
    const __m512i q = _mm512_cvtepu8_epi16(_mm256_set_m128i(high, low));
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 values = _mm512_mul_ps(iota, _mm512_set1_ps(scales[b]));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);
    return (__m512bh)_mm512_permutexvar_epi16(q, table);
}
AI void tile_table(const int MB, const int NB, const uint16_t *xb, int64_t k, const uint8_t *codes, const float *scales, int64_t n0, float *out, int64_t n) {
    __m512 acc[8][4];
    for (int r = 0; r < MB; ++r) for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / 32; ++b) {
        __m512bh w[4];
        for (int j = 0; j < NB; ++j) w[j] = q4_bf16(codes + (n0 + j) * (k / 2), scales + (n0 + j) * (k / 32), b);
        for (int r = 0; r < MB; ++r) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + r * k + b * 32));
            for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], xv);
        }
    }
    for (int r = 0; r < MB; ++r) for (int j = 0; j < NB; ++j) out[r * n + n0 + j] = _mm512_reduce_add_ps(acc[r][j]);
}
/* int8 dot products (AVX512_VNNI), as llama.cpp multiplies q4 weights: each activation row
 * quantized per group of 32 to int8 (scale max|x| / 127), then vpdpbusd of the weight's 4-bit codes
 * (unsigned) by those bytes, two groups a vector, the int32 sums widened and scaled by the weight's
 * scale times the row's. xq holds each pair of groups as [low halves of both, high halves of both]
 * (the order the codes' nibbles come in), dx the rows' scales per group. */
AI void tile_int8(const int MB, const int NB, const int8_t *xq, const float *dx, int64_t k, const uint8_t *codes,
                  const float *scales, int64_t n0, float *out, int64_t n) {
    __m512 acc[4][4];
    for (int r = 0; r < MB; ++r) for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / 32; b += 2) {
        __m512i w[4];
        __m512 scale[4];
        for (int j = 0; j < NB; ++j) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(codes + (n0 + j) * (k / 2) + b * 16));
            const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi8(15));
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(15));
            w[j] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
            const float *s = scales + (n0 + j) * (k / 32) + b;
            scale[j] = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(s[0]), _mm512_set1_ps(s[1]));
        }
        for (int r = 0; r < MB; ++r) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + r * k + b * 32));
            const float *d = dx + r * (k / 32) + b;
            const __m512 row_scale = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(d[0]), _mm512_set1_ps(d[1]));
            for (int j = 0; j < NB; ++j) {
                const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[j], xv);
                acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(scale[j], row_scale), acc[r][j]);
            }
        }
    }
    for (int r = 0; r < MB; ++r) for (int j = 0; j < NB; ++j) out[r * n + n0 + j] = _mm512_reduce_add_ps(acc[r][j]);
}
/* The scale of a group of 32 activations quantized to integers up to `top` (max|v| / top), and
 * into *inverse its reciprocal (0 for a group of zeros). */
static float group_scale(const float *v, float top, float *inverse) {
    float most = 0;
    for (int i = 0; i < 32; ++i) most = fmaxf(most, fabsf(v[i]));
    const float d = most / top;
    *inverse = d ? 1 / d : 0;
    return d;
}
/* x's rows quantized per group of 32 to int8 for tile_int8 (its layout), their scales into dx. */
static void quantize_rows_int8(const float *x, int m, int64_t k, int8_t *xq, float *dx) {
    for (int r = 0; r < m; ++r)
        for (int64_t g = 0; g < k / 32; ++g) {
            const float *v = x + r * k + g * 32;
            float inverse;
            dx[r * (k / 32) + g] = group_scale(v, 127, &inverse);
            int8_t *pair = xq + r * k + (g & ~1) * 32; /* [low of g, low of g+1, high of g, high of g+1] */
            for (int i = 0; i < 32; ++i) pair[(i / 16) * 32 + (g & 1) * 16 + i % 16] = (int8_t)lrintf(v[i] * inverse);
        }
}
static void mm_int8(int m, const float *x, int8_t *xq, float *dx, int64_t k, int64_t n, const uint8_t *codes,
                    const float *scales, float *out) {
    quantize_rows_int8(x, m, k, xq, dx);
    for (int m0 = 0; m0 < m;) {
        const int mb = m - m0 > 4 ? 4 : m - m0; float *o = out + m0 * n; const int8_t *xr = xq + m0 * k; const float *d = dx + m0 * (k / 32);
        for (int64_t n0 = 0; n0 < n; n0 += 4)
            switch (mb) { case 1: tile_int8(1, 4, xr, d, k, codes, scales, n0, o, n); break;
                case 2: tile_int8(2, 4, xr, d, k, codes, scales, n0, o, n); break;
                case 3: tile_int8(3, 4, xr, d, k, codes, scales, n0, o, n); break;
                default: tile_int8(4, 4, xr, d, k, codes, scales, n0, o, n); }
        m0 += mb;
    }
}
#define RUN(T, MB, NB, X) for (int64_t n0 = 0; n0 < n; n0 += NB) T(MB, NB, X, k, codes, scales, n0, o, n)
static void mm(int bf, int m, const float *x, const uint16_t *xb, int64_t k, int64_t n, const uint8_t *codes, const float *scales, float *out) {
    for (int m0 = 0; m0 < m;) {
        int mb = m - m0 > 8 ? 8 : m - m0; float *o = out + m0 * n; const float *xr = x + m0 * k; const uint16_t *xbr = xb + m0 * k;
        if (bf == 2) {
            switch (mb) { case 1: RUN(tile_table, 1, 4, xbr); break; case 2: RUN(tile_table, 2, 4, xbr); break; case 3: RUN(tile_table, 3, 4, xbr); break;
                case 4: RUN(tile_table, 4, 4, xbr); break; case 5: RUN(tile_table, 5, 2, xbr); break; case 6: RUN(tile_table, 6, 2, xbr); break;
                case 7: RUN(tile_table, 7, 2, xbr); break; default: RUN(tile_table, 8, 2, xbr); }
        } else if (bf) {
            switch (mb) { case 1: RUN(tile_bf16, 1, 4, xbr); break; case 2: RUN(tile_bf16, 2, 4, xbr); break; case 3: RUN(tile_bf16, 3, 4, xbr); break;
                case 4: RUN(tile_bf16, 4, 4, xbr); break; case 5: RUN(tile_bf16, 5, 2, xbr); break; case 6: RUN(tile_bf16, 6, 2, xbr); break;
                case 7: RUN(tile_bf16, 7, 2, xbr); break; default: RUN(tile_bf16, 8, 2, xbr); }
        } else {
            switch (mb) { case 1: RUN(tile_f32, 1, 4, xr); break; case 2: RUN(tile_f32, 2, 4, xr); break; case 3: RUN(tile_f32, 3, 4, xr); break;
                case 4: RUN(tile_f32, 4, 4, xr); break; case 5: RUN(tile_f32, 5, 2, xr); break; case 6: RUN(tile_f32, 6, 2, xr); break;
                case 7: RUN(tile_f32, 7, 2, xr); break; default: RUN(tile_f32, 8, 2, xr); }
        }
        m0 += mb;
    }
}
/* The q8 output layer (int8 codes, a float32 scale per group of 32), three ways per row of x:
 * kind 0, float32 (the engine's cpu_matmul_dtype auto: the weight widened, FMAs);
 * kind 1, int16 activations (x per group of 32 scaled to int16, max|x| / 32767; vpmaddwd of the
 *         codes widened to int16, the int32 pair sums widened and scaled): the weight exact;
 * kind 2, int8 activations (vpdpbusd of x + 128 as unsigned bytes by the codes, less 128 x the
 *         codes' sum, two groups a vector), as llama.cpp's q8_0 dot product. */
AI __m512 widen_q8(const int8_t *c, float scale, int half) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + half * 16)))),
                         _mm512_set1_ps(scale));
}
AI void tile_q8(const int kind, const int MB, const float *x, const int16_t *x16, const uint8_t *xu, const float *dx,
                int64_t k, const int8_t *codes, const float *scales, int64_t n0, float *out, int64_t n) {
    __m512 acc[4][4];
    for (int r = 0; r < MB; ++r) for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    const int64_t groups = k / 32;
    for (int64_t b = 0; b < groups; b += kind == 2 ? 2 : 1)
        for (int j = 0; j < 4; ++j) {
            const int8_t *c = codes + (n0 + j) * k + b * 32; const float *s = scales + (n0 + j) * groups + b;
            if (kind == 0) {
                const __m512 low = widen_q8(c, s[0], 0), high = widen_q8(c, s[0], 1);
                for (int r = 0; r < MB; ++r) {
                    acc[r][j] = _mm512_fmadd_ps(low, _mm512_loadu_ps(x + r * k + b * 32), acc[r][j]);
                    acc[r][j] = _mm512_fmadd_ps(high, _mm512_loadu_ps(x + r * k + b * 32 + 16), acc[r][j]);
                }
            } else if (kind == 1) {
                const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)c));
                for (int r = 0; r < MB; ++r) {
                    const __m512i sums = _mm512_madd_epi16(w, _mm512_loadu_si512((const void *)(x16 + r * k + b * 32)));
                    acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(s[0] * dx[r * groups + b]), acc[r][j]);
                }
            } else {
                const __m512i w = _mm512_loadu_si512((const void *)c);
                const __m512i offset = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), w), 7);
                for (int r = 0; r < MB; ++r) {
                    const __m512i dots = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                          _mm512_loadu_si512((const void *)(xu + r * k + b * 32)), w), offset);
                    const __m512 scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[0] * dx[r * groups + b]),
                                                              _mm512_set1_ps(s[1] * dx[r * groups + b + 1]));
                    acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), scale, acc[r][j]);
                }
            }
        }
    for (int r = 0; r < MB; ++r) for (int j = 0; j < 4; ++j) out[r * n + n0 + j] = _mm512_reduce_add_ps(acc[r][j]);
}
static void mm_q8(int kind, int m, const float *x, int16_t *x16, uint8_t *xu, float *dx, int64_t k, int64_t n,
                  const int8_t *codes, const float *scales, float *out) {
    if (kind)  /* the rows quantized per group, as a call would */
        for (int r = 0; r < m; ++r)
            for (int64_t g = 0; g < k / 32; ++g) {
                const float *v = x + r * k + g * 32;
                float inverse;
                dx[r * (k / 32) + g] = group_scale(v, kind == 1 ? 32767 : 127, &inverse);
                for (int i = 0; i < 32; ++i) {
                    if (kind == 1) x16[r * k + g * 32 + i] = (int16_t)lrintf(v[i] * inverse);
                    else xu[r * k + g * 32 + i] = (uint8_t)(lrintf(v[i] * inverse) + 128);
                }
            }
    for (int64_t n0 = 0; n0 < n; n0 += 4)
        switch (m) { case 1: tile_q8(kind, 1, x, x16, xu, dx, k, codes, scales, n0, out, n); break;
            case 2: tile_q8(kind, 2, x, x16, xu, dx, k, codes, scales, n0, out, n); break;
            default: tile_q8(kind, 4, x, x16, xu, dx, k, codes, scales, n0, out, n); }
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(void) {
    int64_t shapes[3][2] = {{3072, 576}, {576, 1536}, {960, 576}};
    int rows[] = {1, 2, 4, 8, 20, 64};
    for (int s = 0; s < 3; ++s) {
        int64_t n = shapes[s][0], k = shapes[s][1];
        uint8_t *codes = malloc(n * k / 2); float *scales = malloc(n * k / 32 * 4);
        for (int64_t i = 0; i < n * k / 2; ++i) codes[i] = rand();
        for (int64_t i = 0; i < n * k / 32; ++i) scales[i] = 0.01f * (1 + rand() % 7);
        float *x = malloc(64 * k * 4); uint16_t *xb = malloc(64 * k * 2); float *o1 = malloc(64 * n * 4), *o2 = malloc(64 * n * 4), *o3 = malloc(64 * n * 4), *o4 = malloc(64 * n * 4);
        int8_t *xq = malloc(64 * k); float *dx = malloc(64 * k / 32 * 4);
        for (int64_t i = 0; i < 64 * k; ++i) { x[i] = (rand() % 2001 - 1000) / 1000.0f; uint32_t u; memcpy(&u, &x[i], 4); xb[i] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16); }
        for (int ri = 0; ri < 6; ++ri) {
            int m = rows[ri]; double best[3] = {1e9, 1e9, 1e9}; float *outs[3] = {o1, o2, o3};
            for (int bf = 0; bf < 3; ++bf)
                for (int rep = 0; rep < 30; ++rep) { double t = now(); mm(bf, m, x, xb, k, n, codes, scales, outs[bf]); t = now() - t; if (t < best[bf]) best[bf] = t; }
            double int8_best = 1e9;
            for (int rep = 0; rep < 30; ++rep) { double t = now(); mm_int8(m, x, xq, dx, k, n, codes, scales, o4); t = now() - t; if (t < int8_best) int8_best = t; }
            double err = 0, err8 = 0, mag = 0; int same = 1;
            for (int64_t i = 0; i < m * n; ++i) { err += fabsf(o1[i] - o2[i]); err8 += fabsf(o1[i] - o4[i]); mag += fabsf(o1[i]); same &= o2[i] == o3[i]; }
            printf("%ld %ld %d %.4f %.4f %.4f %.3e %d %.4f %.3e\n", (long)n, (long)k, m, best[0] * 1e3, best[1] * 1e3, best[2] * 1e3, err / mag, same,
                   int8_best * 1e3, err8 / mag);
        }
    }
    { /* the q8 output layer: lines "head n k m f32_ms int16_ms int8_ms int16_diff int8_diff" (diffs against f32) */
        const int64_t n = 49152, k = 576;
        int8_t *codes = malloc(n * k); float *scales = malloc(n * k / 32 * 4);
        for (int64_t i = 0; i < n * k; ++i) codes[i] = (int8_t)(rand() % 255 - 127);
        for (int64_t i = 0; i < n * k / 32; ++i) scales[i] = 0.001f * (1 + rand() % 100);
        float *x = malloc(4 * k * 4), *dx = malloc(4 * k / 32 * 4), *outs[3];
        int16_t *x16 = malloc(4 * k * 2); uint8_t *xu = malloc(4 * k);
        for (int64_t i = 0; i < 4 * k; ++i) x[i] = (rand() % 2001 - 1000) / 100.0f;
        for (int kind = 0; kind < 3; ++kind) outs[kind] = malloc(4 * n * 4);
        const int head_rows[] = {1, 2, 4};
        for (int ri = 0; ri < 3; ++ri) {
            const int m = head_rows[ri]; double best[3] = {1e9, 1e9, 1e9};
            for (int kind = 0; kind < 3; ++kind)
                for (int rep = 0; rep < 30; ++rep) { double t = now(); mm_q8(kind, m, x, x16, xu, dx, k, n, codes, scales, outs[kind]); t = now() - t; if (t < best[kind]) best[kind] = t; }
            double err[3] = {0}, mag = 0;
            for (int64_t i = 0; i < m * n; ++i) { mag += fabsf(outs[0][i]); for (int kind = 1; kind < 3; ++kind) err[kind] += fabsf(outs[kind][i] - outs[0][i]); }
            printf("head %ld %ld %d %.4f %.4f %.4f %.3e %.3e\n", (long)n, (long)k, m, best[0] * 1e3, best[1] * 1e3, best[2] * 1e3, err[1] / mag, err[2] / mag);
        }
    }
    return 0;
}
