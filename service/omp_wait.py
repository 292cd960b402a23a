"""How long an OpenMP worker spins at a barrier before it sleeps: bounded, and set before torch
loads the runtime.

libgomp, the OpenMP runtime torch and the C kernels share, has a worker that reaches a barrier
early spin for `GOMP_SPINCOUNT` rounds before it sleeps on a futex: 300,000 by default, each a
`pause` instruction. On cores of its own that spin keeps a step's barriers fast. Beside any other
busy process (a second server, a client, a test run) the spinning workers hold the time slices the
late worker needs to reach the barrier. On two cores (`bench/results/shared_cores.md`), one pass
of the zoo's sweep (four 4096-token `/score`) took 0.78 s alone, 3.93 s beside a busy Python loop
with libgomp's default and 1.69 s with 10,000 rounds; beside a long SmolLM2 prefill in another
server, 13.4 s against 1.8 s (a probe). Alone, 10,000 rounds cost nothing measurable (SmolLM2
decodes 56.7 tokens/s for one client against 52.1, 268 for 16 against 267). Workers that never
spin (`OMP_WAIT_POLICY=PASSIVE`) did better still beside a neighbour (1.36 s) and as well alone on
two cores; a bound rather than none keeps a many-core team's short waits off the futex.

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
WAIT_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # either one is a policy the user chose


def bound_spin_wait(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set `GOMP_SPINCOUNT` to `SPIN_ROUNDS` unless the environment already chose a wait policy."""
    if not any(name in environ for name in WAIT_VARIABLES):
        environ["GOMP_SPINCOUNT"] = str(SPIN_ROUNDS)
