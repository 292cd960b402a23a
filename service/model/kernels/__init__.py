"""Hand-written kernels the decode step calls where the compiler's own code is slow."""
