"""Hand-written kernels the decode pass calls where the compiler's own code is slow."""
