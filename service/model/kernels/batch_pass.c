/*
 * A whole pass over a batch of rows on a CPU (a decode pass, or a prompt chunk's tokens as rows),
 * in one call: every layer's norms, projections, rotary embedding, attention over the paged pool and MLP, then the final norm and the logits.
 *
 * The products and the attention are the kernels of `packed_linear.c` and `paged_attention.c`
 * (a prompt chunk's attention: `chunk_attention.h`), included here; what this adds is running
 * them back to back without returning to Python. Called as torch ops from a compiled graph, each
 * of a zoo model's 21 kernel calls a step came with a dispatch, and the graph's wrappers with a fixed cost: 0.4-0.5 ms of a 1.8 ms step at 16 rows.
 *
 * Inputs (float32, row-major; B rows):
 *   hidden       [B, D]      the embedded tokens (scaled, absolute positions added); overwritten
 *   rope_cos/sin [B, R]      each row's rotary tables at its position, or NULL (no rotation)
 *   bias         [B, H, W]   added to the attention scores (ALiBi, T5), or NULL
 *   layers       per layer 11 pointers: attn_norm [D], qkv (packed, N = (H + 2 Hkv) hd) and its
 *                scales, qkv_bias [N] or NULL, o_proj (packed, N = D) and its scales, mlp_norm [D],
 *                gate_up (packed, N = 2 F) and its scales, down (packed, N = D) and its scales;
 *                a matrix's scales are NULL for float32 panels
 *   formats      each matrix's panel format (`packed_linear.c`): per layer qkv, o_proj, gate_up and
 *                down, then lm_head
 *   key_pages / value_pages  per layer, [Hkv, NB, BS, hd]: each row's new entries are written
 *   window_blocks [B, nb], positions [B]   as for `paged_decode_attention`
 *   run_ends     [runs]      for a prompt chunk, where each run of rows (one sequence's
 *                consecutive tokens) ends, as `chunk_attention.h` reads them; NULL and 0 for a decode pass
 *   final_norm [D], lm_head (packed, N = V) and its scales; logits [B, V] out
 *   workspace    `batch_pass_workspace(...)` floats, sized after `kernel_threads`
 */
#include "packed_linear.c"
#include "chunk_attention.h"

/* Where each tensor sits in a layer's entry of `layers`. */
enum { ATTN_NORM, QKV, QKV_SCALES, QKV_BIAS, O_PROJ, O_SCALES, MLP_NORM, GATE_UP, GATE_UP_SCALES, DOWN, DOWN_SCALES,
       LAYER_TENSORS };

/* The most inputs a product of the pass takes. */
static int64_t widest_input(int64_t d_model, int64_t heads, int64_t head_dim, int64_t ffn) {
    int64_t widest = d_model;
    widest = heads * head_dim > widest ? heads * head_dim : widest;
    return ffn > widest ? ffn : widest;
}

int64_t batch_pass_workspace(int64_t batch, int64_t d_model, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             int64_t ffn, int64_t window) {
    int64_t qkv = (heads + 2 * kv_heads) * head_dim, widest = widest_input(d_model, heads, head_dim, ffn);
    return batch * (2 * d_model + qkv + heads * head_dim + 3 * ffn) + kernel_thread_count * (window + widest * PANEL) +
           packed_activation_floats(batch, widest);
}

/* For every row (shared out among the team): hidden += added (the residual; none where `added` is
 * NULL), then normed = torch's rms_norm of it: weight * (x * rsqrt(mean(x^2) + eps)). Fused, a
 * layer's residual add and the next norm cost one barrier, and every thread takes rows. */
static void residual_norm_rows(float *restrict hidden, const float *restrict added, const float *restrict weight,
                               float *restrict normed, int64_t batch, int64_t d_model, float eps) {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < batch; b++) {
        float *row = hidden + b * d_model;
        if (added) {
#pragma omp simd
            for (int64_t d = 0; d < d_model; d++) row[d] += added[b * d_model + d];
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t d = 0; d < d_model; d++) squares += row[d] * row[d];
        float inverse = 1.0f / sqrtf(squares / (float)d_model + eps);
#pragma omp simd
        for (int64_t d = 0; d < d_model; d++) normed[b * d_model + d] = weight[d] * (row[d] * inverse);
    }
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

/* silu(gate) * up for every row: gate and up are the two halves of each row of `gate_up`. The
 * exponentials come first in a loop of their own, which vectorizes (fused with the rest, it did
 * not: 129 us a layer at 64 rows). */
static void gated_activation(const float *restrict gate_up, float *restrict out, int64_t batch, int64_t ffn) {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < batch; b++) {
        const float *gate = gate_up + b * 2 * ffn, *up = gate + ffn;
        float *row = out + b * ffn;
#pragma omp simd
        for (int64_t f = 0; f < ffn; f++) row[f] = exp_nonpositive(-fabsf(gate[f])); /* never overflows */
#pragma omp simd
        for (int64_t f = 0; f < ffn; f++) {
            float x = gate[f], e = row[f], inverse = 1.0f / (1.0f + e);
            float sigmoid = x > 0.0f ? inverse : e * inverse; /* 1 / (1 + exp(-x)) either way */
            row[f] = x * sigmoid * up[f];
        }
    }
}

void batch_pass(float *hidden, const float *rope_cos, const float *rope_sin, const float *bias,
                const void *const *layers, float *const *key_pages, float *const *value_pages,
                const int64_t *window_blocks, const int64_t *positions, const float *final_norm, const void *lm_head,
                const float *lm_head_scales, float *logits, float *workspace, int64_t batch, int64_t n_layers,
                int64_t d_model, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t ffn, int64_t vocab,
                int64_t rotary_dim, int64_t interleaved, int64_t num_blocks, int64_t block_size,
                int64_t blocks_per_row, const int64_t *run_ends, int64_t runs, const int64_t *formats,
                float eps) {
    int64_t qkv_width = (heads + 2 * kv_heads) * head_dim, attended_width = heads * head_dim;
    float *normed = workspace, *qkv = normed + batch * d_model, *attended = qkv + batch * qkv_width;
    float *projected = attended + batch * attended_width, *gate_up = projected + batch * d_model;
    float *activation = gate_up + batch * 2 * ffn, *scores = activation + batch * ffn;
    float *widened = scores + kernel_thread_count * blocks_per_row * block_size; /* see packed_linear_shared */
    float *quantized = widened + kernel_thread_count * widest_input(d_model, heads, head_dim, ffn) * PANEL;
    float scale = 1.0f / sqrtf((float)head_dim);
    int tiled = runs > 0 && !bias && chunk_tiles_fit(heads, kv_heads, head_dim, block_size);
    /* One team for the whole pass: the products, the attention, the activation, the norms (with
     * the residual adds) and the rotations share their loops among its threads. */
#pragma omp parallel num_threads(kernel_thread_count)
    {
        for (int64_t l = 0; l < n_layers; l++) {
            const void *const *w = layers + l * LAYER_TENSORS;
            const int64_t *f = formats + l * 4; /* qkv, o_proj, gate_up, down */
            /* The last layer's MLP output joins the residual here (none before the first layer). */
            residual_norm_rows(hidden, l > 0 ? projected : NULL, w[ATTN_NORM], normed, batch, d_model, eps);
            packed_linear_shared(normed, d_model, w[QKV], w[QKV_SCALES], (int)f[0], w[QKV_BIAS], qkv, batch,
                                 d_model, qkv_width, widened, quantized);
            if (rope_cos) {
#pragma omp for schedule(static)
                for (int64_t b = 0; b < batch; b++) {
                    for (int64_t h = 0; h < heads + kv_heads; h++) { /* queries, then keys */
                        rotate_head(qkv + b * qkv_width + h * head_dim, rope_cos + b * rotary_dim,
                                    rope_sin + b * rotary_dim, rotary_dim, interleaved);
                    }
                }
            }
            const float *keys = qkv + attended_width, *values = keys + kv_heads * head_dim;
            if (tiled) {
                chunk_attention_shared(qkv, keys, values, key_pages[l], value_pages[l], window_blocks, positions,
                                       attended, scores, qkv_width, qkv_width, qkv_width, batch, heads, kv_heads, head_dim,
                                       num_blocks, block_size, blocks_per_row, run_ends, runs, scale);
            } else {
                paged_attention_shared(qkv, keys, values, key_pages[l], value_pages[l], window_blocks, positions,
                                       bias, attended, scores, qkv_width, qkv_width, qkv_width, batch, heads,
                                       kv_heads, head_dim, num_blocks, block_size, blocks_per_row, scale);
            }
            packed_linear_shared(attended, attended_width, w[O_PROJ], w[O_SCALES], (int)f[1], NULL, projected,
                                 batch, attended_width, d_model, widened, quantized);
            residual_norm_rows(hidden, projected, w[MLP_NORM], normed, batch, d_model, eps);
            packed_linear_shared(normed, d_model, w[GATE_UP], w[GATE_UP_SCALES], (int)f[2], NULL, gate_up, batch,
                                 d_model, 2 * ffn, widened, quantized);
            gated_activation(gate_up, activation, batch, ffn);
            packed_linear_shared(activation, ffn, w[DOWN], w[DOWN_SCALES], (int)f[3], NULL, projected, batch, ffn,
                                 d_model, widened, quantized);
        }
        residual_norm_rows(hidden, n_layers > 0 ? projected : NULL, final_norm, normed, batch, d_model, eps);
        packed_linear_shared(normed, d_model, lm_head, lm_head_scales, (int)formats[n_layers * 4], NULL, logits,
                             batch, d_model, vocab, widened, quantized);
    }
}
