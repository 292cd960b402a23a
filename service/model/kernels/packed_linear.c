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
 * Panels hold one of three formats (`format`, one per call):
 * - FLOAT_PANELS: float32 weights;
 * - INT8_PANELS (`--weights int8`): int8 codes with one float32 scale per output column and group
 *   of `GROUP` inputs, scales [ceil(N / 32), ceil(K / GROUP), 32] (GGUF's Q8_0 block):
 *   W[n, k] = code * scale;
 * - INT4_PANELS (`--weights int4`): 4-bit codes, a panel row's 32 in 16 bytes (column c in the low
 *   nibble of byte c, column c + 16 in its high nibble), with a scale and a minimum per column and
 *   group, scales [ceil(N / 32), K / GROUP, 2, 32] (GGUF's Q4_1 block): W[n, k] = code * scale + min.
 * A decode pass reads every weight once per step, so it is bound by the bytes it reads; codes are
 * a quarter or an eighth of them. Each panel row is widened and scaled once and then serves every
 * row of the tile, so the products' arithmetic is the float kernel's.
 *
 * Layouts (float32): x rows `x_row_stride` floats apart, contiguous within a row; out [M, N]
 * contiguous; bias [N] or NULL.
 *
 * Panels are shared out among the OpenMP threads (`kernel_threads`, the caller's torch thread
 * count): each thread reads its own share of the weight, which is what bounds a decode pass.
 * `packed_linear_shared` is the loop for a team that is already running (the batch step opens
 * one team for its whole pass: a team per product cost 25 us each, 4 ms of a SmolLM2 step).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "threads.h"
#include "vec16.h"

#define PANEL 32
#define TILE_ROWS 8
#define GROUP 32 /* inputs sharing one scale (and minimum) */

enum { FLOAT_PANELS, INT8_PANELS, INT4_PANELS };

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

/* Every thread of the running team calls this; each computes its share of the panels, and all
 * wait at the end for the whole product. `scales` is NULL for float32 panels. `widened` is
 * scratch of `kernel_threads` x K x 32 floats, or NULL: with it, a packed panel read by more rows
 * than one tile is widened once into the thread's share, and the tiles read the floats (the same
 * weights, so the same sums). */
static void packed_linear_shared(const float *x, int64_t x_row_stride, const void *packed, const float *scales,
                                 int format, const float *bias, float *out, int64_t m_size, int64_t k_size,
                                 int64_t n_size, float *widened) {
    int64_t panels = (n_size + PANEL - 1) / PANEL, groups = (k_size + GROUP - 1) / GROUP;
    float *own = widened ? widened + (int64_t)omp_get_thread_num() * k_size * PANEL : NULL;
    float *scratch = format != FLOAT_PANELS && m_size > TILE_ROWS ? own : NULL;
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
        else
            panel_rows(x, x_row_stride, (const float *)packed + n * k_size, NULL, panel_bias, FLOAT_PANELS, out + n,
                       m_size, k_size, n_size, columns, p + 1 < panels ? (const float *)packed + (n + PANEL) * k_size : NULL);
    }
}

/* `widened`: NULL, or scratch as `packed_linear_shared` takes it. */
void packed_linear(const float *x, int64_t x_row_stride, const void *packed, const float *scales, int64_t format,
                   const float *bias, float *out, int64_t m_size, int64_t k_size, int64_t n_size, float *widened) {
#pragma omp parallel num_threads(kernel_thread_count)
    packed_linear_shared(x, x_row_stride, packed, scales, (int)format, bias, out, m_size, k_size, n_size, widened);
}
