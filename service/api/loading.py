"""Which checkpoint directories to serve, and the engine built from them.

The engine (and torch with it) is imported only when a server actually loads models, so the
HTTP layer's modules, and tools that just read the OpenAPI schema, stay light.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from service.engine.types import Engine
from service.logs import logging_config
from service.settings import Settings

ZOO_DIR = Path(__file__).resolve().parents[2] / "models"
# Load order decides the default model and which model `pe` picks first; RoPE leads because it is
# the scheme whose per-request scaling this service exists for.
_ZOO_ORDER = (
    "rope",
    "alibi",
    "t5_bias",
    "nope",
    "sinusoidal",
    "learned",
    "shaw",
    "transformer_xl",
    "cope",
    "rope_alibi",
)


def bundled_zoo(zoo_dir: Path = ZOO_DIR) -> list[Path]:
    """The zoo checkpoints shipped under `models/`, RoPE first; empty if none are there yet."""
    found = [path for path in zoo_dir.glob("zoo-*") if (path / "config.json").is_file()]

    def rank(path: Path) -> tuple[int, str]:
        scheme = path.name.removeprefix("zoo-")
        return (_ZOO_ORDER.index(scheme) if scheme in _ZOO_ORDER else len(_ZOO_ORDER), path.name)

    return sorted(found, key=rank)


def model_dirs(settings: Settings) -> list[Path]:
    """`--model-dir` as given, else the bundled zoo; an error if that leaves nothing to serve."""
    dirs = list(settings.model_dir) or bundled_zoo()
    if not dirs:
        raise FileNotFoundError(
            f"no models to serve: pass --model-dir, or add zoo checkpoints under {ZOO_DIR}"
        )
    return dirs


def load_engine(settings: Settings) -> Engine:
    """The engine process and its client (the default), or the engine on a thread of this process.

    In process mode this process keeps one torch thread (it only validates requests); the engine
    process takes `torch_threads`, by default every core, for the model.
    """
    config_module = importlib.import_module("service.engine.config")
    config = config_module.EngineConfig(
        model_dirs=tuple(model_dirs(settings)),
        device=settings.device,
        dtype=settings.dtype,
        weights=settings.weights,
        max_context=settings.max_context,
        max_stream_tokens=settings.max_stream_tokens,
        max_batch_size=settings.max_batch_size,
        step_token_budget=settings.step_token_budget,
        prefill_slowdown=settings.prefill_slowdown,
        torch_threads=settings.torch_threads,
        decode=importlib.import_module("service.engine.core").DecodeSettings(
            kv_cache_bytes=None if settings.kv_cache_mb is None else settings.kv_cache_mb << 20,
            compile=settings.compile,
            prefix_cache=settings.prefix_cache,
            compile_max_window=settings.compile_max_window,
        ),
        log_config=logging_config(settings.log_level),
    )
    if settings.engine_mode == "thread":
        engine_module = importlib.import_module("service.engine.engine")
        engine: Engine = engine_module.InferenceEngine.from_config(config, max_queue=settings.max_queue)
        return engine
    importlib.import_module("torch").set_num_threads(1)
    client: Engine = importlib.import_module("service.engine.client").EngineClient(
        config, max_queue=settings.max_queue
    )
    return client
