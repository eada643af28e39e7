/* out[rows, out_features] = x[rows, in_features] @ w[out_features, in_features]^T (+ bias) for few rows
 * (a decode batch), fp32 or bf16 in and out, fp32 accumulation. Compiled once per machine by
 * kernels/cpu_linear.py and called through ctypes.
 *
 * Why by hand: with few rows the product is bound by streaming the weights from memory, and BLAS's
 * one-row (GEMV) and few-row paths stream them well below the memory's rate on some CPUs. Here each
 * weight row is read once per step, whatever the row count: a tile of weight rows meets every x row
 * (x stays in L1 or L2), the output rows are split over the threads. With AVX-512: tiles of up to 4 x rows in
 * intrinsics, of 1 weight row while the x rows are few (each thread then reads its weights as one sequential
 * stream, which the prefetchers follow; 4 weight rows at a time are 4 short streams of one row's length each, and
 * they streamed 1.2-1.9x slower at 1-8 rows on a Zen 4) and of 4 weight rows past that (the FMAs bound the tile
 * there, and each x load then serves 4 weight rows). Elsewhere (AVX2, NEON): GCC's generic vectors, tiles of 1
 * weight row x 8 x rows, x widened to fp32 once per call: one sequential weight stream per thread and up to 8
 * independent FMA chains (4 x 4 tiles spill AVX2's 16 registers and read 4 weight rows at once; 1 x 8 streamed
 * the weights at 4 rows as fast as at 1 on a Zen 3, docs/benchmarks.md).
 *
 * Layout: x, w, out row-major and contiguous; bias [out_features] or NULL; bf16 as raw uint16 bits.
 * Rounding: fp32 sums in an order of our own (not BLAS's); bf16 results rounded to nearest even. A row's
 * result never depends on the other rows of the call (each output is one dot product, summed alike). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_AVX512 1
#endif
#if defined(__AVX__)
#include <immintrin.h>
#endif

#ifdef HAVE_AVX512
#define W_TILE 4 /* the most weight rows per tile (W_TILE * X_TILE accumulators) */
#define X_TILE 4 /* x rows per tile */
#define SEQ_MAX_ROWS 8 /* up to this many x rows, tiles of one weight row: a sequential stream */
#else
#define W_TILE 1
#define X_TILE 8
#define VL 8 /* fp32 lanes of a generic vector: one AVX2 register */
typedef float vfloat __attribute__((vector_size(VL * sizeof(float))));
typedef uint16_t vhalf __attribute__((vector_size(VL * sizeof(uint16_t))));
typedef uint32_t vuint __attribute__((vector_size(VL * sizeof(uint32_t))));
/* a * b + c. Built with -ffp-contract=off -fno-associative-math (kernels/cpu_linear.py), so the compiler never
 * decides per inlined copy how to fuse or order a row's products and sums: it fused them differently for one x row
 * than for several, and a row's result then depended on the rows beside it. The fused instruction is asked for
 * where the CPU has it. */
static inline __attribute__((always_inline)) vfloat fmadd(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX__) && defined(__FMA__)
    return (vfloat)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}
#endif

/* dot products of weight rows w[o0 .. o0+nw) with x rows x[r0 .. r0+nx), nw, nx <= 4: acc[i][j] */
#ifdef HAVE_AVX512
static inline __m512 load16(const void *p, int64_t k, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p + k);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load_tail(const void *p, int64_t k, int64_t n, int bf16) {
    __mmask16 m = (__mmask16)((1u << n) - 1u);
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)p + k);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* Inlined with constant nx and wt (weight rows per tile) at each call, so the compiler keeps only nx x wt
 * accumulators. nw <= wt weight rows are real; the others repeat row o0 and their sums are not used. Every output is
 * the same 16-lane FMA chain over k and the same lane sum, whatever nx and wt: the tile shape never changes a
 * result. */
#ifdef HAVE_AVX512
static inline __attribute__((always_inline)) void tile(const void *x, const void *w, int64_t in, int64_t r0,
                                                       int nx, int64_t o0, int nw, int wt, int bf16,
                                                       float acc[W_TILE][X_TILE]) {
    size_t es = bf16 ? 2 : 4;
    const char *xb = (const char *)x, *wb = (const char *)w;
    const void *xr[X_TILE], *wr[W_TILE];
    for (int j = 0; j < nx; j++) xr[j] = xb + (size_t)(r0 + j) * in * es;
    for (int i = 0; i < wt; i++) wr[i] = wb + (size_t)(o0 + (i < nw ? i : 0)) * in * es;
    __m512 a[W_TILE][X_TILE];
    for (int i = 0; i < wt; i++)
        for (int j = 0; j < nx; j++) a[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= in; k += 16) {
        __m512 wv[W_TILE], xv[X_TILE];
        for (int i = 0; i < wt; i++) wv[i] = load16(wr[i], k, bf16);
        for (int j = 0; j < nx; j++) xv[j] = load16(xr[j], k, bf16);
        for (int i = 0; i < wt; i++)
            for (int j = 0; j < nx; j++) a[i][j] = _mm512_fmadd_ps(wv[i], xv[j], a[i][j]);
    }
    if (k < in) {
        __m512 wv[W_TILE], xv[X_TILE];
        for (int i = 0; i < wt; i++) wv[i] = load_tail(wr[i], k, in - k, bf16);
        for (int j = 0; j < nx; j++) xv[j] = load_tail(xr[j], k, in - k, bf16);
        for (int i = 0; i < wt; i++)
            for (int j = 0; j < nx; j++) a[i][j] = _mm512_fmadd_ps(wv[i], xv[j], a[i][j]);
    }
    for (int i = 0; i < wt; i++)
        for (int j = 0; j < nx; j++) acc[i][j] = _mm512_reduce_add_ps(a[i][j]);
}
#else
static inline __attribute__((always_inline)) vfloat load_w(const void *w, int64_t k, int bf16) {
    vfloat f;
    if (!bf16) {
        memcpy(&f, (const float *)w + k, sizeof f);
        return f;
    }
    vhalf h;
    memcpy(&h, (const uint16_t *)w + k, sizeof h);
    const vuint u = __builtin_convertvector(h, vuint) << 16; /* bf16 bits to fp32: exact */
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The dot products of weight row o0 with fp32 x rows x32[r0 .. r0+nx), nx <= X_TILE: acc[0][j]. One
 * accumulator per x row, so a row's sum never depends on how many rows share the tile. */
static inline __attribute__((always_inline)) void tile(const float *x32, const void *w, int64_t in, int64_t r0,
                                                       int nx, int64_t o0, int bf16, float acc[W_TILE][X_TILE]) {
    const float *xr[X_TILE];
    for (int j = 0; j < nx; j++) xr[j] = x32 + (r0 + j) * in;
    const void *wr = (const char *)w + (size_t)o0 * in * (bf16 ? 2 : 4);
    vfloat a[X_TILE];
    for (int j = 0; j < nx; j++) a[j] = (vfloat){0};
    int64_t k = 0;
    for (; k + VL <= in; k += VL) {
        const vfloat wv = load_w(wr, k, bf16);
        for (int j = 0; j < nx; j++) {
            vfloat xv;
            memcpy(&xv, xr[j] + k, sizeof xv);
            a[j] = fmadd(wv, xv, a[j]);
        }
    }
    for (int j = 0; j < nx; j++) {
        const vfloat v = a[j]; /* the lanes summed as a tree, spelled out: the order is ours, not the compiler's */
        float s = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
        for (int64_t t = k; t < in; t++)
            s += (bf16 ? bf16_to_f32(((const uint16_t *)wr)[t]) : ((const float *)wr)[t]) * xr[j][t];
        acc[0][j] = s;
    }
}
#endif

#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
#define HAVE_DPBF16 1
/* bf16 with the CPU's bf16 dot product (VDPBF16PS: pairs of bf16 products summed into fp32, 32 elements an
 * instruction; denormal inputs and sums flushed to zero, as oneDNN's bf16 kernels do). Same contract as tile. */
static inline __attribute__((always_inline)) void tile_dpbf16(const uint16_t *x, const uint16_t *w, int64_t in,
                                                              int64_t r0, int nx, int64_t o0, int nw, int wt,
                                                              float acc[W_TILE][X_TILE]) {
    const uint16_t *xr[X_TILE], *wr[W_TILE];
    for (int j = 0; j < nx; j++) xr[j] = x + (r0 + j) * in;
    for (int i = 0; i < wt; i++) wr[i] = w + (o0 + (i < nw ? i : 0)) * in;
    __m512 a[W_TILE][X_TILE];
    for (int i = 0; i < wt; i++)
        for (int j = 0; j < nx; j++) a[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= in; k += 32) {
        __m512bh wv[W_TILE], xv[X_TILE];
        for (int i = 0; i < wt; i++) wv[i] = (__m512bh)_mm512_loadu_si512((const void *)(wr[i] + k));
        for (int j = 0; j < nx; j++) xv[j] = (__m512bh)_mm512_loadu_si512((const void *)(xr[j] + k));
        for (int i = 0; i < wt; i++)
            for (int j = 0; j < nx; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], wv[i], xv[j]);
    }
    if (k < in) {
        __mmask32 m = (__mmask32)((1ull << (in - k)) - 1ull);
        __m512bh wv[W_TILE], xv[X_TILE];
        for (int i = 0; i < wt; i++) wv[i] = (__m512bh)_mm512_maskz_loadu_epi16(m, wr[i] + k);
        for (int j = 0; j < nx; j++) xv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, xr[j] + k);
        for (int i = 0; i < wt; i++)
            for (int j = 0; j < nx; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], wv[i], xv[j]);
    }
    for (int i = 0; i < wt; i++)
        for (int j = 0; j < nx; j++) acc[i][j] = _mm512_reduce_add_ps(a[i][j]);
}
#endif

/* acc[i][j] (+ bias) into out[r0 + j][o0 + i] for the tile's nw weight rows and nx x rows. */
static inline __attribute__((always_inline)) void store(float acc[W_TILE][X_TILE], const void *bias, void *out,
                                                        int64_t out_features, int64_t r0, int nx, int64_t o0, int nw,
                                                        int bf16) {
    for (int i = 0; i < nw; i++) {
        float b = 0.0f;
        if (bias) b = bf16 ? bf16_to_f32(((const uint16_t *)bias)[o0 + i]) : ((const float *)bias)[o0 + i];
        for (int j = 0; j < nx; j++) {
            int64_t at = (r0 + j) * out_features + o0 + i;
            float v = acc[i][j] + b;
            if (bf16)
                ((uint16_t *)out)[at] = f32_to_bf16(v);
            else
                ((float *)out)[at] = v;
        }
    }
}

#ifdef HAVE_AVX512
/* The products of weight rows [o0, o0 + nw) with every x row into out (+ bias), in tiles of a constant wt weight
 * rows x up to X_TILE x rows. */
static inline __attribute__((always_inline)) void weight_tile(const void *x, const void *w, const void *bias,
                                                              void *out, int64_t rows, int64_t in,
                                                              int64_t out_features, int64_t o0, int nw, int wt,
                                                              int bf16) {
    for (int64_t r0 = 0; r0 < rows; r0 += X_TILE) {
        int nx = (int)(rows - r0 < X_TILE ? rows - r0 : X_TILE);
        float acc[W_TILE][X_TILE];
#ifdef HAVE_DPBF16
        if (bf16) {
            const uint16_t *xh = (const uint16_t *)x, *wh = (const uint16_t *)w;
            switch (nx) {
            case 1: tile_dpbf16(xh, wh, in, r0, 1, o0, nw, wt, acc); break;
            case 2: tile_dpbf16(xh, wh, in, r0, 2, o0, nw, wt, acc); break;
            case 3: tile_dpbf16(xh, wh, in, r0, 3, o0, nw, wt, acc); break;
            default: tile_dpbf16(xh, wh, in, r0, 4, o0, nw, wt, acc); break;
            }
        } else
#endif
            switch (nx) {
            case 1: tile(x, w, in, r0, 1, o0, nw, wt, bf16, acc); break;
            case 2: tile(x, w, in, r0, 2, o0, nw, wt, bf16, acc); break;
            case 3: tile(x, w, in, r0, 3, o0, nw, wt, bf16, acc); break;
            default: tile(x, w, in, r0, 4, o0, nw, wt, bf16, acc); break;
            }
        store(acc, bias, out, out_features, r0, nx, o0, nw, bf16);
    }
}
#endif

/* Returns 0, or 2 when out of memory. */
static inline __attribute__((always_inline)) int run(const void *x, const void *w, const void *bias, void *out,
                                                      int64_t rows, int64_t in, int64_t out_features, int bf16,
                                                      int64_t num_threads) {
#ifdef HAVE_AVX512
    /* Two parallel regions, not one with a runtime tile width: GCC outlines a region before it inlines, so what the
     * body reads from outside it (bf16 too) is a variable there, and a width chosen inside would size the
     * accumulators at run time (measured slower). */
    if (rows <= SEQ_MAX_ROWS) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t o0 = 0; o0 < out_features; o0++)
            weight_tile(x, w, bias, out, rows, in, out_features, o0, 1, 1, bf16);
    } else {
        int64_t num_tiles = (out_features + W_TILE - 1) / W_TILE;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t t = 0; t < num_tiles; t++) {
            int64_t o0 = t * W_TILE;
            int nw = (int)(out_features - o0 < W_TILE ? out_features - o0 : W_TILE);
            weight_tile(x, w, bias, out, rows, in, out_features, o0, nw, W_TILE, bf16);
        }
    }
#else
    int64_t num_tiles = (out_features + W_TILE - 1) / W_TILE;
    const float *x32 = x; /* bf16 x widened once here (exact), not once per weight row */
    if (bf16) {
        float *wide = malloc(sizeof(float) * (size_t)(rows * in));
        if (wide == NULL) return 2;
        for (int64_t i = 0; i < rows * in; i++) wide[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        x32 = wide;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tiles; t++) {
        int64_t o0 = t * W_TILE;
        int nw = (int)(out_features - o0 < W_TILE ? out_features - o0 : W_TILE);
        for (int64_t r0 = 0; r0 < rows; r0 += X_TILE) {
            int nx = (int)(rows - r0 < X_TILE ? rows - r0 : X_TILE);
            float acc[W_TILE][X_TILE];
            switch (nx) {
            case 1: tile(x32, w, in, r0, 1, o0, bf16, acc); break;
            case 2: tile(x32, w, in, r0, 2, o0, bf16, acc); break;
            case 3: tile(x32, w, in, r0, 3, o0, bf16, acc); break;
            case 4: tile(x32, w, in, r0, 4, o0, bf16, acc); break;
            case 5: tile(x32, w, in, r0, 5, o0, bf16, acc); break;
            case 6: tile(x32, w, in, r0, 6, o0, bf16, acc); break;
            case 7: tile(x32, w, in, r0, 7, o0, bf16, acc); break;
            default: tile(x32, w, in, r0, 8, o0, bf16, acc); break;
            }
            store(acc, bias, out, out_features, r0, nx, o0, nw, bf16);
        }
    }
    if (x32 != x) free((void *)x32);
#endif
    return 0;
}

/* Returns 0, 1 for bad arguments, 2 when out of memory. dtype: 0 fp32, 1 bf16 (x, w, bias and out alike). */
int small_linear(const void *x, const void *w, const void *bias, void *out, int64_t rows, int64_t in,
                 int64_t out_features, int64_t dtype, int64_t num_threads) {
    if (rows < 1 || in < 1 || out_features < 1 || (dtype != 0 && dtype != 1)) return 1;
    if (num_threads < 1) num_threads = 1;
    if (dtype == 1) return run(x, w, bias, out, rows, in, out_features, 1, num_threads);
    return run(x, w, bias, out, rows, in, out_features, 0, num_threads);
}
