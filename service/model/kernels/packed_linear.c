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
 * Layouts (float32): x rows `x_row_stride` floats apart, contiguous within a row; out [M, N]
 * contiguous; bias [N] or NULL.
 *
 * Panels are shared out among the OpenMP threads (`kernel_threads`, the caller's torch thread
 * count): each thread reads its own share of the weight, which is what bounds a decode pass.
 * `packed_linear_shared` is the loop for a team that is already running (the batch step opens
 * one team for its whole pass: a team per product cost 25 us each, 4 ms of a SmolLM2 step).
 */
#include <stdint.h>
#include <string.h>

#include "threads.h"
#include "vec16.h"

#define PANEL 32
#define TILE_ROWS 8

/* `rows` (1..8) rows times one panel; a constant `rows` after inlining, so the sums stay in
 * registers. `bias` holds the panel's 32 entries (zeros where there is none). */
static inline __attribute__((always_inline)) void tile(const float *restrict x, int64_t x_row_stride,
                                                       const float *restrict panel, int64_t k_size,
                                                       const float *restrict bias, int rows,
                                                       vec16 sums[TILE_ROWS][2]) {
    vec16 low = load16(bias), high = load16(bias + 16);
    for (int r = 0; r < rows; r++) {
        sums[r][0] = low;
        sums[r][1] = high;
    }
    for (int64_t k = 0; k < k_size; k++) {
        vec16 w_low = load16(panel + k * PANEL), w_high = load16(panel + k * PANEL + 16);
        for (int r = 0; r < rows; r++) {
            vec16 a = splat16(x[r * x_row_stride + k]);
            sums[r][0] += a * w_low;
            sums[r][1] += a * w_high;
        }
    }
}

static inline __attribute__((always_inline)) void tile_rows(const float *x, int64_t x_row_stride,
                                                            const float *panel, int64_t k_size,
                                                            const float *bias, int rows, float *out,
                                                            int64_t n_size, int64_t columns) {
    vec16 sums[TILE_ROWS][2];
    tile(x, x_row_stride, panel, k_size, bias, rows, sums);
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

/* Every thread of the running team calls this; each computes its share of the panels, and all
 * wait at the end for the whole product. */
static void packed_linear_shared(const float *x, int64_t x_row_stride, const float *packed, const float *bias,
                                 float *out, int64_t m_size, int64_t k_size, int64_t n_size) {
    int64_t panels = (n_size + PANEL - 1) / PANEL;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float panel_bias[PANEL];
        int64_t n = p * PANEL;
        const float *panel = packed + n * k_size;
        int64_t columns = n_size - n < PANEL ? n_size - n : PANEL;
        memset(panel_bias, 0, sizeof panel_bias);
        if (bias) memcpy(panel_bias, bias + n, (size_t)columns * sizeof(float));
        int64_t m = 0;
        for (; m + TILE_ROWS <= m_size; m += TILE_ROWS)
            tile_rows(x + m * x_row_stride, x_row_stride, panel, k_size, panel_bias, TILE_ROWS, out + m * n_size + n,
                      n_size, columns);
        const float *rest_x = x + m * x_row_stride;
        float *rest_out = out + m * n_size + n;
        switch (m_size - m) { /* one case per count so that each inlines with a constant row count */
            case 1: tile_rows(rest_x, x_row_stride, panel, k_size, panel_bias, 1, rest_out, n_size, columns); break;
            case 2: tile_rows(rest_x, x_row_stride, panel, k_size, panel_bias, 2, rest_out, n_size, columns); break;
            case 3: tile_rows(rest_x, x_row_stride, panel, k_size, panel_bias, 3, rest_out, n_size, columns); break;
            case 4: tile_rows(rest_x, x_row_stride, panel, k_size, panel_bias, 4, rest_out, n_size, columns); break;
            case 5: tile_rows(rest_x, x_row_stride, panel, k_size, panel_bias, 5, rest_out, n_size, columns); break;
            case 6: tile_rows(rest_x, x_row_stride, panel, k_size, panel_bias, 6, rest_out, n_size, columns); break;
            case 7: tile_rows(rest_x, x_row_stride, panel, k_size, panel_bias, 7, rest_out, n_size, columns); break;
            default: break;
        }
    }
}

void packed_linear(const float *x, int64_t x_row_stride, const float *packed, const float *bias, float *out,
                   int64_t m_size, int64_t k_size, int64_t n_size) {
#pragma omp parallel num_threads(kernel_thread_count)
    packed_linear_shared(x, x_row_stride, packed, bias, out, m_size, k_size, n_size);
}
