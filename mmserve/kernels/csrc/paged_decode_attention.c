/* Decode attention over the paged KV cache on the CPU: one query row per sequence, read straight from the
 * cache blocks (no gather copy). The reference twin is kernels/reference.py::_decode_attention; this file
 * is compiled once per machine by kernels/cpu_attention.py and called through ctypes.
 *
 * Layouts (fp32, contiguous):
 *   query, out:   [num_tokens, num_heads, head_dim]; sequence s owns row rows[s]
 *   kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V)
 *   block_tables: [num_seqs, block_table_stride] int64; seq_lens, rows: [num_seqs] int64
 * Query head h reads KV head h / group (transformers' repeat_kv order): the group of query heads that
 * share a KV head is served by one pass over that head's keys and one over its values.
 * Built with -ffast-math (vectorised expf, reassociated sums), so inputs must be finite.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_GROUP 16

typedef struct {
    const float *k_cache, *v_cache;
    int64_t block_size, token_stride, block_stride, group, head_dim;
    float scale;
} Shape;

/* One (sequence, KV head): q, o: [group, head_dim]; scores: [group, len] scratch. HEAD_DIM is a
 * compile-time constant in the specialised copies so that the inner loops unroll fully. */
#define DEFINE_ATTEND(NAME, HEAD_DIM)                                                                      \
    static void NAME(const Shape *sh, const int64_t *table, int64_t len, int64_t kv_off,                  \
                     const float *restrict q, float *restrict o, float *restrict scores) {                 \
        const int64_t D = (HEAD_DIM), G = sh->group, bs = sh->block_size;                                 \
        float row_max[MAX_GROUP], row_sum[MAX_GROUP];                                                     \
        for (int64_t g = 0; g < G; g++) row_max[g] = -FLT_MAX;                                            \
        for (int64_t start = 0; start < len; start += bs) {                                               \
            const float *base = sh->k_cache + table[start / bs] * sh->block_stride + kv_off;              \
            const int64_t n = len - start < bs ? len - start : bs;                                        \
            for (int64_t j = 0; j < n; j++) {                                                             \
                const float *restrict k = base + j * sh->token_stride;                                    \
                for (int64_t g = 0; g < G; g++) {                                                         \
                    const float *restrict qg = q + g * D;                                                 \
                    float dot = 0.0f;                                                                     \
                    _Pragma("omp simd reduction(+ : dot)") for (int64_t d = 0; d < D; d++) dot += qg[d] * k[d]; \
                    dot *= sh->scale;                                                                     \
                    scores[g * len + start + j] = dot;                                                    \
                    row_max[g] = dot > row_max[g] ? dot : row_max[g];                                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int64_t g = 0; g < G; g++) {                                                                 \
            float *restrict sg = scores + g * len;                                                        \
            const float m = row_max[g];                                                                   \
            float sum = 0.0f;                                                                             \
            _Pragma("omp simd reduction(+ : sum)") for (int64_t t = 0; t < len; t++) {                    \
                sg[t] = expf(sg[t] - m);                                                                  \
                sum += sg[t];                                                                             \
            }                                                                                             \
            row_sum[g] = sum;                                                                             \
        }                                                                                                 \
        float acc[MAX_GROUP * (HEAD_DIM)];                                                                \
        for (int64_t i = 0; i < G * D; i++) acc[i] = 0.0f;                                                \
        for (int64_t start = 0; start < len; start += bs) {                                               \
            const float *base = sh->v_cache + table[start / bs] * sh->block_stride + kv_off;              \
            const int64_t n = len - start < bs ? len - start : bs;                                        \
            for (int64_t j = 0; j < n; j++) {                                                             \
                const float *restrict v = base + j * sh->token_stride;                                    \
                for (int64_t g = 0; g < G; g++) {                                                         \
                    const float p = scores[g * len + start + j];                                          \
                    float *restrict ag = acc + g * D;                                                     \
                    _Pragma("omp simd") for (int64_t d = 0; d < D; d++) ag[d] += p * v[d];                \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int64_t g = 0; g < G; g++) {                                                                 \
            const float inv = 1.0f / row_sum[g];                                                          \
            for (int64_t d = 0; d < D; d++) o[g * D + d] = acc[g * D + d] * inv;                          \
        }                                                                                                 \
    }

DEFINE_ATTEND(attend_64, 64)
DEFINE_ATTEND(attend_128, 128)
DEFINE_ATTEND(attend_any, sh->head_dim)

/* Sequences [seq_begin, seq_end) of the decode batch, (sequence, KV head) pairs spread over num_threads
 * OpenMP threads (linked against the runtime torch already loaded, so they are torch's own pool).
 * Returns 0, or 1 for an unsupported shape, 2 when out of memory. */
int paged_decode_attention(const float *query, const float *kv_cache, const int64_t *block_tables,
                           int64_t block_table_stride, const int64_t *seq_lens, const int64_t *rows,
                           float *out, int64_t seq_begin, int64_t seq_end, int64_t num_blocks,
                           int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           float scale, int64_t num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > 256 || group * num_kv_heads != num_heads) return 1;
    const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
    const Shape sh = {kv_cache, kv_cache + num_blocks * block_stride, block_size, token_stride,
                      block_stride, group, head_dim, scale};
    int64_t max_len = 1;
    for (int64_t s = seq_begin; s < seq_end; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    const int64_t num_items = (seq_end - seq_begin) * num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * max_len)); /* [group, len] */
        if (scores == NULL) failed = 2;
        /* every thread must reach the worksharing loop, even one whose allocation failed */
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < num_items; item++) {
            if (scores == NULL) continue;
            const int64_t s = seq_begin + item / num_kv_heads, kv_head = item % num_kv_heads;
            const int64_t *table = block_tables + s * block_table_stride;
            const int64_t first = (rows[s] * num_heads + kv_head * group) * head_dim;
            const int64_t kv_off = kv_head * head_dim;
            if (head_dim == 64)
                attend_64(&sh, table, seq_lens[s], kv_off, query + first, out + first, scores);
            else if (head_dim == 128)
                attend_128(&sh, table, seq_lens[s], kv_off, query + first, out + first, scores);
            else
                attend_any(&sh, table, seq_lens[s], kv_off, query + first, out + first, scores);
        }
        free(scores);
    }
    return failed;
}
