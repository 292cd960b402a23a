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

typedef signed char vec16_int8 __attribute__((vector_size(16)));

typedef unsigned char vec16_uint8 __attribute__((vector_size(16)));

/* Sixteen int8 codes widened to floats (a sign extension and a conversion on x86). */
static inline vec16 load16_int8(const signed char *p) {
    vec16_int8 v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, vec16);
}

/* Thirty-two 4-bit codes from sixteen bytes, widened to floats: the low nibbles are the first
 * sixteen, the high nibbles the next sixteen. */
static inline void load32_uint4(const unsigned char *p, vec16 *low, vec16 *high) {
    vec16_uint8 v;
    memcpy(&v, p, sizeof v);
    *low = __builtin_convertvector(v & 15, vec16);
    *high = __builtin_convertvector(v >> 4, vec16);
}

#endif
