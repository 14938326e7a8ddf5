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
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(void) {
    int64_t shapes[3][2] = {{3072, 576}, {576, 1536}, {960, 576}};
    int rows[] = {1, 2, 4, 8, 20, 64};
    for (int s = 0; s < 3; ++s) {
        int64_t n = shapes[s][0], k = shapes[s][1];
        uint8_t *codes = malloc(n * k / 2); float *scales = malloc(n * k / 32 * 4);
        for (int64_t i = 0; i < n * k / 2; ++i) codes[i] = rand();
        for (int64_t i = 0; i < n * k / 32; ++i) scales[i] = 0.01f * (1 + rand() % 7);
        float *x = malloc(64 * k * 4); uint16_t *xb = malloc(64 * k * 2); float *o1 = malloc(64 * n * 4), *o2 = malloc(64 * n * 4), *o3 = malloc(64 * n * 4);
        for (int64_t i = 0; i < 64 * k; ++i) { x[i] = (rand() % 2001 - 1000) / 1000.0f; uint32_t u; memcpy(&u, &x[i], 4); xb[i] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16); }
        for (int ri = 0; ri < 6; ++ri) {
            int m = rows[ri]; double best[3] = {1e9, 1e9, 1e9}; float *outs[3] = {o1, o2, o3};
            for (int bf = 0; bf < 3; ++bf)
                for (int rep = 0; rep < 30; ++rep) { double t = now(); mm(bf, m, x, xb, k, n, codes, scales, outs[bf]); t = now() - t; if (t < best[bf]) best[bf] = t; }
            double err = 0, mag = 0; int same = 1;
            for (int64_t i = 0; i < m * n; ++i) { err += fabsf(o1[i] - o2[i]); mag += fabsf(o1[i]); same &= o2[i] == o3[i]; }
            printf("%ld %ld %d %.4f %.4f %.4f %.3e %d\n", (long)n, (long)k, m, best[0] * 1e3, best[1] * 1e3, best[2] * 1e3, err / mag, same);
        }
    }
    return 0;
}
