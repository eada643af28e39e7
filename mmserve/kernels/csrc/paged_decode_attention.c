/* Decode attention over the paged KV cache on the CPU: one query row per sequence, read straight from the
 * cache blocks (no gather copy). The reference twin is kernels/reference.py::_decode_attention; this file
 * is compiled once per machine (kernels/cbuild.py) and called through ctypes by kernels/cpu_attention.py.
 *
 * Layouts (contiguous):
 *   query, out:   [num_tokens, num_heads, head_dim] fp32; sequence s owns row rows[s]
 *   kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V), kv_dtype: fp32 (0);
 *                 one-byte FP8 codes (1) with `byte_table` ([256] fp32: each byte's value; kernels/fp8.py),
 *                 K = byte_table[code] * k_scale[kv_head] and V likewise with v_scale; or bf16 (2), widened.
 *   block_tables: [num_seqs, block_table_stride] int64; seq_lens, rows: [num_seqs] int64
 * Query head h reads KV head h / group (transformers' repeat_kv order). A work item is one sequence's
 * KV heads [kv_first, kv_first + kv_count) and their query heads: one pass over those keys, one over the
 * values. Whole sequences when there are enough of them for the threads, since a token's K (and V) rows
 * of all heads are contiguous (1.4x faster than a pass per KV head); single KV heads otherwise.
 * Built with -ffast-math (vectorised expf, reassociated sums), so inputs must be finite.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_HEADS 64

typedef struct {
    const float *k_cache, *v_cache;    /* fp32 caches (kv_dtype KV_FP32) */
    const uint8_t *k_codes, *v_codes;  /* FP8 caches (KV_FP8: byte_table != NULL) */
    const uint16_t *k_bf16, *v_bf16;   /* bf16 caches (KV_BF16): raw bits */
    const float *byte_table, *k_scale, *v_scale;
    int64_t block_size, token_stride, block_stride, group, kv_dtype;
    float scale;
} Shape;

enum { KV_FP32 = 0, KV_FP8 = 1, KV_BF16 = 2 };

/* Rows [0, n) of one cache block, KV heads [kv_first, kv_first + kv_count), as fp32: the fp32 cache itself
 * (*stride = token_stride), or bf16 values widened / FP8 codes decoded and scaled into buf [n, kv_count,
 * head_dim]. */
static const float *block_rows(const Shape *sh, const float *cache, const uint8_t *codes, const uint16_t *half,
                               const float *scale, int64_t block, int64_t n, int64_t kv_first, int64_t kv_count,
                               int64_t head_dim, float *restrict buf, int64_t *stride) {
    const int64_t first = block * sh->block_stride + kv_first * head_dim;
    if (sh->kv_dtype == KV_FP32) {
        *stride = sh->token_stride;
        return cache + first;
    }
    *stride = kv_count * head_dim;
    if (sh->kv_dtype == KV_BF16) {
        for (int64_t j = 0; j < n; j++) {
            const uint16_t *restrict src = half + first + j * sh->token_stride;
            uint32_t *restrict dst = (uint32_t *)(buf + j * kv_count * head_dim);
            for (int64_t d = 0; d < kv_count * head_dim; d++) dst[d] = (uint32_t)src[d] << 16;
        }
        return buf;
    }
    const float *restrict table = sh->byte_table;
    for (int64_t j = 0; j < n; j++)
        for (int64_t h = 0; h < kv_count; h++) {
            const uint8_t *restrict src = codes + first + j * sh->token_stride + h * head_dim;
            float *restrict dst = buf + (j * kv_count + h) * head_dim;
            const float s = scale[kv_first + h];
            for (int64_t d = 0; d < head_dim; d++) dst[d] = table[src[d]] * s;
        }
    return buf;
}

/* One work item: q, o: [heads, head_dim] (heads = kv_count * group, consecutive); scores: [heads, len]
 * scratch; buf: [block_size, kv_count, head_dim] scratch for decoded FP8 rows. HEAD_DIM is a compile-time
 * constant in the specialised copies so the inner loops unroll. */
#define DEFINE_ATTEND(NAME, HEAD_DIM)                                                                      \
    static void NAME(const Shape *sh, const int64_t *table, int64_t len, int64_t kv_first, int64_t heads, \
                     int64_t head_dim, const float *restrict q, float *restrict o, float *restrict scores, \
                     float *restrict buf) {                                                               \
        const int64_t D = (HEAD_DIM), bs = sh->block_size, group = sh->group, kv_count = heads / group;   \
        int64_t stride;                                                                                   \
        (void)head_dim;                                                                                   \
        float row_max[MAX_HEADS], row_sum[MAX_HEADS];                                                     \
        for (int64_t h = 0; h < heads; h++) row_max[h] = -FLT_MAX;                                        \
        for (int64_t start = 0; start < len; start += bs) {                                               \
            const int64_t n = len - start < bs ? len - start : bs;                                        \
            const float *block = block_rows(sh, sh->k_cache, sh->k_codes, sh->k_bf16, sh->k_scale, table[start / bs], n, \
                                            kv_first, kv_count, D, buf, &stride);                         \
            for (int64_t j = 0; j < n; j++) {                                                             \
                const float *restrict k = block + j * stride;                                             \
                for (int64_t h = 0; h < heads; h++) {                                                     \
                    const float *restrict qh = q + h * D, *restrict kh = k + (h / group) * D;             \
                    float dot = 0.0f;                                                                     \
                    _Pragma("omp simd reduction(+ : dot)") for (int64_t d = 0; d < D; d++) dot += qh[d] * kh[d]; \
                    dot *= sh->scale;                                                                     \
                    scores[h * len + start + j] = dot;                                                    \
                    row_max[h] = dot > row_max[h] ? dot : row_max[h];                                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int64_t h = 0; h < heads; h++) {                                                             \
            float *restrict sh_row = scores + h * len;                                                    \
            const float m = row_max[h];                                                                   \
            float sum = 0.0f;                                                                             \
            _Pragma("omp simd reduction(+ : sum)") for (int64_t t = 0; t < len; t++) {                    \
                sh_row[t] = expf(sh_row[t] - m);                                                          \
                sum += sh_row[t];                                                                         \
            }                                                                                             \
            row_sum[h] = sum;                                                                             \
        }                                                                                                 \
        for (int64_t i = 0; i < heads * D; i++) o[i] = 0.0f; /* accumulated in place: this item's rows */\
        for (int64_t start = 0; start < len; start += bs) {                                               \
            const int64_t n = len - start < bs ? len - start : bs;                                        \
            const float *block = block_rows(sh, sh->v_cache, sh->v_codes, sh->v_bf16, sh->v_scale, table[start / bs], n, \
                                            kv_first, kv_count, D, buf, &stride);                         \
            for (int64_t j = 0; j < n; j++) {                                                             \
                const float *restrict v = block + j * stride;                                             \
                for (int64_t h = 0; h < heads; h++) {                                                     \
                    const float p = scores[h * len + start + j];                                          \
                    const float *restrict vh = v + (h / group) * D;                                       \
                    float *restrict oh = o + h * D;                                                       \
                    _Pragma("omp simd") for (int64_t d = 0; d < D; d++) oh[d] += p * vh[d];               \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int64_t h = 0; h < heads; h++) {                                                             \
            const float inv = 1.0f / row_sum[h];                                                          \
            for (int64_t d = 0; d < D; d++) o[h * D + d] *= inv;                                          \
        }                                                                                                 \
    }

DEFINE_ATTEND(attend_64, 64)
DEFINE_ATTEND(attend_128, 128)
DEFINE_ATTEND(attend_any, head_dim)

/* Sequences [seq_begin, seq_end) of the decode batch, work items spread over num_threads OpenMP threads
 * (linked against the runtime torch already loaded, so they are torch's own pool).
 * Returns 0, or 1 for an unsupported shape, 2 when out of memory. */
int paged_decode_attention(const float *query, const void *kv_cache, int64_t kv_dtype, const float *byte_table,
                           const float *kv_scales, const int64_t *block_tables,
                           int64_t block_table_stride, const int64_t *seq_lens, const int64_t *rows,
                           float *out, int64_t seq_begin, int64_t seq_end, int64_t num_blocks,
                           int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           float scale, int64_t num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    if (num_heads > MAX_HEADS || group * num_kv_heads != num_heads) return 1;
    const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
    /* kv_scales: [2, num_kv_heads] (K then V), read only with a byte table */
    if (kv_dtype != KV_FP32 && kv_dtype != KV_FP8 && kv_dtype != KV_BF16) return 1;
    if ((kv_dtype == KV_FP8) != (byte_table != NULL)) return 1;
    const float *k_cache = kv_cache, *k_scale = kv_scales;
    const uint8_t *k_codes = kv_cache;
    const uint16_t *k_bf16 = kv_cache;
    const Shape sh = {k_cache, k_cache + num_blocks * block_stride, k_codes, k_codes + num_blocks * block_stride,
                      k_bf16, k_bf16 + num_blocks * block_stride,
                      byte_table, k_scale, k_scale == NULL ? NULL : k_scale + num_kv_heads,
                      block_size, token_stride, block_stride, group, kv_dtype, scale};
    const int64_t num_seqs = seq_end - seq_begin;
    if (num_threads < 1) num_threads = 1;
    /* whole sequences when each thread gets at least two, else one KV head per item */
    const int64_t kv_count = num_seqs >= 2 * num_threads ? num_kv_heads : 1;
    const int64_t items_per_seq = num_kv_heads / kv_count, heads = kv_count * group;
    int64_t max_len = 1;
    for (int64_t s = seq_begin; s < seq_end; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* [heads, len] scores, then [block_size, kv_count, head_dim] widened bf16 / decoded FP8 rows */
        float *scores = malloc(sizeof(float) * (size_t)(heads * max_len + block_size * kv_count * head_dim));
        float *buf = scores == NULL ? NULL : scores + heads * max_len;
        if (scores == NULL) failed = 2;
        /* every thread must reach the worksharing loop, even one whose allocation failed */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * items_per_seq; item++) {
            if (scores == NULL) continue;
            const int64_t s = seq_begin + item / items_per_seq, kv_first = (item % items_per_seq) * kv_count;
            const int64_t *table = block_tables + s * block_table_stride;
            const int64_t first = (rows[s] * num_heads + kv_first * group) * head_dim;
            const float *q = query + first;
            float *o = out + first;
            if (head_dim == 64)
                attend_64(&sh, table, seq_lens[s], kv_first, heads, head_dim, q, o, scores, buf);
            else if (head_dim == 128)
                attend_128(&sh, table, seq_lens[s], kv_first, heads, head_dim, q, o, scores, buf);
            else
                attend_any(&sh, table, seq_lens[s], kv_first, heads, head_dim, q, o, scores, buf);
        }
        free(scores);
    }
    return failed;
}
