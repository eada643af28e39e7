/* bf16 <-> fp32 as torch converts them: widening is exact; narrowing rounds to nearest even, NaN stays NaN.
 * bf16 values travel as their raw uint16 bits. Shared by the C kernels (kernels/cbuild.py hashes the headers
 * into every library's cache key). */
#ifndef MMSERVE_BF16_H
#define MMSERVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#endif
