"""`EngineConfig`: what an engine is built from, wherever it runs; picklable, so the engine process
is started with it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.engine.budget import DEFAULT_PREFILL_SLOWDOWN, DEFAULT_STEP_TOKEN_BUDGET
from service.engine.core import DecodeSettings


@dataclass(frozen=True)
class EngineConfig:
    model_dirs: tuple[Path, ...]
    device: str = "auto"
    dtype: str | None = None
    weights: str = "float"  # `service.settings.Weights`
    max_context: int = 4096
    max_stream_tokens: int = 65536
    max_batch_size: int = 16
    step_token_budget: int = DEFAULT_STEP_TOKEN_BUDGET
    prefill_slowdown: float = DEFAULT_PREFILL_SLOWDOWN
    torch_threads: int = 0  # 0: `engine_threads()` in an engine process, torch's default on a thread
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    log_config: dict[str, Any] | None = field(default=None, compare=False)  # for an engine process


def engine_threads() -> int:
    """Every core: the engine's matrices are where the time goes.

    The API process only parses, validates and streams (about 1% of the CPU time of 16 clients on
    SmolLM2, bench/results/real_model.md), so keeping a core for it left a core idle: on two
    cores, SmolLM2 decoded 16 clients at 228 tok/s with one engine thread and 377 with two, and
    read a 3.3k-token prompt in 17.4 s against 9.3 s (that file, one run).
    """
    return max(1, os.cpu_count() or 1)
