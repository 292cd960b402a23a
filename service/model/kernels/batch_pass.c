/*
 * A whole pass over a batch of rows on a CPU (a decode pass, or a prompt chunk's tokens as rows),
 * in one call: every layer's norms, projections, q/k norms, rotary embedding, attention over the paged
 * pool and MLP, then the final norm and the logits, for every block `service.model.spec` describes.
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
 *   masked       [B, 2]      each row's slots [first, last) it does not attend to, or NULL
 *   sinks        [B]         how many of each row's first slots its query reads turned back by
 *                            `sink_turn` [B, 2, R] (unit cos, then sin), or NULL: a streaming
 *                            row's sinks, which it reads from where its rule puts it
 *   layers       per layer `LAYER_TENSORS` pointers (the enum below): the norms' weights [D] and
 *                biases, qkv (packed, N = (H + 2 Hkv) hd), the q/k norms [hd], o_proj (N = D), up
 *                (N = 2 F gated, else F) and down (N = D), each packed matrix with its scales (NULL
 *                for float32 panels) and its bias (NULL for none)
 *   formats      each matrix's panel format (`packed_linear.c`): per layer qkv, o_proj, up and
 *                down, then lm_head
 *   block        the block's features (`BLOCK_FEATURES` entries): norm kind, activation, gated or
 *                not, residual shape
 *   key_pages / value_pages  per layer, [Hkv, NB, BS, hd]: each row's new entries are written
 *   window_blocks [B, nb], positions [B]   as for `paged_decode_attention`
 *   run_ends     [runs]      for a prompt chunk, where each run of rows (one sequence's
 *                consecutive tokens) ends, as `chunk_attention.h` reads them; NULL and 0 for a decode pass
 *   final_norm [D] and its bias, lm_head (packed, N = V), its scales and bias; logits [B, V] out
 *   workspace    `batch_pass_workspace(...)` floats, sized after `kernel_threads`
 */
#include "packed_linear.c"
#include "chunk_attention.h"

/* Where each tensor sits in a layer's entry of `layers`; a NULL norm bias, projection bias or q/k
 * norm is a model without it, a NULL `MLP_NORM` one whose MLP reads the attention's norm
 * (`RESIDUAL_PARALLEL`). `UP` is gate then up stacked ([2 F, D]) for a gated MLP, else up [F, D]. */
enum { ATTN_NORM, ATTN_NORM_BIAS, QKV, QKV_SCALES, QKV_BIAS, Q_NORM, K_NORM, O_PROJ, O_SCALES, O_BIAS, MLP_NORM,
       MLP_NORM_BIAS, UP, UP_SCALES, UP_BIAS, DOWN, DOWN_SCALES, DOWN_BIAS, LAYER_TENSORS };

/* The block's features (`service.model.spec.BlockSpec`), as the `block` array gives them. */
enum { BLOCK_LAYER_NORM, BLOCK_ACTIVATION, BLOCK_GATED, BLOCK_RESIDUAL, BLOCK_FEATURES };
enum { ACTIVATION_SILU, ACTIVATION_GELU, ACTIVATION_GELU_TANH };
/* sequential: x + attn(n1(x)), then + mlp(n2(.)); parallel: x + attn(n1(x)) + mlp(n1(x));
 * parallel_two_norms: x + attn(n1(x)) + mlp(n2(x)). */
enum { RESIDUAL_SEQUENTIAL, RESIDUAL_PARALLEL, RESIDUAL_PARALLEL_TWO_NORMS };

/* The most inputs a product of the pass takes. */
static int64_t widest_input(int64_t d_model, int64_t heads, int64_t head_dim, int64_t ffn) {
    int64_t widest = d_model;
    widest = heads * head_dim > widest ? heads * head_dim : widest;
    return ffn > widest ? ffn : widest;
}

int64_t batch_pass_workspace(int64_t batch, int64_t d_model, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             int64_t ffn, int64_t window) {
    int64_t qkv = (heads + 2 * kv_heads) * head_dim, widest = widest_input(d_model, heads, head_dim, ffn);
    return batch * (4 * d_model + qkv + heads * head_dim + 3 * ffn) + kernel_thread_count * (window + widest * PANEL) +
           packed_activation_floats(batch, widest);
}

/* out = the norm of one row: RMSNorm, weight * (x * rsqrt(mean(x^2) + eps)), or with `layer_norm`
 * LayerNorm, weight * ((x - mean) * rsqrt(var + eps)) + bias (`bias` may be NULL), both in float32
 * as torch computes them. `out` may be `row` (the q/k norms work in place). */
static inline void norm_row(const float *row, const float *restrict weight, const float *restrict bias, float *out,
                            int64_t width, float eps, int64_t layer_norm) {
    float mean = 0.0f;
    if (layer_norm) {
#pragma omp simd reduction(+ : mean)
        for (int64_t d = 0; d < width; d++) mean += row[d];
        mean /= (float)width;
    }
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t d = 0; d < width; d++) squares += (row[d] - mean) * (row[d] - mean);
    float inverse = 1.0f / sqrtf(squares / (float)width + eps);
    if (bias) {
#pragma omp simd
        for (int64_t d = 0; d < width; d++) out[d] = weight[d] * ((row[d] - mean) * inverse) + bias[d];
    } else {
#pragma omp simd
        for (int64_t d = 0; d < width; d++) out[d] = weight[d] * ((row[d] - mean) * inverse);
    }
}

/* For every row (shared out among the team): hidden += added + also_added (the residual; either
 * may be NULL), then normed = the block's norm of it. Fused, a layer's residual adds and the next
 * norm cost one barrier, and every thread takes rows. */
static void residual_norm_rows(float *restrict hidden, const float *restrict added, const float *restrict also_added,
                               const float *restrict weight, const float *restrict bias, float *restrict normed,
                               int64_t batch, int64_t d_model, float eps, int64_t layer_norm) {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < batch; b++) {
        float *row = hidden + b * d_model;
        if (added) {
#pragma omp simd
            for (int64_t d = 0; d < d_model; d++) row[d] += added[b * d_model + d];
        }
        if (also_added) {
#pragma omp simd
            for (int64_t d = 0; d < d_model; d++) row[d] += also_added[b * d_model + d];
        }
        norm_row(row, weight, bias, normed + b * d_model, d_model, eps, layer_norm);
    }
}

/* Each row's queries and keys as attention reads them: every head through its q/k norm (Qwen3;
 * none where `q_norm` is NULL), then rotated (none where `rope_cos` is NULL). */
static void place_heads(float *qkv, const float *q_norm, const float *k_norm, const float *rope_cos,
                        const float *rope_sin, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                        int64_t qkv_width, int64_t rotary_dim, int64_t interleaved, float eps) {
    if (!q_norm && !rope_cos) return;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < heads + kv_heads; h++) { /* queries, then keys */
            float *head = qkv + b * qkv_width + h * head_dim;
            if (q_norm) norm_row(head, h < heads ? q_norm : k_norm, NULL, head, head_dim, eps, 0);
            if (rope_cos) rotate_head(head, rope_cos + b * rotary_dim, rope_sin + b * rotary_dim, rotary_dim, interleaved);
        }
    }
}

/* tanh for any x, in plain arithmetic that vectorizes: sign(x) (1 - e) / (1 + e), e = exp(-2|x|). */
static inline float tanh_vectorizable(float x) {
    float e = exp_nonpositive(-2.0f * fabsf(x)), magnitude = (1.0f - e) / (1.0f + e);
    return x < 0.0f ? -magnitude : magnitude;
}

/* erf for any x, in plain arithmetic that vectorizes (libm's erff does not): Numerical Recipes'
 * Chebyshev fit of erfc, whose relative error is under 1.2e-7 everywhere. */
static inline float erf_vectorizable(float x) {
    float a = fabsf(x), t = 1.0f / (1.0f + 0.5f * a);
    float poly = -a * a - 1.26551223f +
                 t * (1.00002368f +
                      t * (0.37409196f +
                           t * (0.09678418f +
                                t * (-0.18628806f +
                                     t * (0.27886807f +
                                          t * (-1.13520398f + t * (1.48851587f + t * (-0.82215223f + t * 0.17087277f))))))));
    float erfc = t * exp_nonpositive(poly < 0.0f ? poly : 0.0f);
    return x < 0.0f ? erfc - 1.0f : 1.0f - erfc;
}

/* The MLP's hidden activations for every row: act(gate) * up where `gated` (gate and up the two
 * halves of each row of `projected`), else act(up). The exponentials of SiLU come first in a loop
 * of their own, which vectorizes (fused with the rest, it did not: 129 us a layer at 64 rows). */
static void activation_rows(const float *restrict projected, float *restrict out, int64_t batch, int64_t ffn,
                            int64_t activation, int64_t gated) {
    int64_t width = gated ? 2 * ffn : ffn;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < batch; b++) {
        const float *x = projected + b * width, *up = gated ? x + ffn : NULL;
        float *row = out + b * ffn;
        if (activation == ACTIVATION_SILU) {
#pragma omp simd
            for (int64_t f = 0; f < ffn; f++) row[f] = exp_nonpositive(-fabsf(x[f])); /* never overflows */
#pragma omp simd
            for (int64_t f = 0; f < ffn; f++) {
                float e = row[f], inverse = 1.0f / (1.0f + e);
                float sigmoid = x[f] > 0.0f ? inverse : e * inverse; /* 1 / (1 + exp(-x)) either way */
                row[f] = x[f] * sigmoid;
            }
        } else if (activation == ACTIVATION_GELU) {
#pragma omp simd
            for (int64_t f = 0; f < ffn; f++) row[f] = 0.5f * x[f] * (1.0f + erf_vectorizable(x[f] * 0.70710678118654752f));
        } else { /* GPT-2's tanh approximation */
#pragma omp simd
            for (int64_t f = 0; f < ffn; f++) {
                float v = x[f];
                row[f] = 0.5f * v * (1.0f + tanh_vectorizable(0.79788456080286536f * (v + 0.044715f * v * v * v)));
            }
        }
        if (up) {
#pragma omp simd
            for (int64_t f = 0; f < ffn; f++) row[f] *= up[f];
        }
    }
}

void batch_pass(float *hidden, const float *rope_cos, const float *rope_sin, const float *bias, const int64_t *masked,
                const int64_t *sinks, const float *sink_turn, const void *const *layers, float *const *key_pages, float *const *value_pages,
                const int64_t *window_blocks, const int64_t *positions, const float *final_norm,
                const float *final_norm_bias, const void *lm_head, const float *lm_head_scales,
                const float *lm_head_bias, float *logits, float *workspace, int64_t batch, int64_t n_layers,
                int64_t d_model, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t ffn, int64_t vocab,
                int64_t rotary_dim, int64_t interleaved, int64_t num_blocks, int64_t block_size,
                int64_t blocks_per_row, const int64_t *run_ends, int64_t runs, const int64_t *formats,
                const int64_t *block, float eps) {
    int64_t qkv_width = (heads + 2 * kv_heads) * head_dim, attended_width = heads * head_dim;
    int64_t layer_norm = block[BLOCK_LAYER_NORM], activation = block[BLOCK_ACTIVATION];
    int64_t gated = block[BLOCK_GATED], residual = block[BLOCK_RESIDUAL];
    int64_t up_width = gated ? 2 * ffn : ffn;
    float *normed = workspace, *mlp_normed = normed + batch * d_model, *qkv = mlp_normed + batch * d_model;
    float *attended = qkv + batch * qkv_width, *projected = attended + batch * attended_width;
    float *attention_out = projected + batch * d_model, *up = attention_out + batch * d_model;
    float *activated = up + batch * 2 * ffn, *scores = activated + batch * ffn;
    float *widened = scores + kernel_thread_count * blocks_per_row * block_size; /* see packed_linear_shared */
    float *quantized = widened + kernel_thread_count * widest_input(d_model, heads, head_dim, ffn) * PANEL;
    float scale = 1.0f / sqrtf((float)head_dim);
    int tiled = runs > 0 && !bias && !masked && !sinks && chunk_tiles_fit(heads, kv_heads, head_dim, block_size);
    /* A sequential block adds the attention's output before the MLP's norm; a parallel one keeps it
     * in `attention_out` and adds it with the MLP's at the next layer's norm. */
    int sequential = residual == RESIDUAL_SEQUENTIAL;
    const float *parallel_out = sequential ? NULL : attention_out;
    /* One team for the whole pass: the products, the attention, the activation, the norms (with
     * the residual adds) and the rotations share their loops among its threads. */
#pragma omp parallel num_threads(kernel_thread_count)
    {
        for (int64_t l = 0; l < n_layers; l++) {
            const void *const *w = layers + l * LAYER_TENSORS;
            const int64_t *f = formats + l * 4; /* qkv, o_proj, up, down */
            /* The last layer's outputs join the residual here (none before the first layer). */
            residual_norm_rows(hidden, l > 0 ? projected : NULL, l > 0 ? parallel_out : NULL, w[ATTN_NORM],
                               w[ATTN_NORM_BIAS], normed, batch, d_model, eps, layer_norm);
            if (residual == RESIDUAL_PARALLEL_TWO_NORMS)
                residual_norm_rows(hidden, NULL, NULL, w[MLP_NORM], w[MLP_NORM_BIAS], mlp_normed, batch, d_model, eps,
                                   layer_norm);
            packed_linear_shared(normed, d_model, w[QKV], w[QKV_SCALES], (int)f[0], w[QKV_BIAS], qkv, batch,
                                 d_model, qkv_width, widened, quantized);
            place_heads(qkv, w[Q_NORM], w[K_NORM], rope_cos, rope_sin, batch, heads, kv_heads, head_dim, qkv_width,
                        rotary_dim, interleaved, eps);
            const float *keys = qkv + attended_width, *values = keys + kv_heads * head_dim;
            if (tiled) {
                chunk_attention_shared(qkv, keys, values, key_pages[l], value_pages[l], window_blocks, positions,
                                       attended, scores, qkv_width, qkv_width, qkv_width, batch, heads, kv_heads, head_dim,
                                       num_blocks, block_size, blocks_per_row, run_ends, runs, scale);
            } else {
                paged_attention_shared(qkv, keys, values, key_pages[l], value_pages[l], window_blocks, positions,
                                       bias, masked, sinks, sink_turn, rotary_dim, interleaved, attended, scores,
                                       qkv_width, qkv_width, qkv_width, batch, heads, kv_heads, head_dim, num_blocks,
                                       block_size, blocks_per_row, scale);
            }
            float *o_out = sequential ? projected : attention_out;
            packed_linear_shared(attended, attended_width, w[O_PROJ], w[O_SCALES], (int)f[1], w[O_BIAS], o_out, batch,
                                 attended_width, d_model, widened, quantized);
            const float *mlp_in = normed;
            if (sequential) {
                residual_norm_rows(hidden, projected, NULL, w[MLP_NORM], w[MLP_NORM_BIAS], mlp_normed, batch, d_model,
                                   eps, layer_norm);
                mlp_in = mlp_normed;
            } else if (residual == RESIDUAL_PARALLEL_TWO_NORMS) {
                mlp_in = mlp_normed;
            }
            packed_linear_shared(mlp_in, d_model, w[UP], w[UP_SCALES], (int)f[2], w[UP_BIAS], up, batch, d_model,
                                 up_width, widened, quantized);
            activation_rows(up, activated, batch, ffn, activation, gated);
            packed_linear_shared(activated, ffn, w[DOWN], w[DOWN_SCALES], (int)f[3], w[DOWN_BIAS], projected, batch,
                                 ffn, d_model, widened, quantized);
        }
        residual_norm_rows(hidden, n_layers > 0 ? projected : NULL, n_layers > 0 ? parallel_out : NULL, final_norm,
                           final_norm_bias, normed, batch, d_model, eps, layer_norm);
        packed_linear_shared(normed, d_model, lm_head, lm_head_scales, (int)formats[n_layers * 4], lm_head_bias,
                             logits, batch, d_model, vocab, widened, quantized);
    }
}
