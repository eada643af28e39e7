/* The decoder's elementwise steps, each fused into one pass: residual add + RMSNorm, SiLU(gate) * up, the
 * per-head q/k RMSNorm (Qwen3) + rotary embedding, and the K/V store into the paged cache. Compiled once per
 * machine by kernels/cbuild.py and called through ctypes (kernels/cpu_fused.py); kernels/reference.py holds
 * the torch twin of each.
 *
 * Why by hand: at one decode row each of these is 3-8 torch ops of a few hundred elements, and the ops'
 * dispatch costs more than their arithmetic; one call per step of a layer does the same work in one pass.
 *
 * dtype: 0 fp32, 1 bf16 (raw uint16 bits). Rounding: bf16 results round to nearest even wherever torch's
 * eager bf16 ops round (after each op), so the twins agree up to the order of a row's sum of squares.
 * Strides are in elements; an input may be a transposed view (the linear layers' column-major results).
 * Returns 0, or 1 for an unsupported shape or an out-of-range slot. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include <omp.h>

#define MAX_HIDDEN 32768 /* one row's fp32 copy lives on the stack */
#define MAX_HEAD_DIM 1024
#define PARALLEL_ELEMENTS (1 << 16) /* fewer elements than this run on one thread: a fork costs more */

static inline __attribute__((always_inline)) float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void store(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* v rounded to the tensor dtype (identity for fp32): where torch's bf16 op would round */
static inline __attribute__((always_inline)) float rnd(float v, int bf16) {
    return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

static inline int threads_for(int64_t elements, int64_t num_threads) {
    return elements >= PARALLEL_ELEMENTS && num_threads > 1 ? (int)num_threads : 1;
}

/* h [n] (fp32 values of the tensor dtype) -> out[i * out_stride] = RMSNorm(h) * w, as transformers' RMSNorm:
 * bf16 normalises in fp32, rounds, then multiplies by the weight and rounds; fp32 as F.rms_norm. */
static inline __attribute__((always_inline)) void norm_row(const float *h, int64_t n, const void *w, float eps,
                                                           void *out, int64_t out_offset, int bf16) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += h[i] * h[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++) store(out, out_offset + i, load(w, i, bf16) * rnd(h[i] * inv, bf16), bf16);
}

static inline __attribute__((always_inline)) void add_rms_norm_impl(
    const void *x, int64_t x_rs, int64_t x_cs, const void *residual, void *residual_out, const void *weight,
    void *out, int64_t rows, int64_t hidden, float eps, int64_t num_threads, int bf16) {
#pragma omp parallel for num_threads(threads_for(rows * hidden, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float h[MAX_HIDDEN];
        for (int64_t i = 0; i < hidden; i++) {
            const float v = load(x, r * x_rs + i * x_cs, bf16);
            h[i] = residual == NULL ? v : rnd(v + load(residual, r * hidden + i, bf16), bf16);
        }
        if (residual_out != NULL)
            for (int64_t i = 0; i < hidden; i++) store(residual_out, r * hidden + i, h[i], bf16);
        norm_row(h, hidden, weight, eps, out, r * hidden, bf16);
    }
}

/* out = RMSNorm(x + residual) * weight, residual_out = x + residual (rounded to the dtype); residual NULL:
 * out = RMSNorm(x) * weight and residual_out (if not NULL) = x. x: [rows, hidden] at (x_rs, x_cs);
 * residual, residual_out, out: [rows, hidden] contiguous; weight: [hidden]. residual_out may be residual. */
int add_rms_norm(const void *x, int64_t x_rs, int64_t x_cs, const void *residual, void *residual_out,
                 const void *weight, void *out, int64_t rows, int64_t hidden, float eps, int64_t dtype,
                 int64_t num_threads) {
    if (hidden > MAX_HIDDEN || hidden < 1 || (dtype != 0 && dtype != 1)) return 1;
    if (dtype)
        add_rms_norm_impl(x, x_rs, x_cs, residual, residual_out, weight, out, rows, hidden, eps, num_threads, 1);
    else
        add_rms_norm_impl(x, x_rs, x_cs, residual, residual_out, weight, out, rows, hidden, eps, num_threads, 0);
    return 0;
}

#define SILU_CHUNK 512

static inline __attribute__((always_inline)) void silu_and_mul_impl(const void *gate_up, int64_t rs, int64_t cs,
                                                                    void *out, int64_t rows, int64_t inter,
                                                                    int64_t num_threads, int bf16) {
    const int64_t chunks = (inter + SILU_CHUNK - 1) / SILU_CHUNK;
#pragma omp parallel for num_threads(threads_for(rows * inter, num_threads)) schedule(static)
    for (int64_t item = 0; item < rows * chunks; item++) {
        const int64_t r = item / chunks, first = (item % chunks) * SILU_CHUNK;
        const int64_t n = inter - first < SILU_CHUNK ? inter - first : SILU_CHUNK;
        float g[SILU_CHUNK], u[SILU_CHUNK];
        for (int64_t i = 0; i < n; i++) {
            g[i] = load(gate_up, r * rs + (first + i) * cs, bf16);
            u[i] = load(gate_up, r * rs + (inter + first + i) * cs, bf16);
        }
        for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])); /* a loop the compiler vectorizes */
        for (int64_t i = 0; i < n; i++) store(out, r * inter + first + i, rnd(g[i], bf16) * u[i], bf16);
    }
}

/* out [rows, inter] contiguous = SiLU(gate) * up, where gate_up [rows, 2 * inter] at (rs, cs) holds gate then
 * up in each row; bf16 rounds SiLU's result before the product, as torch's two ops do. */
int silu_and_mul(const void *gate_up, int64_t rs, int64_t cs, void *out, int64_t rows, int64_t inter,
                 int64_t dtype, int64_t num_threads) {
    if (dtype != 0 && dtype != 1) return 1;
    if (dtype)
        silu_and_mul_impl(gate_up, rs, cs, out, rows, inter, num_threads, 1);
    else
        silu_and_mul_impl(gate_up, rs, cs, out, rows, inter, num_threads, 0);
    return 0;
}

static inline __attribute__((always_inline)) void rotary_qk_impl(
    const void *qkv, int64_t rs, int64_t cs, const void *cos, const void *sin, const void *q_norm,
    const void *k_norm, float eps, void *q_out, void *k_out, int64_t tokens, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t num_threads, int bf16) {
    const int64_t heads = num_heads + num_kv_heads, half = head_dim / 2;
#pragma omp parallel for num_threads(threads_for(tokens * heads * head_dim, num_threads)) schedule(static)
    for (int64_t item = 0; item < tokens * heads; item++) {
        const int64_t t = item / heads, h = item % heads;
        const int is_q = h < num_heads;
        float x[MAX_HEAD_DIM];
        for (int64_t d = 0; d < head_dim; d++) x[d] = load(qkv, t * rs + (h * head_dim + d) * cs, bf16);
        const void *norm = is_q ? q_norm : k_norm;
        if (norm != NULL) { /* the per-head RMSNorm, written back as the tensor dtype's values */
            float sum = 0.0f;
            for (int64_t d = 0; d < head_dim; d++) sum += x[d] * x[d];
            const float inv = 1.0f / sqrtf(sum / (float)head_dim + eps);
            for (int64_t d = 0; d < head_dim; d++) x[d] = rnd(load(norm, d, bf16) * rnd(x[d] * inv, bf16), bf16);
        }
        void *dst = is_q ? q_out : k_out;
        const int64_t first = is_q ? (t * num_heads + h) * head_dim : (t * num_kv_heads + h - num_heads) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) {
            const float rotated = d < half ? -x[d + half] : x[d - half];
            const float c = load(cos, t * head_dim + d, bf16), s = load(sin, t * head_dim + d, bf16);
            store(dst, first + d, rnd(x[d] * c, bf16) + rnd(rotated * s, bf16), bf16);
        }
    }
}

/* q_out [tokens, num_heads, head_dim] and k_out [tokens, num_kv_heads, head_dim] (contiguous): the first
 * num_heads and the next num_kv_heads heads of each row of qkv [tokens, >= heads * head_dim] at (rs, cs),
 * each optionally RMSNorm-ed over head_dim (q_norm, k_norm: [head_dim] weights, both or neither), then
 * rotated (rotate-half) by cos, sin [tokens, head_dim] contiguous. */
int rotary_qk(const void *qkv, int64_t rs, int64_t cs, const void *cos, const void *sin, const void *q_norm,
              const void *k_norm, float eps, void *q_out, void *k_out, int64_t tokens, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, int64_t dtype, int64_t num_threads) {
    if (head_dim > MAX_HEAD_DIM || head_dim % 2 || (q_norm == NULL) != (k_norm == NULL)) return 1;
    if (dtype != 0 && dtype != 1) return 1;
    if (dtype)
        rotary_qk_impl(qkv, rs, cs, cos, sin, q_norm, k_norm, eps, q_out, k_out, tokens, num_heads, num_kv_heads,
                       head_dim, num_threads, 1);
    else
        rotary_qk_impl(qkv, rs, cs, cos, sin, q_norm, k_norm, eps, q_out, k_out, tokens, num_heads, num_kv_heads,
                       head_dim, num_threads, 0);
    return 0;
}

/* kv_cache [2, num_slots, num_kv_heads, head_dim] contiguous: cache[0, slots[t]] = key[t], cache[1, slots[t]] =
 * value[t], where key / value [tokens, num_kv_heads, head_dim] sit at strides (token, head, dim), all of one
 * dtype (element_size bytes: a plain copy). Returns 1, writing nothing, if any slot is out of range. */
int store_kv(const void *key, int64_t k_ts, int64_t k_hs, int64_t k_ds, const void *value, int64_t v_ts,
             int64_t v_hs, int64_t v_ds, void *kv_cache, const int64_t *slots, int64_t tokens, int64_t num_slots,
             int64_t num_kv_heads, int64_t head_dim, int64_t element_size) {
    if (element_size != 2 && element_size != 4) return 1;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    const int64_t token_size = num_kv_heads * head_dim;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t k_first = slots[t] * token_size, v_first = (num_slots + slots[t]) * token_size;
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int64_t d = 0; d < head_dim; d++) {
                const int64_t dst = h * head_dim + d, k_src = t * k_ts + h * k_hs + d * k_ds;
                const int64_t v_src = t * v_ts + h * v_hs + d * v_ds;
                if (element_size == 2) {
                    ((uint16_t *)kv_cache)[k_first + dst] = ((const uint16_t *)key)[k_src];
                    ((uint16_t *)kv_cache)[v_first + dst] = ((const uint16_t *)value)[v_src];
                } else {
                    ((float *)kv_cache)[k_first + dst] = ((const float *)key)[k_src];
                    ((float *)kv_cache)[v_first + dst] = ((const float *)value)[v_src];
                }
            }
    }
    return 0;
}
