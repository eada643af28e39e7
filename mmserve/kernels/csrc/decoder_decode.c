/* A whole decoder's forward over decode rows (one query token per sequence) in one call: per layer the kernels
 * the composed path (models/decoder.py through kernels/cpu_fused.py, cpu_linear.py, cpu_attention.py) calls one
 * ctypes call at a time, here called in the same order with the same arguments. The kernels come as the
 * addresses of the very functions ctypes loaded (`k`), not compiled again here, so the
 * result is bit-identical to that path's whatever a compiler would make of them in another translation unit.
 * Compiled once per machine by kernels/cbuild.py, called by kernels/cpu_decoder.py.
 *
 * Why: at one decode row a layer is ten small kernel calls, and from Python each costs its wrapper, ctypes and
 * torch's allocations: about as much as the layer's elementwise work and attention together. One call per step
 * keeps the weights' stream (the linear products) as the only real cost.
 *
 * Per layer l, layers[l * LAYER_FIELDS + f] holds the address of field f (0 for an absent bias or q/k norm):
 *   input_norm [hidden], qkv [q + 2 kv, hidden] (+ bias [q + 2 kv]), q_norm / k_norm [head_dim] (Qwen3),
 *   o [hidden, q], post_norm [hidden], gate_up [2 inter, hidden], down [hidden, inter],
 *   kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] (the model's dtype).
 * x [rows, hidden] the embeddings (read only); out [rows, hidden] the final norm's output; cos, sin [rows, head_dim];
 * slots [rows]; block_tables [rows, table_stride], seq_lens [rows] int64 (context length after this step).
 * dtype: 0 fp32, 1 bf16 (raw uint16 bits). Returns 0; 1 for bad arguments; 2 when out of memory; 3 when a slot
 * is outside the cache (nothing written: the first layer checks every slot before it stores one). */

#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

/* The kernels' signatures, as their sources define them (fused_elementwise.c, small_linear.c,
 * paged_decode_attention.c) */
typedef struct {
    int (*add_rms_norm)(const void *, int64_t, int64_t, const void *, void *, const void *, void *, int64_t, int64_t,
                        float, int64_t, int64_t);
    int (*small_linear)(const void *, const void *, const void *, void *, int64_t, int64_t, int64_t, int64_t, int64_t);
    int (*rotary_qk)(const void *, int64_t, int64_t, const void *, const void *, const void *, const void *, float,
                     void *, void *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
    int (*store_kv)(const void *, int64_t, int64_t, int64_t, const void *, int64_t, int64_t, int64_t, void *,
                    const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t);
    int (*paged_decode_attention)(const float *, const void *, int64_t, const float *, const float *, const int64_t *,
                                  int64_t, const int64_t *, const int64_t *, float *, int64_t, int64_t, int64_t,
                                  int64_t, int64_t, int64_t, int64_t, float, int64_t);
    int (*silu_and_mul)(const void *, int64_t, int64_t, void *, int64_t, int64_t, int64_t, int64_t);
} Kernels;

enum { KV_FP32 = 0, KV_BF16 = 2 }; /* paged_decode_attention's kv_dtype codes */

enum {
    F_INPUT_NORM,
    F_QKV,
    F_QKV_BIAS,
    F_Q_NORM,
    F_K_NORM,
    F_O,
    F_POST_NORM,
    F_GATE_UP,
    F_DOWN,
    F_KV_CACHE,
    LAYER_FIELDS
};

#define ALIGN(n) (((n) + 63) & ~(size_t)63)

static inline void *at(const int64_t *layer, int field) { return (void *)(intptr_t)layer[field]; }

int decoder_decode(const Kernels *k, const int64_t *layers, int64_t num_layers, const void *final_norm,
                   const void *x, void *out, const void *cos, const void *sin, const int64_t *slots,
                   const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens, int64_t rows,
                   int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter,
                   int64_t num_blocks, int64_t block_size, float eps, float scale, int64_t dtype,
                   int64_t num_threads) {
    if (rows < 1 || num_layers < 1 || (dtype != 0 && dtype != 1)) return 1;
    const int bf16 = dtype == 1;
    const size_t es = bf16 ? 2 : 4;
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    /* scratch, each [rows, n]: residual, normed, qkv, q, k, q32 / o32 (fp32: bf16 widened for the attention, as
     * query.float() is), attn (the attention's output in the model's dtype), o, gate_up, act, h (the MLP's output:
     * the next layer's x), and the attention's row of each sequence */
    const size_t sizes[] = {ALIGN(rows * hidden * es),     ALIGN(rows * hidden * es),      ALIGN(rows * qkv_size * es),
                            ALIGN(rows * q_size * es),     ALIGN(rows * kv_size * es),     ALIGN(rows * q_size * 4),
                            ALIGN(rows * q_size * 4),      ALIGN(rows * q_size * es),      ALIGN(rows * hidden * es),
                            ALIGN(rows * 2 * inter * es), ALIGN(rows * inter * es),       ALIGN(rows * hidden * es),
                            ALIGN(rows * 8)};
    enum { RESIDUAL, NORMED, QKV, Q, K, Q32, O32, ATTN, O, GATE_UP, ACT, H, ROWS, NUM_BUFFERS };
    size_t total = 0;
    for (int i = 0; i < NUM_BUFFERS; i++) total += sizes[i];
    char *base = aligned_alloc(64, total);
    if (base == NULL) return 2;
    void *buf[NUM_BUFFERS];
    size_t offset = 0;
    for (int i = 0; i < NUM_BUFFERS; offset += sizes[i], i++) buf[i] = base + offset;
    int64_t *query_rows = buf[ROWS];
    for (int64_t r = 0; r < rows; r++) query_rows[r] = r;
    const int64_t num_slots = num_blocks * block_size;
    int code = 0;
/* the first kernel that fails ends the step with its code (3: a slot outside the cache, nothing stored) */
#define TRY(call)                                                                                                \
    if ((code = (call)) != 0) goto done
    const void *layer_x = x; /* the hidden state entering a layer is layer_x + residual (x alone at layer 0) */
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *layer = layers + l * LAYER_FIELDS;
        void *kv_cache = at(layer, F_KV_CACHE);
        /* normed, residual = add_rms_norm(layer_x, residual) (layer 0: residual = x) */
        TRY(k->add_rms_norm(layer_x, hidden, 1, l == 0 ? NULL : buf[RESIDUAL], buf[RESIDUAL], at(layer, F_INPUT_NORM),
                            buf[NORMED], rows, hidden, eps, dtype, num_threads));
        TRY(k->small_linear(buf[NORMED], at(layer, F_QKV), at(layer, F_QKV_BIAS), buf[QKV], rows, hidden, qkv_size,
                            dtype, num_threads));
        TRY(k->rotary_qk(buf[QKV], qkv_size, 1, cos, sin, at(layer, F_Q_NORM), at(layer, F_K_NORM), eps, buf[Q],
                         buf[K], rows, num_heads, num_kv_heads, head_dim, dtype, num_threads));
        const char *v = (const char *)buf[QKV] + (q_size + kv_size) * es;
        TRY(k->store_kv(buf[K], kv_size, head_dim, 1, v, qkv_size, head_dim, 1, kv_cache, slots, rows, num_slots,
                        num_kv_heads, head_dim, (int64_t)es) ? 3 : 0);
        const float *query = buf[Q];
        if (bf16) {
            float *q32 = buf[Q32];
            for (int64_t i = 0; i < rows * q_size; i++) q32[i] = bf16_to_f32(((const uint16_t *)buf[Q])[i]);
            query = q32;
        }
        TRY(k->paged_decode_attention(query, kv_cache, bf16 ? KV_BF16 : KV_FP32, NULL, NULL, block_tables, table_stride,
                                      seq_lens, query_rows, buf[O32], 0, rows, num_blocks, block_size, num_heads,
                                      num_kv_heads, head_dim, scale, num_threads));
        const void *attn = buf[O32];
        if (bf16) {
            uint16_t *narrow = buf[ATTN];
            for (int64_t i = 0; i < rows * q_size; i++) narrow[i] = f32_to_bf16(((const float *)buf[O32])[i]);
            attn = narrow;
        }
        TRY(k->small_linear(attn, at(layer, F_O), NULL, buf[O], rows, q_size, hidden, dtype, num_threads));
        TRY(k->add_rms_norm(buf[O], hidden, 1, buf[RESIDUAL], buf[RESIDUAL], at(layer, F_POST_NORM), buf[NORMED], rows,
                            hidden, eps, dtype, num_threads));
        TRY(k->small_linear(buf[NORMED], at(layer, F_GATE_UP), NULL, buf[GATE_UP], rows, hidden, 2 * inter, dtype,
                            num_threads));
        TRY(k->silu_and_mul(buf[GATE_UP], 2 * inter, 1, buf[ACT], rows, inter, dtype, num_threads));
        TRY(k->small_linear(buf[ACT], at(layer, F_DOWN), NULL, buf[H], rows, inter, hidden, dtype, num_threads));
        layer_x = buf[H];
    }
    TRY(k->add_rms_norm(layer_x, hidden, 1, buf[RESIDUAL], NULL, final_norm, out, rows, hidden, eps, dtype,
                        num_threads));
#undef TRY
done:
    free(base);
    return code;
}
