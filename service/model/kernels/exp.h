/*
 * exp for the kernels' softmax-like sums, in plain arithmetic so that the loops calling it
 * vectorize (libm's expf does not without -ffast-math).
 */
#ifndef PE_SERVE_EXP_H
#define PE_SERVE_EXP_H

#include <stdint.h>
#include <string.h>

#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define LOG2E 1.44269504088896341f
#define ROUNDING 12582912.0f
/* exp(x) for x <= 0 (scores after the row maximum is subtracted); a few ulp from expf, and plain
 * arithmetic so that the loops calling it vectorize (libm's expf does not without -ffast-math).
 * n = x / ln2 rounded to nearest by adding and taking away 1.5 * 2^23: floorf would not vectorize
 * under the default -ftrapping-math. */
/* e^r for |r| <= ln2 / 2 (Taylor to r^7), on a float or a vector of them alike. */
#define EXP_POLYNOMIAL(r)                                                                                         \
    ((((((((1.98412698e-4f * (r) + 1.38888889e-3f) * (r) + 8.33333333e-3f) * (r) + 4.16666667e-2f) * (r) +      \
         1.66666667e-1f) * (r) + 0.5f) * (r) + 1.0f) * (r) + 1.0f))

static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * LOG2E + ROUNDING) - ROUNDING;
    float r = x - n * LN2_HI - n * LN2_LO; /* |r| <= ln2 / 2 */
    float p = EXP_POLYNOMIAL(r);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
