"""Which backend runs a model's steps: the one function that decides, and the engine that reports
its choice and falls back to eager when a fast backend cannot start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from service.engine.client import EngineClient
from service.engine.config import EngineConfig
from service.engine.core import DecodeSettings
from service.engine.types import GenerationRequest, GenerationResult, SamplingParams
from service.model.backend import Backend, choose_backend, cxx_compiler
from service.model.config import ModelConfig
from service.model.kernels import batch_pass
from tests.conftest import TinyCheckpointFactory, tiny_transformer
from tests.kernels import require_kernel

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def config(**overrides: Any) -> ModelConfig:
    return tiny_transformer(native_context=16, **overrides).config


def chosen(
    model: ModelConfig,
    *,
    device: torch.device = CPU,
    dtype: torch.dtype = torch.float32,
    threads: int = 1,
    allow_compile: bool = True,
) -> Backend:
    choice = choose_backend(model, device=device, dtype=dtype, threads=threads, allow_compile=allow_compile)
    return choice.backend


def test_without_compile_float32_on_a_cpu_runs_in_c_and_the_rest_is_eager() -> None:
    """The C step starts in about a second, so it needs no flag; what costs minutes waits for one."""
    require_kernel(batch_pass.available, "batch step")
    assert chosen(config(), allow_compile=False) is Backend.C
    assert chosen(config(), threads=2, allow_compile=False) is Backend.C
    float64 = choose_backend(config(), device=CPU, dtype=torch.float64, threads=1, allow_compile=False)
    assert float64.backend is Backend.EAGER and "float32 only" in float64.reason
    assert chosen(config(), device=CUDA, dtype=torch.bfloat16, allow_compile=False) is Backend.EAGER


@pytest.mark.parametrize("scheme", ["shaw", "cope", "transformer_xl"])
def test_schemes_the_fast_step_cannot_run_stay_eager_and_say_why(scheme: str) -> None:
    choice = choose_backend(config(pe=scheme), device=CPU, dtype=torch.float32, threads=1, allow_compile=True)
    assert choice.backend is Backend.EAGER and scheme in choice.reason


def test_a_cuda_device_replays_graphs() -> None:
    assert chosen(config(), device=CUDA, dtype=torch.bfloat16, threads=8) is Backend.CUDA_GRAPHS


def test_float32_runs_in_c_on_any_threads_and_other_dtypes_compile() -> None:
    require_kernel(batch_pass.available, "batch step")
    assert chosen(config()) is Backend.C
    assert chosen(config(), threads=2) is Backend.C
    if cxx_compiler() is None:
        pytest.skip("no C++ compiler for Inductor here")
    assert chosen(config(), dtype=torch.float64) is Backend.COMPILED


def test_without_a_cxx_compiler_the_torch_step_stays_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    choice = choose_backend(config(), device=CPU, dtype=torch.float64, threads=2, allow_compile=True)
    assert choice.backend is Backend.EAGER and "C++ compiler" in choice.reason


def test_a_compiler_that_fails_at_warm_up_leaves_the_engine_serving_eager(
    make_tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor (float64: float32 would run in C) finds a C++ compiler that cannot build: the engine
    process starts anyway, reports
    `eager` for the model, and generates (the failure once killed it with "exited while loading")."""
    broken = tmp_path / "c++"
    broken.write_text("#!/bin/sh\necho 'cannot compile' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing cached to reuse
    directory = make_tiny_checkpoint("rope", name="tiny-rope-backend", native_context=16)
    settings = DecodeSettings(compile=True, compile_max_window=64)
    engine_config = EngineConfig(
        model_dirs=(directory,), device="cpu", dtype="float64", torch_threads=2, decode=settings
    )
    client = EngineClient(engine_config, max_queue=0)
    try:
        assert [info.backend for info in client.models()] == ["eager"]
        request = GenerationRequest("r", "tiny-rope-backend", (256, 1, 2), SamplingParams(max_new_tokens=4))
        result = list(client.submit(request))[-1]
        assert isinstance(result, GenerationResult) and len(result.tokens) == 4
    finally:
        client.shutdown()
