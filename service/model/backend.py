"""Which body of layer math runs a model's steps: chosen once per model, in one function.

Four backends produce served logits:

- `eager`: `Transformer.forward` over the block pool. Every model, scheme and window; the others
  hand it what they do not cover (prompt chunks off the C path, windows past their largest bucket,
  a row rerun alone after a failed pass).
- `compiled`: `fast_decode.decode_one_token` (the model's own layers over the pool) under
  Inductor, one entry per window bucket.
- `cuda_graphs`: that compiled step captured as CUDA graphs, one per window and batch bucket.
- `c`: the whole step, and prompt chunks, as one C call (`kernels/batch_pass.c`).

`choose_backend` decides from the device, the dtype, torch's intra-op threads and whether a
compiler is there, and says why; the engine logs the choice at start-up and reports it per model
(`ModelInfo.backend`, `/models`, the `pe_serve_step_backend` gauge), so that what runs is never a
guess. The C step runs wherever it applies; `--compile` (`allow_compile`) opens the backends
that cost start-up time (Inductor, CUDA graphs).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from enum import StrEnum

import torch

from service.model.config import ModelConfig
from service.model.kernels import batch_pass
from service.model.spec import C_SUPPORT, TORCH_STEP_SUPPORT, BlockSpec


class Backend(StrEnum):
    """The SPEC's names for the decode path a model uses."""

    EAGER = "eager"
    COMPILED = "compiled"
    CUDA_GRAPHS = "cuda_graphs"
    C = "c"


@dataclass(frozen=True)
class BackendChoice:
    backend: Backend
    reason: str  # what decided it, for the start-up log


def choose_backend(
    config: ModelConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    threads: int,
    allow_compile: bool,
    weights: str = "float",
) -> BackendChoice:
    """The backend for a model on `device` in `dtype`, with torch on `threads` intra-op threads.

    The C step needs no flag: it is built with the host's C compiler in about a second (cached
    after). Through the server on two cores, SmolLM2 decoded 13.5 tok/s at one client and 105 at
    16 on the eager pass, and 59 and 377 on the C step (bench/results/real_model.md, two runs of
    this day). It runs float32 on a CPU, with float, int8 or int4 weights, on `threads` OpenMP
    threads. Everything that costs minutes at start-up (Inductor, CUDA graph capture) waits for
    `--compile`. Inductor on a
    CPU compiles C++, so without a compiler the model stays eager rather than failing at warm-up.
    """
    spec = BlockSpec.of(config)
    if device.type == "cpu" and dtype == torch.float32 and batch_pass.available():
        refused = C_SUPPORT.refuses(spec)
        if refused is not None:
            return BackendChoice(Backend.EAGER, refused)
        return BackendChoice(Backend.C, f"{weights} weights on a CPU: a C call per pass, {threads} threads")
    refused = TORCH_STEP_SUPPORT.refuses(spec)
    if refused is not None:
        return BackendChoice(Backend.EAGER, refused)
    if weights != "float":
        # The torch step reads float matrices; packed layers widen theirs in the eager pass.
        return BackendChoice(Backend.EAGER, f"{weights} weights off the C step run in the eager pass")
    if not allow_compile:
        if device.type == "cpu" and dtype != torch.float32:
            return BackendChoice(Backend.EAGER, f"the C step runs float32 only; --compile is off for {dtype}")
        return BackendChoice(Backend.EAGER, "--compile is off")
    if device.type == "cuda":
        return BackendChoice(Backend.CUDA_GRAPHS, "a CUDA device: the compiled step, captured")
    if device.type == "cpu" and not cxx_compiler():
        return BackendChoice(Backend.EAGER, "no C++ compiler for Inductor on this machine")
    return BackendChoice(Backend.COMPILED, f"{dtype} on {device.type} with {threads} torch threads")


def cxx_compiler() -> str | None:
    """The C++ compiler Inductor would call ($CXX, else the usual names), or None."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((path for name in names if (path := shutil.which(name))), None)
