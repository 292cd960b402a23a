/*
 * One decode pass's attention over the paged KV pool, for CPUs: each row reads only the keys it
 * has (positions 0..its own), not the padded window a fixed-shape compiled step must read.
 *
 * Layouts (float32, row-major):
 *   queries      [B, H, D]        rotated already; H = Hkv * group
 *   new_keys     [B, Hkv, D]      this step's key and value of each row, written here first
 *   new_values   [B, Hkv, D]      (the three may have strided rows: *_row_stride floats apart)
 *   key_pages    [Hkv, NB, BS, D] the pool of one layer
 *   value_pages  [Hkv, NB, BS, D]
 *   block_table  [B, nb]          each row's blocks in order
 *   positions    [B]              each row's position (its keys before this step)
 *   bias         [B, H, nb * BS] or NULL: added to the scaled scores (ALiBi, T5)
 *   masked       [B, 2] or NULL: each row's slots [first, last) that it does not attend to (the
 *                entries a streaming row keeps between its sinks and its window)
 *   sinks        [B] or NULL: how many of each row's first slots its query reads turned back by
 *   sink_turn    [B, 2, R] (unit cos, then sin over the first R channels): where a streaming
 *                row's rule puts its query for its sinks (StreamingLLM: at most S + W), given as
 *                a turn from its text index
 *   out          [B, H, D]
 *   scores       scratch of threads * nb * BS floats (`kernel_threads`)
 *
 * Blocks of 16 keys with heads a multiple of 16 wide (every zoo and Llama-family model) take the
 * vector path: a block's 16 dot products are reduced together by a transposing tree of shuffles
 * instead of 16 horizontal sums, and the weighted sum of values stays in registers. Anything else
 * takes the scalar path. GCC's vector extensions keep it portable: they lower to AVX-512, AVX2 or
 * NEON, whatever `-march=native` finds.
 *
 * Rows' new entries are written first, then every (row, head) pair attends on its own among
 * `kernel_threads` OpenMP threads, each with its own `scores` scratch. A row of a prompt chunk
 * reads only positions up to its own, so the entries its chunk wrote after it stay unseen.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "exp.h"
#include "threads.h"
#include "vec16.h"

#define LANES 16
#define MAX_HEAD_DIM 512

typedef int32_t lanes16 __attribute__((vector_size(64)));

/* Blocks lie anywhere in the pool: ask for the next one while this one is being read. */
static inline void prefetch_block(const float *block, int64_t floats) {
    for (int64_t f = 0; f < floats; f += 64 / sizeof(float)) __builtin_prefetch(block + f);
}

/* A whole row's keys and values of one head, into L2, a row ahead of their use: a batch's pool
 * is larger than the caches, and one block ahead is too short to hide a read from memory. */
static void prefetch_row_head(const float *key_pages, const float *value_pages, const int64_t *blocks,
                              int64_t length, int64_t block_floats, int64_t block_size) {
    for (int64_t start = 0, j = 0; start < length; start += block_size, j++) {
        const float *keys = key_pages + blocks[j] * block_floats, *values = value_pages + blocks[j] * block_floats;
        for (int64_t f = 0; f < block_floats; f += 64 / sizeof(float)) {
            __builtin_prefetch(keys + f, 0, 2);
            __builtin_prefetch(values + f, 0, 2);
        }
    }
}

static float maximum(const float *restrict scores, int64_t length) {
    float best = -INFINITY;
#pragma omp simd reduction(max : best)
    for (int64_t t = 0; t < length; t++) best = scores[t] > best ? scores[t] : best;
    return best;
}

/* Scores become softmax numerators in place; returns their sum. */
static float exponentiate(float *restrict scores, int64_t length, float best) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < length; t++) {
        float e = exp_nonpositive(scores[t] - best);
        scores[t] = e;
        total += e;
    }
    return total;
}

/* Pairs of vectors holding 2^k partial sums per key -> one vector holding 2^(k-1) per key, for
 * twice the keys: lanes picked by `first` plus lanes picked by `second`. */
static inline vec16 fold(vec16 x, vec16 y, lanes16 first, lanes16 second) {
    return __builtin_shuffle(x, y, first) + __builtin_shuffle(x, y, second);
}

/* p[i]: key i's 16 partial products -> the 16 dot products, key i in lane i. */
static inline vec16 transpose_sum(vec16 p[LANES]) {
    const lanes16 halves_a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const lanes16 halves_b = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const lanes16 quarters_a = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const lanes16 quarters_b = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const lanes16 pairs_a = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const lanes16 pairs_b = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const lanes16 evens = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const lanes16 odds = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vec16 eight[8], four[4], two[2];
    for (int i = 0; i < 8; i++) eight[i] = fold(p[2 * i], p[2 * i + 1], halves_a, halves_b);
    for (int i = 0; i < 4; i++) four[i] = fold(eight[2 * i], eight[2 * i + 1], quarters_a, quarters_b);
    for (int i = 0; i < 2; i++) two[i] = fold(four[2 * i], four[2 * i + 1], pairs_a, pairs_b);
    return fold(two[0], two[1], evens, odds);
}

/* Rotate the first `rotary_dim` channels of one head: x * cos + quarter_turn(x) * sin, where the
 * quarter turn maps each channel pair (a, b) to (-b, a); pairs are (c, c + R/2) in the neox
 * layout and (2i, 2i + 1) when `interleaved`. */
static void rotate_head(float *restrict x, const float *restrict cos, const float *restrict sin,
                        int64_t rotary_dim, int64_t interleaved) {
    float original[MAX_HEAD_DIM];
    memcpy(original, x, (size_t)rotary_dim * sizeof(float));
    int64_t half = rotary_dim / 2;
    for (int64_t c = 0; c < rotary_dim; c++) {
        float turned;
        if (interleaved)
            turned = c % 2 ? original[c - 1] : -original[c + 1];
        else
            turned = c < half ? -original[c + half] : original[c - half];
        x[c] = original[c] * cos[c] + turned * sin[c];
    }
}

/* The vector path: 16-key blocks, heads of `head_dim` = a multiple of 16 (a constant where inlined). */
static inline __attribute__((always_inline)) void attend_head_vec(
    const float *restrict query, const float *restrict key_pages, const float *restrict value_pages,
    const int64_t *restrict blocks, int64_t length, const float *restrict bias, const int64_t *restrict masked,
    const float *restrict sink_query, int64_t sinks, float *restrict out, float *restrict scores, int64_t head_dim,
    float scale) {
    int64_t chunks = head_dim / LANES, block_floats = LANES * head_dim;
    vec16 q[MAX_HEAD_DIM / LANES], qs[MAX_HEAD_DIM / LANES];
    for (int64_t c = 0; c < chunks; c++) q[c] = load16(query + c * LANES) * splat16(scale);
    for (int64_t c = 0; c < chunks; c++) qs[c] = sinks > 0 ? load16(sink_query + c * LANES) * splat16(scale) : q[c];
    for (int64_t start = 0, j = 0; start < length; start += LANES, j++) {
        const float *keys = key_pages + blocks[j] * block_floats;
        if (start + LANES < length) prefetch_block(key_pages + blocks[j + 1] * block_floats, block_floats);
        vec16 partial[LANES];
        for (int i = 0; i < LANES; i++) {
            vec16 sum = q[0] * load16(keys + i * head_dim);
            for (int64_t c = 1; c < chunks; c++) sum += q[c] * load16(keys + i * head_dim + c * LANES);
            partial[i] = sum;
        }
        vec16 block_scores = transpose_sum(partial);
        if (start < sinks) { /* the sinks' scores, against the query where the rule puts it */
            for (int i = 0; i < LANES; i++) {
                vec16 sum = qs[0] * load16(keys + i * head_dim);
                for (int64_t c = 1; c < chunks; c++) sum += qs[c] * load16(keys + i * head_dim + c * LANES);
                partial[i] = sum;
            }
            vec16 sink_scores = transpose_sum(partial);
            for (int i = 0; i < LANES && start + i < sinks; i++) block_scores[i] = sink_scores[i];
        }
        if (bias) block_scores += load16(bias + start);
        if (length - start < LANES) { /* keys past the row's length are not its own: mask them */
            for (int i = (int)(length - start); i < LANES; i++) block_scores[i] = -INFINITY;
        }
        if (masked && start < masked[1] && start + LANES > masked[0]) {
            for (int i = 0; i < LANES; i++) {
                if (start + i >= masked[0] && start + i < masked[1]) block_scores[i] = -INFINITY;
            }
        }
        store16(scores + start, block_scores);
    }
    float inverse = 1.0f / exponentiate(scores, length, maximum(scores, length));
    /* Two sums, for even and odd keys: each add then waits on the one two keys back, not one. */
    vec16 even[MAX_HEAD_DIM / LANES], odd[MAX_HEAD_DIM / LANES];
    for (int64_t c = 0; c < chunks; c++) even[c] = odd[c] = splat16(0.0f);
    for (int64_t start = 0, j = 0; start < length; start += LANES, j++) {
        const float *values = value_pages + blocks[j] * block_floats;
        if (start + LANES < length) prefetch_block(value_pages + blocks[j + 1] * block_floats, block_floats);
        int64_t count = length - start < LANES ? length - start : LANES;
        int64_t i = 0;
        for (; i + 1 < count; i += 2) {
            vec16 first = splat16(scores[start + i]), second = splat16(scores[start + i + 1]);
            for (int64_t c = 0; c < chunks; c++) {
                even[c] += first * load16(values + i * head_dim + c * LANES);
                odd[c] += second * load16(values + (i + 1) * head_dim + c * LANES);
            }
        }
        if (i < count) {
            vec16 last = splat16(scores[start + i]);
            for (int64_t c = 0; c < chunks; c++) even[c] += last * load16(values + i * head_dim + c * LANES);
        }
    }
    vec16 sum[MAX_HEAD_DIM / LANES];
    for (int64_t c = 0; c < chunks; c++) sum[c] = even[c] + odd[c];
    for (int64_t c = 0; c < chunks; c++) store16(out + c * LANES, sum[c] * splat16(inverse));
}

/* The scalar path: any block size and head size. */
static void attend_head_scalar(const float *restrict query, const float *restrict key_pages,
                               const float *restrict value_pages, const int64_t *restrict blocks,
                               int64_t length, const float *restrict bias, const int64_t *restrict masked,
                               const float *restrict sink_query, int64_t sinks, float *restrict out,
                               float *restrict scores, int64_t block_size, int64_t head_dim, float scale) {
    int64_t block_floats = block_size * head_dim;
    for (int64_t start = 0, j = 0; start < length; start += block_size, j++) {
        const float *keys = key_pages + blocks[j] * block_floats;
        int64_t count = length - start < block_size ? length - start : block_size;
        for (int64_t i = 0; i < count; i++) {
            const float *reader = start + i < sinks ? sink_query : query;
            float s = 0.0f;
            for (int64_t d = 0; d < head_dim; d++) s += reader[d] * keys[i * head_dim + d];
            s *= scale;
            if (bias) s += bias[start + i];
            if (masked && start + i >= masked[0] && start + i < masked[1]) s = -INFINITY;
            scores[start + i] = s;
        }
    }
    float inverse = 1.0f / exponentiate(scores, length, maximum(scores, length));
    for (int64_t d = 0; d < head_dim; d++) out[d] = 0.0f;
    for (int64_t start = 0, j = 0; start < length; start += block_size, j++) {
        const float *values = value_pages + blocks[j] * block_floats;
        int64_t count = length - start < block_size ? length - start : block_size;
        for (int64_t i = 0; i < count; i++) {
            for (int64_t d = 0; d < head_dim; d++) out[d] += scores[start + i] * values[i * head_dim + d];
        }
    }
    for (int64_t d = 0; d < head_dim; d++) out[d] *= inverse;
}

/* `masked`: NULL, or the slots [masked[0], masked[1]) this row does not attend to. Its own
 * newest key (slot length - 1) is never among them, so every softmax has a key. Its first `sinks`
 * slots are read by `sink_query` instead of `query`. */
static void attend_head(const float *query, const float *key_pages, const float *value_pages,
                        const int64_t *blocks, int64_t length, const float *bias, const int64_t *masked,
                        const float *sink_query, int64_t sinks, float *out, float *scores, int64_t block_size,
                        int64_t head_dim, float scale) {
    if (block_size != LANES || head_dim % LANES || head_dim > MAX_HEAD_DIM) {
        attend_head_scalar(query, key_pages, value_pages, blocks, length, bias, masked, sink_query, sinks, out,
                           scores, block_size, head_dim, scale);
        return;
    }
    /* Common head sizes as constants: the chunk loops unroll and the sums stay in registers. */
    switch (head_dim) {
        case 32:
            attend_head_vec(query, key_pages, value_pages, blocks, length, bias, masked, sink_query, sinks, out, scores,
                            32, scale);
            break;
        case 64:
            attend_head_vec(query, key_pages, value_pages, blocks, length, bias, masked, sink_query, sinks, out, scores,
                            64, scale);
            break;
        case 128:
            attend_head_vec(query, key_pages, value_pages, blocks, length, bias, masked, sink_query, sinks, out, scores,
                            128, scale);
            break;
        default:
            attend_head_vec(query, key_pages, value_pages, blocks, length, bias, masked, sink_query, sinks, out, scores,
                            head_dim, scale);
    }
}

static void write_new_entries(const float *row_entries, float *pages, int64_t kv_heads, int64_t head_dim,
                              int64_t head_stride, int64_t slot) {
    for (int64_t h = 0; h < kv_heads; h++) {
        memcpy(pages + h * head_stride + slot * head_dim, row_entries + h * head_dim,
               (size_t)head_dim * sizeof(float));
    }
}

/* Each row's new key and value into its slot of the pool, on one thread of the team, before any
 * row attends: a prompt chunk's rows read the entries the rows before them wrote. */
static void write_rows_entries(const float *new_keys, const float *new_values, float *key_pages, float *value_pages,
                               const int64_t *block_table, const int64_t *positions, int64_t key_row_stride,
                               int64_t value_row_stride, int64_t batch, int64_t kv_heads, int64_t head_dim,
                               int64_t head_stride, int64_t block_size, int64_t blocks_per_row) {
#pragma omp single
    for (int64_t b = 0; b < batch; b++) {
        const int64_t *blocks = block_table + b * blocks_per_row;
        int64_t position = positions[b];
        int64_t slot = blocks[position / block_size] * block_size + position % block_size;
        write_new_entries(new_keys + b * key_row_stride, key_pages, kv_heads, head_dim, head_stride, slot);
        write_new_entries(new_values + b * value_row_stride, value_pages, kv_heads, head_dim, head_stride, slot);
    }
}

/* Every thread of the running team calls this (see `paged_decode_attention`). */
static void paged_attention_shared(const float *queries, const float *new_keys, const float *new_values,
                                   float *key_pages, float *value_pages, const int64_t *block_table,
                                   const int64_t *positions, const float *bias, const int64_t *masked,
                                   const int64_t *sinks, const float *sink_turn, int64_t rotary_dim,
                                   int64_t interleaved, float *out, float *scores, int64_t query_row_stride, int64_t key_row_stride,
                                   int64_t value_row_stride, int64_t batch, int64_t heads, int64_t kv_heads,
                                   int64_t head_dim, int64_t num_blocks, int64_t block_size,
                                   int64_t blocks_per_row, float scale) {
    int64_t head_stride = num_blocks * block_size * head_dim;
    int64_t window = blocks_per_row * block_size;
    int64_t group = heads / kv_heads;
    write_rows_entries(new_keys, new_values, key_pages, value_pages, block_table, positions, key_row_stride,
                       value_row_stride, batch, kv_heads, head_dim, head_stride, block_size, blocks_per_row);
    /* Pairs in row order, heads of one key head together: a thread's next pair reads the keys
     * its last one did, or the next row's, which it asks for one row ahead. */
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < batch * heads; pair++) {
        int64_t b = pair / heads, h = pair % heads, kv = h / group;
        const int64_t *blocks = block_table + b * blocks_per_row;
        int64_t position = positions[b];
        float *own_scores = scores + (int64_t)omp_get_thread_num() * window;
        if (b + 1 < batch && h % group == 0) {
            prefetch_row_head(key_pages + kv * head_stride, value_pages + kv * head_stride,
                              blocks + blocks_per_row, positions[b + 1] + 1, block_size * head_dim, block_size);
        }
        const float *query = queries + b * query_row_stride + h * head_dim;
        int64_t row_sinks = sinks ? sinks[b] : 0;
        float sink_query[MAX_HEAD_DIM];
        if (row_sinks > 0) {
            memcpy(sink_query, query, (size_t)head_dim * sizeof(float));
            const float *turn = sink_turn + b * 2 * rotary_dim;
            rotate_head(sink_query, turn, turn + rotary_dim, rotary_dim, interleaved);
        }
        attend_head(query, key_pages + kv * head_stride, value_pages + kv * head_stride, blocks, position + 1,
                    bias ? bias + (b * heads + h) * window : NULL, masked ? masked + 2 * b : NULL,
                    row_sinks > 0 ? sink_query : NULL, row_sinks, out + (b * heads + h) * head_dim, own_scores, block_size, head_dim, scale);
    }
}

void paged_decode_attention(const float *queries, const float *new_keys, const float *new_values,
                            float *key_pages, float *value_pages, const int64_t *block_table,
                            const int64_t *positions, const float *bias, const int64_t *masked, float *out,
                            float *scores, int64_t query_row_stride, int64_t key_row_stride,
                            int64_t value_row_stride, int64_t batch, int64_t heads, int64_t kv_heads,
                            int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t blocks_per_row,
                            float scale) {
#pragma omp parallel num_threads(kernel_thread_count)
    paged_attention_shared(queries, new_keys, new_values, key_pages, value_pages, block_table, positions, bias, masked,
                           NULL, NULL, 0, 0, out,
                           scores, query_row_stride, key_row_stride, value_row_stride, batch, heads, kv_heads,
                           head_dim, num_blocks, block_size, blocks_per_row, scale);
}
