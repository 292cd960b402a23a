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
    max_batch_size: int = 16
    step_token_budget: int = DEFAULT_STEP_TOKEN_BUDGET
    prefill_slowdown: float = DEFAULT_PREFILL_SLOWDOWN
    torch_threads: int = 0  # 0: `engine_threads()` in an engine process, torch's default on a thread
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    log_config: dict[str, Any] | None = field(default=None, compare=False)  # for an engine process


def engine_threads() -> int:
    """Every core but one, which the HTTP process keeps for parsing, validation and streaming.

    On a two-core host that is one engine thread: for the zoo's small matrices a second thread
    gains less than an HTTP process starved of its core loses.
    """
    return max(1, (os.cpu_count() or 1) - 1)
