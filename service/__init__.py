"""pe-serve: a transformer inference service whose positional encoding is chosen per request."""

from service.omp_wait import bound_spin_wait

bound_spin_wait()  # before anything imports torch (`service.omp_wait` says why)
