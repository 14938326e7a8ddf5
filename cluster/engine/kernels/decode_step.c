/*
 * A whole step of a Llama-family decoder in one call, float32 activations, on the CPU: decode
 * tokens and short prompt chunks, each row attending to its request's cache up to its position
 * (every row's keys and values are written before any row attends).
 *
 * Why: a 30-layer model's step run op by op from Python spends more time dispatching (about 40
 * torch ops and five ctypes calls a layer, ~6 ms a step on 2 cores for SmolLM2-135M) than reading
 * its quantized weights (~3.7 ms). Here the step is one call: per layer RMSNorm, the fused QKV
 * projection (+ bias), per-head q/k RMSNorm where the model has it, rotary ("rotate half"), the new
 * keys and values written to their cache slots, paged attention, the output projection and the
 * residual, RMSNorm, gate/up, silu(gate) * up, down and the residual; then the final RMSNorm.
 *
 * The arithmetic is the torch path's (cluster/engine/models/decoder.py), in the same order per
 * element; sums may add in another order. Matmuls are quantized_matmul.c's, attention is
 * paged_decode_attention.c's: both are compiled into this library.
 */
#include "paged_decode_attention.c"
#include "quantized_matmul.c"

#include <math.h>

/* One row block of a linear layer's weight: kind Q4, Q8_G32, Q8_G16, F8 or F32. */
typedef struct {
    int64_t kind, first, rows;
    const void *codes;
    const float *scales, *mins;
    int64_t bf16_dots; /* multiplied with bfloat16 dot products (quantized_matmul.c) */
} weight_part;

typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm: NULL without QK norm */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* NULL where the layer has none */
    weight_part qkv[3], o[1], gate_up[2], down[1];
    int64_t qkv_parts, gate_up_parts;
    void *k_cache, *v_cache; /* [blocks, block_size, kv_heads, head_dim (+ 4 scale bytes for 8 bits)] */
} layer_weights;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, window, max_blocks;
    int64_t kv_kind; /* KV_FLOAT, KV_INT8 or KV_FP8: see cluster/engine/quantization/kv_format.py */
    float eps, scale;
    const float *cos, *sin; /* [positions, head_dim] */
    const float *final_norm;
    const layer_weights *layers;
} model_weights;

/* x_bf16: scratch of m * k halves: x is rounded into it once for the parts that take bfloat16 dot
 * products. */
static void linear(const weight_part *parts, int64_t count, const float *x, int64_t m, int64_t k, float *y,
                   int64_t y_stride, const float *bias, float *sums, uint16_t *x_bf16, int threads) {
    int any_bf16 = 0;
    for (int64_t p = 0; p < count; ++p) any_bf16 |= parts[p].kind != F32 && parts[p].bf16_dots;
    const uint16_t *rounded = any_bf16 ? rounded_rows(x, k, m, k, x_bf16) : 0;
    for (int64_t p = 0; p < count; ++p) {
        const weight_part *w = &parts[p];
        float *out = y + w->first;
        if (w->kind == F32) {
            matmul(F32, x, k, m, k, w->rows, w->codes, k * 4, 0, 0, 0, 0, out, y_stride, 0, threads);
            continue;
        }
        const int64_t group = w->kind == Q8_G16 ? 16 : 32, groups = k / group;
        const uint16_t *xb = w->bf16_dots ? rounded : 0;
        if (w->mins && !xb) group_sums(x, k, m, k, group, sums);
        matmul((int)w->kind, x, k, m, k, w->rows, w->codes, w->kind == Q4 ? k / 2 : k, w->scales, w->mins, groups,
               sums, out, y_stride, xb, threads);
    }
    if (bias)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t j = 0; j < y_stride; ++j) y[r * y_stride + j] += bias[j];
}

enum { KV_FLOAT = 0, KV_INT8 = 1, KV_FP8 = 2 };

/* The e4m3fn code nearest to a (|a| <= 448), ties to the even code, as torch's conversion rounds;
 * values: the 256 codes' values. */
static uint8_t nearest_e4m3(float a, const float *values) {
    const int negative = a < 0.0f;
    a = fabsf(a);
    int lo = 0, hi = 126; /* positive codes, increasing */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (values[mid] <= a) lo = mid; else hi = mid - 1;
    }
    if (lo < 126) {
        const float below = a - values[lo], above = values[lo + 1] - a;
        if (above < below || (above == below && (lo & 1))) ++lo;
    }
    return (uint8_t)(lo | (negative ? 0x80 : 0));
}

/* One head's row into an 8-bit cache row: codes then the float32 scale (amax / 127 or / 448). */
static void store_8bit(const float *x, int64_t d, int64_t kind, const float *e4m3_values, int8_t *row) {
    float amax = 0.0f;
    for (int64_t i = 0; i < d; ++i) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    float scale = amax / (kind == KV_INT8 ? 127.0f : 448.0f);
    if (!(scale > 0.0f)) scale = 1.0f;
    for (int64_t i = 0; i < d; ++i) {
        const float scaled = x[i] / scale;
        if (kind == KV_INT8) {
            const float r = nearbyintf(scaled);
            row[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        } else {
            row[i] = (int8_t)nearest_e4m3(scaled, e4m3_values);
        }
    }
    memcpy(row + d, &scale, sizeof scale);
}

/* out = weight * (x * rsqrt(mean(x^2) + eps)), row by row, as RMSNorm.forward does. */
static void rms_norm(const float *x, const float *weight, int64_t rows, int64_t n, float eps, float *out) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        float squares = 0.0f;
        for (int64_t i = 0; i < n; ++i) squares += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(squares / (float)n + eps);
        for (int64_t i = 0; i < n; ++i) o[i] = weight[i] * (xr[i] * inv);
    }
}

/* x * cos + rotate_half(x) * sin for one head, in place. */
static void rotate(float *x, const float *cos, const float *sin, int64_t d) {
    const int64_t half = d / 2;
    float rotated[512];
    for (int64_t i = 0; i < half; ++i) rotated[i] = -x[i + half];
    for (int64_t i = half; i < d; ++i) rotated[i] = x[i - half];
    for (int64_t i = 0; i < d; ++i) x[i] = x[i] * cos[i] + rotated[i] * sin[i];
}

/* hidden: [rows, hidden], the step's embeddings in, the final norm's output out. scratch: see
 * decode_step_scratch_floats. Returns 0, 1 for unsupported shapes, -1 when attention's scratch
 * memory could not be allocated. */
int decode_step(const model_weights *m, float *hidden, int64_t rows, const int64_t *positions, const int64_t *slots,
                const int64_t *block_table, const int64_t *lengths, float *scratch, int threads) {
    const int64_t H = m->hidden, D = m->head_dim, I = m->intermediate;
    const int64_t q_width = m->heads * D, kv_width = m->kv_heads * D, qkv_width = q_width + 2 * kv_width;
    if (D > 512 || H % 32 || I % 32 || q_width % 32) return 1;
    float *normed = scratch, *qkv = normed + rows * H, *attended = qkv + rows * qkv_width;
    float *projected = attended + rows * q_width, *gate_up = projected + rows * H, *act = gate_up + rows * 2 * I;
    float *sums = act + rows * I;
    const int64_t widest = H > I ? H : I;
    uint16_t *x_bf16 = (uint16_t *)(sums + rows * (widest / 16));
    float e4m3_values[256];
    for (int b = 0; b < 256; ++b) e4m3_values[b] = e4m3fn_value((uint8_t)b);
    const int64_t row_bytes = m->kv_kind == KV_FLOAT ? D * 4 : D + 4;

    for (int64_t l = 0; l < m->num_layers; ++l) {
        const layer_weights *w = &m->layers[l];
        rms_norm(hidden, w->input_norm, rows, H, m->eps, normed);
        linear(w->qkv, w->qkv_parts, normed, rows, H, qkv, qkv_width, w->qkv_bias, sums, x_bf16, threads);
        for (int64_t r = 0; r < rows; ++r) {
            float *q = qkv + r * qkv_width, *k = q + q_width, *v = k + kv_width;
            if (w->q_norm) {
                for (int64_t h = 0; h < m->heads; ++h) rms_norm(q + h * D, w->q_norm, 1, D, m->eps, q + h * D);
                for (int64_t h = 0; h < m->kv_heads; ++h) rms_norm(k + h * D, w->k_norm, 1, D, m->eps, k + h * D);
            }
            const float *cos = m->cos + positions[r] * D, *sin = m->sin + positions[r] * D;
            for (int64_t h = 0; h < m->heads; ++h) rotate(q + h * D, cos, sin, D);
            for (int64_t h = 0; h < m->kv_heads; ++h) rotate(k + h * D, cos, sin, D);
            char *k_row = (char *)w->k_cache + slots[r] * m->kv_heads * row_bytes;
            char *v_row = (char *)w->v_cache + slots[r] * m->kv_heads * row_bytes;
            if (m->kv_kind == KV_FLOAT) {
                memcpy(k_row, k, sizeof(float) * kv_width);
                memcpy(v_row, v, sizeof(float) * kv_width);
            } else {
                for (int64_t h = 0; h < m->kv_heads; ++h) {
                    store_8bit(k + h * D, D, m->kv_kind, e4m3_values, (int8_t *)k_row + h * row_bytes);
                    store_8bit(v + h * D, D, m->kv_kind, e4m3_values, (int8_t *)v_row + h * row_bytes);
                }
            }
        }
        const int failed =
            m->kv_kind == KV_FLOAT
                ? paged_decode_attention_f32(qkv, qkv_width, w->k_cache, w->v_cache, block_table, m->max_blocks,
                                             lengths, rows, m->heads, m->kv_heads, D, m->block_size, m->window,
                                             m->scale, attended, q_width, threads)
                : paged_decode_attention_8bit(qkv, qkv_width, w->k_cache, w->v_cache, block_table, m->max_blocks,
                                              lengths, rows, m->heads, m->kv_heads, D, m->block_size, m->window,
                                              m->scale, m->kv_kind == KV_FP8, attended, q_width, threads);
        if (failed) return -1;
        linear(w->o, 1, attended, rows, q_width, projected, H, w->o_bias, sums, x_bf16, threads);
        for (int64_t i = 0; i < rows * H; ++i) hidden[i] += projected[i];

        rms_norm(hidden, w->post_norm, rows, H, m->eps, normed);
        linear(w->gate_up, w->gate_up_parts, normed, rows, H, gate_up, 2 * I, w->gate_up_bias, sums, x_bf16, threads);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t i = 0; i < I; ++i) {
                const float g = gate_up[r * 2 * I + i];
                act[r * I + i] = g / (1.0f + expf(-g)) * gate_up[r * 2 * I + I + i];
            }
        linear(w->down, 1, act, rows, I, projected, H, w->down_bias, sums, x_bf16, threads);
        for (int64_t i = 0; i < rows * H; ++i) hidden[i] += projected[i];
    }
    rms_norm(hidden, m->final_norm, rows, H, m->eps, hidden);
    return 0;
}

/* Floats of scratch decode_step needs for `rows` rows. */
int64_t decode_step_scratch_floats(const model_weights *m, int64_t rows) {
    const int64_t H = m->hidden, D = m->head_dim, I = m->intermediate;
    const int64_t q_width = m->heads * D, qkv_width = q_width + 2 * m->kv_heads * D;
    const int64_t widest = H > I ? H : I, widest_input = widest > q_width ? widest : q_width;
    /* the last term: the bfloat16 rows of the widest matmul input (two to a float) */
    return rows * (H + qkv_width + q_width + H + 2 * I + I + widest / 16 + (widest_input + 1) / 2);
}
