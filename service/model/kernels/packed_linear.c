/*
 * A matrix product for the decode pass's few rows: out[M, N] = x[M, K] W^T (+ bias), with W
 * packed once into panels of 32 output columns, [ceil(N / 32), K, 32], zero-padded past N.
 *
 * For a batch of decode rows (M of 2 to about 64) the BLAS kernels torch calls repack the weight
 * on every call and run far below this CPU's peak when the weights come from L3 (a zoo model's
 * step: 1.7 ms of products at a batch of 16, where the arithmetic takes about 0.6). A packed panel
 * is read once, front to back, and stays in L1 while every tile of up to 8 rows consumes it; each
 * tile keeps its 8 x 32 sums in registers and broadcasts one input at a time.
 *
 * Panels hold one of these formats (`format`, one per call):
 * - FLOAT_PANELS: float32 weights;
 * - INT8_PANELS (`--weights int8`): int8 codes with one float32 scale per output column and group
 *   of `GROUP` inputs, scales [ceil(N / 32), ceil(K / GROUP), 32] (GGUF's Q8_0 block):
 *   W[n, k] = code * scale;
 * - INT4_PANELS (`--weights int4`): 4-bit codes, a panel row's 32 in 16 bytes (column c in the low
 *   nibble of byte c, column c + 16 in its high nibble), with a scale and a minimum per column and
 *   group, scales [ceil(N / 32), K / GROUP, 2, 32] (GGUF's Q4_1 block): W[n, k] = code * scale + min;
 * - INT8_DOTS and INT4_DOTS: the same codes laid out for integer dot products (`dot_tile`), where
 *   the CPU has them (AVX-512 VNNI; `packed_dot_products`);
 * - ROUNDED_FLOAT_PANELS: float32 weights over rounded activations, as the packed formats: a
 *   product stacking packed layers of two formats (a file's finer v projection) reads them so.
 * A decode pass reads every weight once per step, so it is bound by the bytes it reads; codes are
 * a quarter or an eighth of them.
 *
 * The packed formats multiply quantized activations: each row's groups of `GROUP` inputs rounded
 * to int8 steps of the group's largest magnitude / 127 (`quantize_rows_shared`; GGUF's Q8 blocks,
 * what llama.cpp multiplies its packed weights with). With VNNI the codes then meet as integers,
 * 64 products an instruction where float32 does 16: at 16 rows a float-widening kernel was bound
 * by its arithmetic (an int8 step took longer than a float32 one). Without VNNI each panel row is
 * widened and scaled once and serves every row of the tile, the float kernel's arithmetic, over
 * the same quantized activations: every CPU path (and the eager layers, `quantized.py`) computes
 * the same sums.
 *
 * Layouts (float32): x rows `x_row_stride` floats apart, contiguous within a row; out [M, N]
 * contiguous; bias [N] or NULL.
 *
 * Panels are shared out among the OpenMP threads (`kernel_threads`, the caller's torch thread
 * count): each thread reads its own share of the weight, which is what bounds a decode pass.
 * `packed_linear_shared` is the loop for a team that is already running (the batch step opens
 * one team for its whole pass: a team per product cost 25 us each, 4 ms of a SmolLM2 step).
 *
 * Dot layouts (K padded to whole groups, Kp): INT8_DOTS values [ceil(N / 32), Kp / 4, 32, 4]
 * bytes, code + 128 of column c and inputs 4t..4t+3 at [p, t, c, 0..3]; INT4_DOTS values
 * [ceil(N / 32), K / 8, 32, 4], byte [p, t, c, j] holding input 8t + j in its low nibble and
 * 8t + 4 + j in its high one. Both take scales [ceil(N / 32), Kp / GROUP, 2, 32]: a factor `a` and
 * an offset `b` per column and group, a group's sum being a * (d * sum(q * u)) + b * d * sum(q)
 * for the unsigned codes u, activations q and their step d: for int8 a = scale, b = -128 scale
 * (u = code + 128), for int4 a = scale, b = minimum.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "threads.h"
#include "vec16.h"

#define PANEL 32
#define TILE_ROWS 8
#define GROUP 32 /* inputs sharing one scale (and minimum) */

enum { FLOAT_PANELS, INT8_PANELS, INT4_PANELS, INT8_DOTS, INT4_DOTS, ROUNDED_FLOAT_PANELS };

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DOT_PRODUCTS 1
#include <immintrin.h>
#else
#define DOT_PRODUCTS 0
#endif

/* Whether this build multiplies int8 and int4 panels as integers (the dot layouts). */
int64_t packed_dot_products(void) { return DOT_PRODUCTS; }

/* Floats of the `activations` scratch a product of `m` rows and `k` inputs takes: per row and
 * group a step and a sum, then the quantized rows (codes, or their floats without VNNI). */
int64_t packed_activation_floats(int64_t m, int64_t k) {
    int64_t groups = (k + GROUP - 1) / GROUP;
    return m * (groups * GROUP + 2 * groups);
}

/* One group of GROUP inputs (zeros past the row's end) quantized: its codes (or NULL), their
 * floats q * d (or NULL); returns d * sum(q) and sets *step to d. */
static inline float quantize_group(const float values[GROUP], float *step, signed char *codes, float *dequantized) {
#if defined(__AVX512F__)
    __m512 low = _mm512_loadu_ps(values), high = _mm512_loadu_ps(values + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
    float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
    /* The default rounding mode: to nearest, half to even, as nearbyintf and torch.round. */
    __m512i bound = _mm512_set1_epi32(127), q_low, q_high;
    q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, _mm512_set1_ps(inverse)));
    q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, _mm512_set1_ps(inverse)));
    q_low = _mm512_max_epi32(_mm512_min_epi32(q_low, bound), _mm512_sub_epi32(_mm512_setzero_si512(), bound));
    q_high = _mm512_max_epi32(_mm512_min_epi32(q_high, bound), _mm512_sub_epi32(_mm512_setzero_si512(), bound));
    if (codes) {
        _mm_storeu_si128((__m128i *)codes, _mm512_cvtepi32_epi8(q_low));
        _mm_storeu_si128((__m128i *)(codes + 16), _mm512_cvtepi32_epi8(q_high));
    }
    if (dequantized) {
        _mm512_storeu_ps(dequantized, _mm512_mul_ps(_mm512_cvtepi32_ps(q_low), _mm512_set1_ps(d)));
        _mm512_storeu_ps(dequantized + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(q_high), _mm512_set1_ps(d)));
    }
    *step = d;
    return d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high));
#else
    float amax = 0.0f;
    for (int i = 0; i < GROUP; i++) amax = fabsf(values[i]) > amax ? fabsf(values[i]) : amax;
    float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
    int total = 0;
    for (int i = 0; i < GROUP; i++) {
        float q = nearbyintf(values[i] * inverse);
        q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
        total += (int)q;
        if (codes) codes[i] = (signed char)q;
        if (dequantized) dequantized[i] = q * d;
    }
    *step = d;
    return d * (float)total;
#endif
}

/* Every row of x [m, k] quantized per group of GROUP inputs: q = round(x / d), d = the group's
 * largest magnitude / 127 (q = 0 where that is 0), K padded with zeros to whole groups (width).
 * `steps` and `sums` [m, groups] get each group's d and d * sum(q); `codes` [m, width] (or NULL)
 * the q, and `dequantized` [m, width] (or NULL) the q * d. Rows are shared out among the team. */
static void quantize_rows_shared(const float *x, int64_t x_row_stride, int64_t m_size, int64_t k_size,
                                 float *steps, float *sums, signed char *codes, float *dequantized) {
    int64_t groups = (k_size + GROUP - 1) / GROUP, width = groups * GROUP;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m_size; r++) {
        for (int64_t g = 0; g < groups; g++) {
            int64_t start = g * GROUP, count = k_size - start < GROUP ? k_size - start : GROUP;
            float values[GROUP];
            const float *in = x + r * x_row_stride + start;
            if (count < GROUP) {
                memset(values, 0, sizeof values);
                memcpy(values, in, (size_t)count * sizeof(float));
                in = values;
            }
            int64_t at = r * width + start;
            sums[r * groups + g] = quantize_group(in, steps + r * groups + g, codes ? codes + at : NULL,
                                                  dequantized ? dequantized + at : NULL);
        }
    }
}

/* One panel row times `rows` inputs (column k of x), into the sums. */
static inline __attribute__((always_inline)) void accumulate(const float *restrict x, int64_t x_row_stride, int64_t k,
                                                             vec16 w_low, vec16 w_high, int rows,
                                                             vec16 sums[TILE_ROWS][2]) {
    for (int r = 0; r < rows; r++) {
        vec16 a = splat16(x[r * x_row_stride + k]);
        sums[r][0] += a * w_low;
        sums[r][1] += a * w_high;
    }
}

/* A group's scales (and minimums) for the 32 columns of a panel. */
typedef struct {
    vec16 scale_low, scale_high, min_low, min_high;
} GroupScales;

static inline __attribute__((always_inline)) GroupScales group_scales(const float *scales, int64_t group,
                                                                      int format) {
    GroupScales g = {0};
    if (format == INT8_PANELS) {
        const float *at = scales + group * PANEL;
        g.scale_low = load16(at), g.scale_high = load16(at + 16);
    } else if (format == INT4_PANELS) {
        const float *at = scales + group * 2 * PANEL;
        g.scale_low = load16(at), g.scale_high = load16(at + 16);
        g.min_low = load16(at + PANEL), g.min_high = load16(at + PANEL + 16);
    }
    return g;
}

/* Row k of a panel as 32 floats, in two halves. */
static inline __attribute__((always_inline)) void panel_row(const void *panel, int64_t k, GroupScales g, int format,
                                                            vec16 *low, vec16 *high) {
    if (format == FLOAT_PANELS) {
        const float *weights = (const float *)panel + k * PANEL;
        *low = load16(weights), *high = load16(weights + 16);
    } else if (format == INT8_PANELS) {
        const signed char *codes = (const signed char *)panel + k * PANEL;
        *low = load16_int8(codes) * g.scale_low, *high = load16_int8(codes + 16) * g.scale_high;
    } else {
        load32_uint4((const unsigned char *)panel + k * (PANEL / 2), low, high);
        *low = *low * g.scale_low + g.min_low, *high = *high * g.scale_high + g.min_high;
    }
}

/* `rows` (1..8) rows times one panel; a constant `rows` and `format` after inlining, so the
 * sums stay in registers. `bias` holds the panel's 32 entries (zeros where there is none);
 * `scales` the panel's scales (and minimums) per group for the packed formats. */
static inline __attribute__((always_inline)) void tile(const float *restrict x, int64_t x_row_stride,
                                                       const void *restrict panel, const float *restrict scales,
                                                       int64_t k_size, const float *restrict bias, int rows,
                                                       int format, const float *ahead, vec16 sums[TILE_ROWS][2]) {
    vec16 low = load16(bias), high = load16(bias + 16);
    for (int r = 0; r < rows; r++) {
        sums[r][0] = low;
        sums[r][1] = high;
    }
    for (int64_t start = 0; start < k_size; start += GROUP) {
        GroupScales g = group_scales(scales, start / GROUP, format);
        int64_t end = start + GROUP < k_size ? start + GROUP : k_size;
        for (int64_t k = start; k < end; k++) {
            vec16 w_low, w_high;
            if (ahead) { /* the next float panel's row k, toward L2 */
                __builtin_prefetch(ahead + k * PANEL, 0, 2);
                __builtin_prefetch(ahead + k * PANEL + 16, 0, 2);
            }
            panel_row(panel, k, g, format, &w_low, &w_high);
            accumulate(x, x_row_stride, k, w_low, w_high, rows, sums);
        }
    }
}

/* A packed panel widened to float32 [K, 32]: the weights every tile of a product of more rows
 * than one tile would otherwise widen again. */
static inline __attribute__((always_inline)) void widen_panel(const void *panel, const float *scales,
                                                              int64_t k_size, int format, float *restrict out) {
    for (int64_t start = 0; start < k_size; start += GROUP) {
        GroupScales g = group_scales(scales, start / GROUP, format);
        int64_t end = start + GROUP < k_size ? start + GROUP : k_size;
        for (int64_t k = start; k < end; k++) {
            vec16 w_low, w_high;
            panel_row(panel, k, g, format, &w_low, &w_high);
            store16(out + k * PANEL, w_low);
            store16(out + k * PANEL + 16, w_high);
        }
    }
}

static inline __attribute__((always_inline)) void tile_rows(const float *x, int64_t x_row_stride, const void *panel,
                                                            const float *scales, int64_t k_size,
                                                            const float *bias, int rows, int format, float *out,
                                                            int64_t n_size, int64_t columns, const float *ahead) {
    vec16 sums[TILE_ROWS][2];
    tile(x, x_row_stride, panel, scales, k_size, bias, rows, format, ahead, sums);
    for (int r = 0; r < rows; r++) {
        if (columns == PANEL) {
            store16(out + r * n_size, sums[r][0]);
            store16(out + r * n_size + 16, sums[r][1]);
        } else { /* the last panel of an N that is not a multiple of 32 */
            float row[PANEL];
            store16(row, sums[r][0]);
            store16(row + 16, sums[r][1]);
            memcpy(out + r * n_size, row, (size_t)columns * sizeof(float));
        }
    }
}

#if defined(__AVX512F__)
#define WIDE_ROWS 16
/* Sixteen rows times one half (16 columns) of a float panel: 16 sums and the weights in registers
 * (AVX-512 has 32). Two of these read a panel once for 16 rows, each half's cache lines once,
 * where two tiles of 8 rows read it twice: the first from memory with the arithmetic waiting on
 * it, the second from L2 with the memory idle. `ahead`: as `panel_rows`. */
static inline __attribute__((always_inline)) void wide_half(const float *restrict x, int64_t x_row_stride,
                                                            const float *restrict panel, int64_t k_size,
                                                            const float *restrict bias, int half, float *out,
                                                            int64_t n_size, int64_t columns, const float *ahead) {
    vec16 sums[WIDE_ROWS], start = load16(bias + half * 16);
    for (int r = 0; r < WIDE_ROWS; r++) sums[r] = start;
    for (int64_t k = 0; k < k_size; k++) {
        if (ahead) __builtin_prefetch(ahead + k * PANEL + half * 16, 0, 2);
        vec16 w = load16(panel + k * PANEL + half * 16);
        for (int r = 0; r < WIDE_ROWS; r++) sums[r] += splat16(x[r * x_row_stride + k]) * w;
    }
    int64_t kept = columns - half * 16; /* this half's columns of the product: 16, fewer, or none */
    for (int r = 0; r < WIDE_ROWS && kept > 0; r++) {
        if (kept >= 16) {
            store16(out + r * n_size + half * 16, sums[r]);
        } else {
            float row[16];
            store16(row, sums[r]);
            memcpy(out + r * n_size + half * 16, row, (size_t)kept * sizeof(float));
        }
    }
}
#endif

/* One panel for all M rows: whole tiles of 8, then the rest. `ahead`, where not NULL, is the next
 * float panel: the second tile (or the only one) asks for it while it reads this one. The first
 * tile streams the panel from memory and the rest find it in L2, so without this the memory sat
 * idle while they computed. */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t x_row_stride, const void *panel,
                                                             const float *scales, const float *bias,
                                                             int format, float *out, int64_t m_size,
                                                             int64_t k_size, int64_t n_size, int64_t columns,
                                                             const float *ahead) {
    int64_t m = 0;
#if defined(WIDE_ROWS)
    if (format == FLOAT_PANELS) {
        for (; m + WIDE_ROWS <= m_size; m += WIDE_ROWS) {
            for (int half = 0; half < 2; half++)
                wide_half(x + m * x_row_stride, x_row_stride, (const float *)panel, k_size, bias, half,
                          out + m * n_size, n_size, columns, m == 0 ? ahead : NULL);
        }
        if (m > 0) ahead = NULL;
    }
#endif
    int64_t fetching = m_size - m > TILE_ROWS ? m + TILE_ROWS : m; /* the tile that asks */
    for (; m + TILE_ROWS <= m_size; m += TILE_ROWS)
        tile_rows(x + m * x_row_stride, x_row_stride, panel, scales, k_size, bias, TILE_ROWS, format,
                  out + m * n_size, n_size, columns, m == fetching ? ahead : NULL);
    const float *rest_x = x + m * x_row_stride;
    float *rest_out = out + m * n_size;
#define REST(ROWS)                                                                                                  \
    case ROWS:                                                                                                      \
        tile_rows(rest_x, x_row_stride, panel, scales, k_size, bias, ROWS, format, rest_out, n_size, columns,     \
                  m == fetching ? ahead : NULL);                                                                    \
        break
    switch (m_size - m) { /* one case per count so that each inlines with a constant row count */
        REST(1); REST(2); REST(3); REST(4); REST(5); REST(6); REST(7);
        default: break;
    }
#undef REST
}

/* One packed panel for all M rows: read as it is, or first widened into `scratch` (when not
 * NULL) and read as floats. A constant `format` after inlining. */
static inline __attribute__((always_inline)) void packed_panel_rows(const float *x, int64_t x_row_stride,
                                                                    const void *panel, const float *scales,
                                                                    const float *bias, int format, float *scratch,
                                                                    float *out, int64_t m_size, int64_t k_size,
                                                                    int64_t n_size, int64_t columns) {
    if (scratch) {
        widen_panel(panel, scales, k_size, format, scratch);
        panel_rows(x, x_row_stride, scratch, NULL, bias, FLOAT_PANELS, out, m_size, k_size, n_size, columns, NULL);
    } else {
        panel_rows(x, x_row_stride, panel, scales, bias, format, out, m_size, k_size, n_size, columns, NULL);
    }
}

#if DOT_PRODUCTS
#define DOT_TILE_ROWS 4
/* The next panel's t-row (its 128 bytes) at `offset`, toward L2; nothing when `ahead` is NULL. */
static inline __attribute__((always_inline)) void ask_ahead(const unsigned char *ahead, int64_t offset) {
    if (ahead) {
        __builtin_prefetch(ahead + offset, 0, 2);
        __builtin_prefetch(ahead + offset + 64, 0, 2);
    }
}
#define DOT_CHAINS(ROWS) ((ROWS) == 1 ? 4 : (ROWS) == 2 ? 2 : 1)
/* `rows` (1..4) quantized rows times a dot panel (32 columns, two halves of 16): per group, each
 * row's integer sums of q * u (`_mm512_dpbusd_epi32`: 4 byte products a lane), then scaled into
 * its float sums as the layout comment says. A row's sums of a half run in `DOT_CHAINS(rows)`
 * independent chains, summed at the group's end, so that one or two rows do not wait on the
 * instruction's latency. `codes` [rows, width], `steps` and `sums` [rows, groups] (row strides
 * `width` and `groups`) are the rows' quantized activations. */
static inline __attribute__((always_inline)) void dot_tile(const signed char *restrict codes,
                                                           const float *restrict steps,
                                                           const float *restrict sums,
                                                           const unsigned char *restrict panel,
                                                           const float *restrict scales, int64_t groups,
                                                           const float *restrict bias, int rows, int format,
                                                           float *out, int64_t n_size, int64_t columns,
                                                           const unsigned char *ahead) {
    enum { CHAINS = 4 };
    const int chains = DOT_CHAINS(rows);
    const int64_t width = groups * GROUP, row_bytes = 128; /* a t-row of the panel: 32 columns x 4 bytes */
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 total[DOT_TILE_ROWS][2];
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++) total[r][h] = _mm512_loadu_ps(bias + h * 16);
    for (int64_t g = 0; g < groups; g++) {
        __m512i dots[DOT_TILE_ROWS][2][CHAINS];
        for (int r = 0; r < rows; r++)
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < chains; c++) dots[r][h][c] = _mm512_setzero_si512();
        const signed char *q = codes + g * GROUP;
        if (format == INT8_DOTS) {
            const unsigned char *at = panel + g * (GROUP / 4) * row_bytes;
            for (int t = 0; t < GROUP / 4; t++) {
                ask_ahead(ahead, (at - panel) + t * row_bytes);
                for (int h = 0; h < 2; h++) {
                    __m512i u = _mm512_loadu_si512(at + t * row_bytes + h * 64);
                    for (int r = 0; r < rows; r++) {
                        int32_t four;
                        memcpy(&four, q + r * width + 4 * t, sizeof four);
                        __m512i *chain = &dots[r][h][t % chains];
                        *chain = _mm512_dpbusd_epi32(*chain, u, _mm512_set1_epi32(four));
                    }
                }
            }
        } else {
            const unsigned char *at = panel + g * (GROUP / 8) * row_bytes;
            for (int t = 0; t < GROUP / 8; t++) {
                ask_ahead(ahead, (at - panel) + t * row_bytes);
                for (int h = 0; h < 2; h++) {
                    __m512i packed = _mm512_loadu_si512(at + t * row_bytes + h * 64);
                    __m512i low = _mm512_and_si512(packed, nibble);
                    __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
                    for (int r = 0; r < rows; r++) {
                        int32_t first, second;
                        memcpy(&first, q + r * width + 8 * t, sizeof first);
                        memcpy(&second, q + r * width + 8 * t + 4, sizeof second);
                        __m512i *chain = &dots[r][h][(2 * t) % chains], *next = &dots[r][h][(2 * t + 1) % chains];
                        *chain = _mm512_dpbusd_epi32(*chain, low, _mm512_set1_epi32(first));
                        *next = _mm512_dpbusd_epi32(*next, high, _mm512_set1_epi32(second));
                    }
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            __m512 factor = _mm512_loadu_ps(scales + g * 2 * PANEL + h * 16);
            __m512 offset = _mm512_loadu_ps(scales + g * 2 * PANEL + PANEL + h * 16);
            for (int r = 0; r < rows; r++) {
                __m512i dot = dots[r][h][0];
                for (int c = 1; c < chains; c++) dot = _mm512_add_epi32(dot, dots[r][h][c]);
                __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(steps[r * groups + g]));
                total[r][h] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[r * groups + g]), total[r][h]);
                total[r][h] = _mm512_fmadd_ps(factor, scaled, total[r][h]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float row[PANEL];
        _mm512_storeu_ps(row, total[r][0]);
        _mm512_storeu_ps(row + 16, total[r][1]);
        memcpy(out + r * n_size, row, (size_t)columns * sizeof(float));
    }
}

/* One dot panel for all M rows: tiles of 4 rows, then the rest. The first tile asks for `ahead`,
 * the next panel (or NULL), as `panel_rows` does. */
static void dot_panel_rows(const signed char *codes, const float *steps, const float *sums,
                           const unsigned char *panel, const float *scales, const float *bias, int format,
                           float *out, int64_t m_size, int64_t groups, int64_t n_size, int64_t columns,
                           const unsigned char *ahead) {
    int64_t width = groups * GROUP, m = 0;
    for (; m + DOT_TILE_ROWS <= m_size; m += DOT_TILE_ROWS)
        dot_tile(codes + m * width, steps + m * groups, sums + m * groups, panel, scales, groups, bias, DOT_TILE_ROWS,
                 format, out + m * n_size, n_size, columns, m == 0 ? ahead : NULL);
#define DOT_REST(ROWS)                                                                                              \
    case ROWS:                                                                                                      \
        dot_tile(codes + m * width, steps + m * groups, sums + m * groups, panel, scales, groups, bias, ROWS,     \
                 format, out + m * n_size, n_size, columns, m == 0 ? ahead : NULL);                                 \
        break
    switch (m_size - m) { /* one case per count, each inlined with its constant */
        DOT_REST(1); DOT_REST(2); DOT_REST(3);
        default: break;
    }
#undef DOT_REST
}
#endif

/* Every thread of the running team calls this; each computes its share of the panels, and all
 * wait at the end for the whole product. `scales` is NULL for float32 panels. `widened` is
 * scratch of `kernel_threads` x K x 32 floats, or NULL: with it, a packed panel read by more rows
 * than one tile is widened once into the thread's share, and the tiles read the floats (the same
 * weights, so the same sums). `activations`: `packed_activation_floats(m, k)` floats, where the
 * packed formats' quantized rows go (unused for float32 panels). */
static void packed_linear_shared(const float *x, int64_t x_row_stride, const void *packed, const float *scales,
                                 int format, const float *bias, float *out, int64_t m_size, int64_t k_size,
                                 int64_t n_size, float *widened, float *activations) {
    int64_t panels = (n_size + PANEL - 1) / PANEL, groups = (k_size + GROUP - 1) / GROUP, width = groups * GROUP;
    float *steps = activations, *sums = activations + m_size * groups, *rows = sums + m_size * groups;
    if (format != FLOAT_PANELS) { /* the quantized rows every format but float32 multiplies */
        int dots = format == INT8_DOTS || format == INT4_DOTS;
        quantize_rows_shared(x, x_row_stride, m_size, k_size, steps, sums, dots ? (signed char *)rows : NULL,
                             dots ? NULL : rows); /* the loop's barrier: every row is ready after it */
        x = rows, x_row_stride = width;
    }
    float *own = widened ? widened + (int64_t)omp_get_thread_num() * k_size * PANEL : NULL;
    float *scratch = (format == INT8_PANELS || format == INT4_PANELS) && m_size > TILE_ROWS ? own : NULL;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float panel_bias[PANEL];
        int64_t n = p * PANEL;
        int64_t columns = n_size - n < PANEL ? n_size - n : PANEL;
        memset(panel_bias, 0, sizeof panel_bias);
        if (bias) memcpy(panel_bias, bias + n, (size_t)columns * sizeof(float));
        /* One call per format, each inlined with its constant. */
        if (format == INT8_PANELS)
            packed_panel_rows(x, x_row_stride, (const signed char *)packed + n * k_size, scales + p * groups * PANEL,
                              panel_bias, INT8_PANELS, scratch, out + n, m_size, k_size, n_size, columns);
        else if (format == INT4_PANELS)
            packed_panel_rows(x, x_row_stride, (const unsigned char *)packed + n * k_size / 2,
                              scales + p * groups * 2 * PANEL, panel_bias, INT4_PANELS, scratch, out + n, m_size,
                              k_size, n_size, columns);
#if DOT_PRODUCTS
        else if (format == INT8_DOTS || format == INT4_DOTS) {
            int64_t bytes = format == INT8_DOTS ? PANEL * width : PANEL * width / 2; /* a panel's */
            const unsigned char *panel = (const unsigned char *)packed + p * bytes;
            dot_panel_rows((const signed char *)rows, steps, sums, panel, scales + p * groups * 2 * PANEL, panel_bias,
                           format, out + n, m_size, groups, n_size, columns, p + 1 < panels ? panel + bytes : NULL);
        }
#endif
        else /* float32 panels, over x or its rounded rows */
            panel_rows(x, x_row_stride, (const float *)packed + n * k_size, NULL, panel_bias, FLOAT_PANELS, out + n,
                       m_size, k_size, n_size, columns, p + 1 < panels ? (const float *)packed + (n + PANEL) * k_size : NULL);
    }
}

/* `widened`: NULL, or scratch as `packed_linear_shared` takes it; `activations` as it takes them. */
void packed_linear(const float *x, int64_t x_row_stride, const void *packed, const float *scales, int64_t format,
                   const float *bias, float *out, int64_t m_size, int64_t k_size, int64_t n_size, float *widened,
                   float *activations) {
#pragma omp parallel num_threads(kernel_thread_count)
    packed_linear_shared(x, x_row_stride, packed, scales, (int)format, bias, out, m_size, k_size, n_size, widened,
                         activations);
}
