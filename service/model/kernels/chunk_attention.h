/*
 * A prompt chunk's attention over the paged KV pool, for CPUs. A chunk's rows are consecutive
 * tokens of one sequence (a "run"): they read the same keys. Attended row by row
 * (`paged_attention.c`), every (token, head) pair streams its whole row of keys and values through
 * the caches: deep in SmolLM2's 3,298-token prompt each pair read 850 KB, and the attention ran at
 * 69 GFLOP/s beside products at 170 on two cores (perf over the prompt's C chunks).
 *
 * Here a tile of up to TILE_LANES query vectors (consecutive tokens x the query heads of one key
 * head) reads each 16-key block once. The tile's queries are transposed ([D][lanes], scaled), so a
 * block's scores come out as one vector per key holding every query vector's score, and the
 * softmax runs online across the lanes at once: a running maximum and sum per lane, the sums
 * rescaled as the maximum grows (FlashAttention's order). The weighted values accumulate
 * transposed the same way and are turned back once at the end.
 *
 * Inputs as `paged_attention.c`'s, plus run_ends [runs]: the rows of run r are
 * run_ends[r - 1] (or 0) .. run_ends[r] - 1, at consecutive positions, over the same blocks.
 */
#ifndef PE_SERVE_CHUNK_ATTENTION_H
#define PE_SERVE_CHUNK_ATTENTION_H

#include "paged_attention.c"

#if defined(__AVX512F__)
/* 32 vector registers: 8 keys (or dims) x 3 lane groups of sums, and their operands. */
#define TILE_GROUPS 3
#define REGISTER_ROWS 8
#else
/* A vec16 takes two of AVX2's 16 registers: 2 x 2 sums, and their operands. */
#define TILE_GROUPS 2
#define REGISTER_ROWS 2
#endif
#define TILE_LANES (TILE_GROUPS * LANES)
#define TILE_MAX_DIM 256 /* the tile's queries and sums live on the stack: 2 x 256 x 48 floats */

static inline vec16 select16(lanes16 mask, vec16 yes, vec16 no) {
    return (vec16)(((lanes16)yes & mask) | ((lanes16)no & ~mask));
}

static inline vec16 max16(vec16 a, vec16 b) { return select16(a > b, a, b); }

/* `exp_nonpositive` on sixteen lanes at once. */
static inline vec16 exp16_nonpositive(vec16 x) {
    x = max16(x, splat16(-87.0f));
    vec16 n = (x * LOG2E + ROUNDING) - ROUNDING;
    vec16 r = x - n * LN2_HI - n * LN2_LO;
    vec16 p = EXP_POLYNOMIAL(r);
    lanes16 bits = (__builtin_convertvector(n, lanes16) + 127) << 23;
    return p * (vec16)bits;
}

/* Whether tiles can take a model's chunks (exported through `batch_pass.c`, which includes this): a key head's query heads fit a tile, and the blocks
 * and heads suit the vectors. Scores with a bias (ALiBi, T5) differ per row and head: such passes
 * stay row by row whatever this says. */
int64_t chunk_tiles_fit(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size) {
    return block_size == LANES && head_dim % LANES == 0 && head_dim <= TILE_MAX_DIM && heads / kv_heads <= TILE_LANES;
}

/* Whether a run of `rows` tokens attends in tiles (exported through `batch_pass.c`, for its
 * tests). A tile does the work of all its lanes however few tokens fill them, and a token's query
 * vector attended row by row costs about two lanes. SmolLM2 3,296 tokens deep (tiles of 16
 * tokens), a C pass over one run: 2 tokens took 48 ms in tiles against 24 row by row, 4 took 48
 * against 32, 8 took 49 against 47, 16 took 54 against 87. The choice is the run's own, so a
 * row's numbers never depend on the runs beside it. */
int64_t chunk_run_tiled(int64_t rows, int64_t heads, int64_t kv_heads) {
    int64_t tile_rows = TILE_LANES / (heads / kv_heads);
    return (rows + tile_rows - 1) / tile_rows * tile_rows <= 2 * rows;
}

/* One tile: `rows` consecutive tokens from position `first`, the `group` query heads of one key
 * head. Lane v is token v / group's head v % group; token t sees keys 0 .. first + t. */
static void attend_tile(const float *queries, int64_t query_stride, float *out, int64_t out_stride, int64_t rows,
                        int64_t group, int64_t first, const float *key_pages, const float *value_pages,
                        const int64_t *blocks, int64_t head_dim, float scale) {
    int64_t lanes = rows * group, length = first + rows, block_floats = LANES * head_dim;
    float queries_t[TILE_MAX_DIM * TILE_LANES], sums_t[TILE_MAX_DIM * TILE_LANES], weights[LANES * TILE_LANES];
    vec16 last_key[TILE_GROUPS], best[TILE_GROUPS], total[TILE_GROUPS], rescale[TILE_GROUPS];
    for (int64_t v = 0; v < TILE_LANES; v++) {
        const float *query = v < lanes ? queries + (v / group) * query_stride + (v % group) * head_dim : NULL;
        for (int64_t d = 0; d < head_dim; d++) queries_t[d * TILE_LANES + v] = query ? query[d] * scale : 0.0f;
        last_key[v / LANES][v % LANES] = query ? (float)(first + v / group) : (float)length;
    }
    memset(sums_t, 0, sizeof(float) * (size_t)(head_dim * TILE_LANES));
    for (int g = 0; g < TILE_GROUPS; g++) {
        best[g] = splat16(-INFINITY);
        total[g] = splat16(0.0f);
    }
    for (int64_t start = 0, j = 0; start < length; start += LANES, j++) {
        const float *keys = key_pages + blocks[j] * block_floats, *values = value_pages + blocks[j] * block_floats;
        int64_t count = length - start < LANES ? length - start : LANES;
        if (start + LANES < length) {
            prefetch_block(key_pages + blocks[j + 1] * block_floats, block_floats);
            prefetch_block(value_pages + blocks[j + 1] * block_floats, block_floats);
        }
        /* Scores: weights[i] holds every lane's q . k_i (a block's slots past `count` hold
         * whatever the pool has and are never read back). */
        for (int64_t i0 = 0; i0 < count; i0 += REGISTER_ROWS) {
            vec16 s[REGISTER_ROWS][TILE_GROUPS];
            for (int i = 0; i < REGISTER_ROWS; i++) {
                for (int g = 0; g < TILE_GROUPS; g++) s[i][g] = splat16(0.0f);
            }
            for (int64_t d = 0; d < head_dim; d++) {
                vec16 q[TILE_GROUPS];
                for (int g = 0; g < TILE_GROUPS; g++) q[g] = load16(queries_t + d * TILE_LANES + g * LANES);
                for (int i = 0; i < REGISTER_ROWS; i++) {
                    vec16 k = splat16(keys[(i0 + i) * head_dim + d]);
                    for (int g = 0; g < TILE_GROUPS; g++) s[i][g] += k * q[g];
                }
            }
            for (int i = 0; i < REGISTER_ROWS; i++) {
                for (int g = 0; g < TILE_GROUPS; g++) store16(weights + (i0 + i) * TILE_LANES + g * LANES, s[i][g]);
            }
        }
        /* The online softmax: keys past a lane's token are masked, the running maximum moves,
         * and the scores become weights against it. */
        for (int g = 0; g < TILE_GROUPS; g++) {
            vec16 top = best[g], added = splat16(0.0f);
            for (int64_t i = 0; i < count; i++) {
                float *score = weights + i * TILE_LANES + g * LANES;
                vec16 s = load16(score);
                if (start + i > first) s = select16(splat16((float)(start + i)) <= last_key[g], s, splat16(-INFINITY));
                store16(score, s);
                top = max16(top, s);
            }
            for (int64_t i = 0; i < count; i++) {
                float *score = weights + i * TILE_LANES + g * LANES;
                vec16 e = exp16_nonpositive(load16(score) - top);
                store16(score, e);
                added += e;
            }
            rescale[g] = exp16_nonpositive(best[g] - top);
            total[g] = total[g] * rescale[g] + added;
            best[g] = top;
        }
        /* Sums: each value row weighted per lane, REGISTER_ROWS dims at a time. */
        for (int64_t d0 = 0; d0 < head_dim; d0 += REGISTER_ROWS) {
            vec16 acc[REGISTER_ROWS][TILE_GROUPS];
            for (int d = 0; d < REGISTER_ROWS; d++) {
                for (int g = 0; g < TILE_GROUPS; g++)
                    acc[d][g] = load16(sums_t + (d0 + d) * TILE_LANES + g * LANES) * rescale[g];
            }
            for (int64_t i = 0; i < count; i++) {
                vec16 w[TILE_GROUPS];
                for (int g = 0; g < TILE_GROUPS; g++) w[g] = load16(weights + i * TILE_LANES + g * LANES);
                for (int d = 0; d < REGISTER_ROWS; d++) {
                    vec16 value = splat16(values[i * head_dim + d0 + d]);
                    for (int g = 0; g < TILE_GROUPS; g++) acc[d][g] += value * w[g];
                }
            }
            for (int d = 0; d < REGISTER_ROWS; d++) {
                for (int g = 0; g < TILE_GROUPS; g++) store16(sums_t + (d0 + d) * TILE_LANES + g * LANES, acc[d][g]);
            }
        }
    }
    for (int64_t v = 0; v < lanes; v++) {
        float *row = out + (v / group) * out_stride + (v % group) * head_dim;
        float inverse = 1.0f / total[v / LANES][v % LANES];
        for (int64_t d = 0; d < head_dim; d++) row[d] = sums_t[d * TILE_LANES + v] * inverse;
    }
}

/* Every thread of the running team calls this, for a pass whose rows are `runs` runs and which
 * `chunk_tiles_fit`. Runs that `chunk_run_tiled` attend in tiles, handed out a key head at a time
 * and within it latest first (the most keys), so the last ones to start are short; the others'
 * tokens attend row by row, each (token, head) pair a unit after the tiles. A key head at a time,
 * a thread's next tile mostly reads the keys and values its last one left in its L2 (a zoo model's
 * head holds 1 MB of them 4,096 tokens deep; a thread taking a tile's heads in turn cycled through
 * three): four 4,096-token passes of zoo-rope took 0.875 s against 0.915 (medians of 6, the two
 * orders alternating). */
static void chunk_attention_shared(const float *queries, const float *new_keys, const float *new_values,
                                   float *key_pages, float *value_pages, const int64_t *block_table,
                                   const int64_t *positions, float *out, float *scores, int64_t query_row_stride,
                                   int64_t key_row_stride, int64_t value_row_stride, int64_t batch, int64_t heads,
                                   int64_t kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                                   int64_t blocks_per_row, const int64_t *run_ends, int64_t runs, float scale) {
    int64_t head_stride = num_blocks * block_size * head_dim, window = blocks_per_row * block_size;
    int64_t group = heads / kv_heads, tile_rows = TILE_LANES / group, tiles = 0, pairs = 0;
    write_rows_entries(new_keys, new_values, key_pages, value_pages, block_table, positions, key_row_stride,
                       value_row_stride, batch, kv_heads, head_dim, head_stride, block_size, blocks_per_row);
    for (int64_t r = 0, begin = 0; r < runs; begin = run_ends[r++]) {
        int64_t rows = run_ends[r] - begin;
        if (chunk_run_tiled(rows, heads, kv_heads)) {
            tiles += (rows + tile_rows - 1) / tile_rows;
        } else {
            pairs += rows * heads;
        }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < tiles * kv_heads + pairs; unit++) {
        if (unit >= tiles * kv_heads) { /* a (token, head) pair of a run attended row by row */
            int64_t pair = unit - tiles * kv_heads, b = 0;
            for (int64_t r = 0, begin = 0; r < runs; begin = run_ends[r++]) {
                int64_t rows = run_ends[r] - begin;
                if (chunk_run_tiled(rows, heads, kv_heads)) continue;
                if (pair < rows * heads) {
                    b = begin + pair / heads;
                    break;
                }
                pair -= rows * heads;
            }
            int64_t h = pair % heads, kv = h / group;
            attend_head(queries + b * query_row_stride + h * head_dim, key_pages + kv * head_stride,
                        value_pages + kv * head_stride, block_table + b * blocks_per_row, positions[b] + 1, NULL, NULL,
                        NULL, 0, out + (b * heads + h) * head_dim, scores + (int64_t)omp_get_thread_num() * window,
                        block_size, head_dim, scale);
            continue;
        }
        int64_t tile = tiles - 1 - unit % tiles, kv = unit / tiles, row = 0, end = 0;
        for (int64_t r = 0, begin = 0; r < runs; begin = run_ends[r++]) {
            int64_t rows = run_ends[r] - begin, count = (rows + tile_rows - 1) / tile_rows;
            if (!chunk_run_tiled(rows, heads, kv_heads)) continue;
            if (tile < count) {
                row = begin + tile * tile_rows;
                end = run_ends[r];
                break;
            }
            tile -= count;
        }
        int64_t rows = end - row < tile_rows ? end - row : tile_rows;
        attend_tile(queries + row * query_row_stride + kv * group * head_dim, query_row_stride,
                    out + (row * heads + kv * group) * head_dim, heads * head_dim, rows, group, positions[row],
                    key_pages + kv * head_stride, value_pages + kv * head_stride, block_table + row * blocks_per_row,
                    head_dim, scale);
    }
}

#endif
