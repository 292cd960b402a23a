/*
 * What sampling reads of a step's logits [rows, vocab], in one call: whether each row is all
 * finite, its largest logit's first index, and its log-sum-exp. As torch reductions over the
 * batch (amax and amin for the check, max with indices, logsumexp) they took 1.3-1.5 ms of a
 * 16-row SmolLM2 step (a vocabulary of 49,152) on two cores.
 *
 * Rows are shared among `kernel_threads` threads. A row is read three times: its maximum and
 * whether any entry is NaN or infinite (x - x is then NaN, not 0), the first index holding that
 * maximum, and the sum of exp(x - maximum), while it sits in the core's cache. A row that is not
 * all finite gets finite = 0 and nothing else.
 */
#include <math.h>
#include <stdint.h>

#include "exp.h"
#include "threads.h"

void logit_rows(const float *logits, int64_t rows, int64_t vocab, int64_t *finite, int64_t *argmaxes,
                float *log_sums) {
#pragma omp parallel for schedule(static) num_threads(kernel_thread_count)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * vocab;
        float best = -INFINITY;
        int bad = 0;
#pragma omp simd reduction(max : best) reduction(| : bad)
        for (int64_t v = 0; v < vocab; v++) {
            best = row[v] > best ? row[v] : best;
            bad |= row[v] - row[v] != 0.0f;
        }
        finite[r] = !bad;
        argmaxes[r] = 0;
        log_sums[r] = NAN;
        if (bad) continue;
        int64_t first = 0;
        while (row[first] != best) first++;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t v = 0; v < vocab; v++) sum += exp_nonpositive(row[v] - best);
        argmaxes[r] = first;
        log_sums[r] = best + logf(sum);
    }
}
