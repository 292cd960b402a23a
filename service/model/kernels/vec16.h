/*
 * Sixteen floats as one GCC vector: lowered to AVX-512, AVX2 or NEON, whatever `-march=native`
 * finds. Loads and stores go through memcpy, so no pointer needs any alignment.
 */
#ifndef PE_SERVE_VEC16_H
#define PE_SERVE_VEC16_H

#include <string.h>

typedef float vec16 __attribute__((vector_size(64)));

static inline vec16 load16(const float *p) {
    vec16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, vec16 v) { memcpy(p, &v, sizeof v); }

static inline vec16 splat16(float x) { return (vec16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

typedef unsigned char vec16_bytes __attribute__((vector_size(16)));

/* Sixteen bytes widened to sixteen floats, as signed or unsigned integers. GCC 12 lowers
 * `__builtin_convertvector` from bytes to floats into one scalar conversion per lane (8x slower
 * than the float product it feeds), so x86 gets the sign or zero extension and the conversion as
 * two instructions per register; other targets keep the plain loop. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vec16 widen16(vec16_bytes v, int is_signed) {
    __m128i bytes;
    memcpy(&bytes, &v, sizeof bytes);
    __m512i integers = is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    return (vec16)_mm512_cvtepi32_ps(integers);
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline vec16 widen16(vec16_bytes v, int is_signed) {
    __m128i bytes, upper;
    memcpy(&bytes, &v, sizeof bytes);
    upper = _mm_srli_si128(bytes, 8);
    __m256 halves[2] = {
        _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes)),
        _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper)),
    };
    vec16 out;
    memcpy(&out, halves, sizeof out);
    return out;
}
#else
static inline vec16 widen16(vec16_bytes v, int is_signed) {
    vec16 out;
    for (int i = 0; i < 16; i++) out[i] = is_signed ? (float)(signed char)v[i] : (float)v[i];
    return out;
}
#endif

/* Sixteen int8 codes as floats. */
static inline vec16 load16_int8(const signed char *p) {
    vec16_bytes v;
    memcpy(&v, p, sizeof v);
    return widen16(v, 1);
}

/* Thirty-two 4-bit codes from sixteen bytes, as floats: the low nibbles are the first sixteen,
 * the high nibbles the next sixteen. */
static inline void load32_uint4(const unsigned char *p, vec16 *low, vec16 *high) {
    vec16_bytes v;
    memcpy(&v, p, sizeof v);
    *low = widen16(v & 15, 0);
    *high = widen16(v >> 4, 0);
}

#endif
