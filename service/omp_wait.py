"""How long an OpenMP worker spins at a barrier before it sleeps: bounded, and set before torch
loads the runtime.

libgomp, the OpenMP runtime torch and the C kernels share, has a worker that reaches a barrier
early spin for `GOMP_SPINCOUNT` rounds before it sleeps on a futex: 300,000 by default, each a
`pause` instruction. On cores of its own that spin is cheap and keeps a step's
barriers fast. Beside any other busy process (a second server, the benchmark's client, a test run,
the API process streaming to 16 clients) it is ruinous: the spinning workers hold the time slices
the late worker needs to reach the barrier. On two cores shared with another engine, the zoo's
one-pass sweep (four 4096-token `/score`) took 13.4 s a pass with libgomp's default against
1.8 s with 10,000 rounds (0.8 s on a quiet machine; `bench/results/shared_cores.md`).

`GOMP_SPINCOUNT` is read once, when libgomp loads (`import torch`), so this runs as the
`service` package is imported: the engine process, which imports it before torch, and every
server started as `pe-serve` or `python -m service` get it. A process that imported torch first
(an embedding application, Ray's worker) keeps what its environment said. A user's own
`GOMP_SPINCOUNT` or `OMP_WAIT_POLICY` wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_ROUNDS = 10_000
_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def bound_spin_wait(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set `GOMP_SPINCOUNT` to `SPIN_ROUNDS` unless the environment already chose a wait policy."""
    if not any(name in environ for name in _VARIABLES):
        environ["GOMP_SPINCOUNT"] = str(SPIN_ROUNDS)
