"""The OpenMP runtime that torch and the C kernels share, and the one thing done to it directly.

Each thread that runs parallel work keeps a pool of OpenMP worker threads alive after it. When a
process holds more of them than it has cores, libgomp cuts the spin-wait at its barriers to a few
hundred cycles, and a worker that arrives early sleeps on a futex instead, to be woken at the
next barrier: a SmolLM2 C step of one row took 20-21 ms with a second, idle pool alive in the
process, against 14 ms without it (a /tmp probe). An engine on a thread of its own meets exactly
that case: the models are loaded and warmed up on the thread that builds the engine, and stepped
on the engine's.
"""

from __future__ import annotations

import ctypes
import os

# Runtimes torch may have loaded: GNU (Linux wheels), LLVM (macOS), Intel.
_RUNTIMES = ("libgomp.so.1", "libomp.so", "libomp.dylib", "libiomp5.so")
_PAUSE_SOFT = 1  # omp_pause_soft


def release_thread_pool() -> bool:
    """Let the calling thread's idle OpenMP workers go (`omp_pause_resource_all(omp_pause_soft)`);
    a later parallel region on this thread starts a pool again. False where no loaded runtime
    offers it (nothing is loaded for the asking)."""
    for name in _RUNTIMES:
        try:
            runtime = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        pause = getattr(runtime, "omp_pause_resource_all", None)
        if pause is not None:
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return bool(pause(_PAUSE_SOFT) == 0)
    return False
