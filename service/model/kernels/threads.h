/*
 * How many OpenMP threads the kernels' parallel loops use: the caller's torch intra-op thread
 * count, set before each call (`kernel_threads`), so a kernel follows `--torch-threads` as the
 * torch ops beside it do rather than OpenMP's own default.
 */
#ifndef PE_SERVE_THREADS_H
#define PE_SERVE_THREADS_H

#include <stdint.h>

static int kernel_thread_count = 1;

void kernel_threads(int64_t threads) { kernel_thread_count = threads > 0 ? (int)threads : 1; }

#endif
