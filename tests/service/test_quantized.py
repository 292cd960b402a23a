"""`--weights int8|int4`: packed linear layers, their error against float, and the served model.

Each format has a documented tolerance (docs/decode.md, "Weight formats"): a layer's output error
relative to the float layer's, and, in the engine, the guarantees every backend keeps (incremental
equals full, batched equals alone) within that format's own numerics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import httpx
import pytest
import torch
from torch import nn

from service.engine.engine import load_models
from service.engine.types import GenerationResult
from service.model.backend import Backend, BackendChoice, choose_backend
from service.model.quantized import (
    INT4_GROUP,
    WEIGHT_FORMATS,
    Int4Linear,
    Int8Linear,
    WeightsError,
    quantize_weights,
    quantized_activations,
    weights_of,
)
from service.settings import Weights
from tests.conftest import TinyCheckpointFactory, tiny_transformer
from tests.live_server import REPO_ROOT, live_server
from tests.service.api.conftest import BASE_OPTIONS, SERVER_ENV
from tests.service.test_engine_serving import engine_over, outcomes, request

# A layer's output error over the float layer's output norm, per format.
LAYER_TOLERANCE = {"int8": 0.02, "int4": 0.12}
PACKERS: dict[str, Callable[[nn.Linear], nn.Module]] = {
    "int8": Int8Linear.quantize,
    "int4": Int4Linear.quantize,
}
CLASSES: dict[str, type[nn.Module]] = {"int8": Int8Linear, "int4": Int4Linear}
FORMATS = ["int8", "int4"]
# Logprob agreement between two runs of one model (incremental against full, batched against
# alone). The C step's panels and the eager pass's widened matrix hold the same weights, and both
# multiply activations rounded the same way (`quantized_activations`), so only float sums differ.
RUN_TOLERANCE = {"int8": 1e-4, "int4": 1e-4}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def test_the_cli_choices_are_the_formats_the_model_packs() -> None:
    assert get_args(Weights) == WEIGHT_FORMATS


@pytest.mark.parametrize("weights", FORMATS)
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_matches_the_float_layer_within_its_tolerance(weights: str, bias: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(128, 96, bias=bias)
    with torch.no_grad():
        if bias:
            layer.bias.normal_()
        packed = PACKERS[weights](layer)
        inputs = torch.randn(3, 5, 128)
        assert relative_error(packed(inputs), layer(inputs)) <= LAYER_TOLERANCE[weights]
        assert packed(inputs).shape == (3, 5, 96)


def test_int8_rows_with_huge_activations_do_not_spoil_the_other_rows() -> None:
    """Real models have rows 100x the rest (a BOS token); activations are rounded per row and group
    of 32 inputs, so a row's rounding is its own whatever its neighbours."""
    torch.manual_seed(1)
    layer = nn.Linear(256, 64)
    packed = Int8Linear.quantize(layer)
    inputs = torch.randn(8, 256)
    inputs[0] *= 300.0
    with torch.no_grad():
        for row in range(8):
            expected = layer(inputs[row : row + 1])
            assert relative_error(packed(inputs)[row : row + 1], expected) <= LAYER_TOLERANCE["int8"]


@pytest.mark.parametrize("weights", FORMATS)
def test_every_block_projection_and_the_head_are_packed_and_the_rest_stays_float(weights: str) -> None:
    model = quantize_weights(tiny_transformer(d_model=64, ffn_hidden=128), weights)
    assert weights_of(model) == weights
    packed = {name for name, module in model.named_modules() if isinstance(module, CLASSES[weights])}
    per_layer = {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj"}
    if model.config.gated_mlp:
        per_layer.add("mlp.gate_proj")
    expected = {f"layers.{i}.{name}" for i in range(len(model.layers)) for name in per_layer} | {"lm_head"}
    assert packed == expected
    assert not any(isinstance(module, nn.Linear) for module in model.modules())
    assert isinstance(model.embed_tokens, nn.Embedding)  # the lookup keeps its float table


def test_float_leaves_the_model_as_it_was() -> None:
    model = tiny_transformer()
    assert quantize_weights(model, "float") is model
    assert weights_of(model) == "float"


def test_an_unknown_format_and_widths_off_the_int4_group_are_refused_by_name() -> None:
    with pytest.raises(WeightsError, match="one of float, int8, int4"):
        quantize_weights(tiny_transformer(), "int2")
    assert 48 % INT4_GROUP  # the tiny model's width is not a whole number of groups
    with pytest.raises(WeightsError, match=r"layers\.0\.attn\.q_proj has 48"):
        quantize_weights(tiny_transformer(d_model=48), "int4")


@pytest.mark.parametrize("weights", FORMATS)
def test_packed_weights_run_the_c_step_on_a_cpu_in_float32_and_eager_elsewhere(weights: str) -> None:
    model = tiny_transformer()
    cpu = torch.device("cpu")

    def choice(dtype: torch.dtype) -> BackendChoice:
        return choose_backend(
            model.config, device=cpu, dtype=dtype, threads=1, allow_compile=True, weights=weights
        )

    assert choice(torch.float32).backend is Backend.C and weights in choice(torch.float32).reason
    assert choice(torch.bfloat16).backend is Backend.EAGER and weights in choice(torch.bfloat16).reason


def test_an_int4_layer_keeps_two_codes_a_byte_and_widens_to_its_weight() -> None:
    """Groups of 32 inputs with a scale and a minimum (GGUF's Q4_1 block): each weight is within
    half a step of its group's grid, and the ends of each group's range are on it."""
    torch.manual_seed(3)
    layer = nn.Linear(64, 24)
    packed = Int4Linear.quantize(layer)
    assert packed.nibbles.shape == (24, 32) and packed.nibbles.dtype == torch.uint8
    assert packed.scales.shape == packed.minimums.shape == (24, 2)
    codes = packed.codes()
    assert codes.shape == (24, 64) and int(codes.max()) == 15 and int(codes.min()) == 0
    steps = packed.scales.repeat_interleave(32, dim=1)
    assert ((packed.dequantized() - layer.weight).abs() <= steps / 2 + 1e-6).all()
    assert torch.equal(Int4Linear(codes, packed.scales, packed.minimums, None).nibbles, packed.nibbles)


def test_an_int8_layer_widens_to_the_weight_its_codes_stand_for() -> None:
    """Groups of 32 inputs on a CPU (GGUF's Q8_0 block), the last one short when K is not a
    multiple: each weight is within half a step of its group's scale. The layer multiplies the
    activations as rounded per group of 32 (`quantized_activations`)."""
    torch.manual_seed(2)
    layer = nn.Linear(70, 40)
    packed = Int8Linear.quantize(layer)
    assert packed.codes.shape == (40, 70) and packed.scales.shape == (40, 3)
    steps = packed.scales.repeat_interleave(32, dim=1)[:, :70]
    assert ((packed.dequantized() - layer.weight).abs() <= steps / 2 + 1e-7).all()
    inputs = torch.randn(5, 70)
    with torch.no_grad():
        expected = nn.functional.linear(quantized_activations(inputs), packed.dequantized(), layer.bias)
        torch.testing.assert_close(packed(inputs), expected)


@pytest.fixture(scope="module")
def wide_dir(make_tiny_checkpoint: TinyCheckpointFactory) -> Path:
    """Widths that are whole int4 groups, under the serving tests' name and native context."""
    return make_tiny_checkpoint(
        "rope", name="tiny-rope-serving", native_context=16, d_model=64, ffn_hidden=128, n_heads=4
    )


@pytest.mark.parametrize("weights", FORMATS)
def test_packed_models_decode_incrementally_as_one_full_pass_does(wide_dir: Path, weights: str) -> None:
    """The engine's cached, chunked decode against one uncached forward over the whole sequence."""
    [served] = load_models([wide_dir], device="cpu", dtype="float32", weights=weights)
    prompt = tuple((11 * i + 5) % 256 for i in range(30))
    with engine_over([served], step_token_budget=8) as engine:
        [result] = outcomes(engine, [request(0, prompt, new_tokens=12)])
    assert isinstance(result, GenerationResult) and result.logprobs is not None
    sequence = torch.tensor([prompt + result.tokens])
    with torch.no_grad():
        logits = served.model(sequence)[0, len(prompt) - 1 : -1].float()
    full = torch.log_softmax(logits, dim=-1)
    assert full.argmax(dim=-1).tolist() == list(result.tokens)
    picked = full.gather(1, torch.tensor(result.tokens)[:, None])[:, 0]
    differences = [abs(a - b) for a, b in zip(picked.tolist(), result.logprobs, strict=True)]
    assert max(differences) <= RUN_TOLERANCE[weights]


@pytest.mark.parametrize("weights", FORMATS)
def test_packed_models_give_each_batched_row_what_it_gets_alone(wide_dir: Path, weights: str) -> None:
    """Weight-only int8 leaves activations float, so a row never depends on its batch."""
    models = load_models([wide_dir], device="cpu", dtype="float32", weights=weights)
    prompts = [tuple((7 * i + n) % 256 for i in range(n)) for n in (3, 9, 21, 40)]
    requests = [request(i, prompt, new_tokens=10) for i, prompt in enumerate(prompts)]
    with engine_over(models, max_batch_size=8) as engine:
        together = outcomes(engine, requests)
        alone = [outcomes(engine, [item])[0] for item in requests]
    for first, second in zip(together, alone, strict=True):
        assert isinstance(first, GenerationResult) and isinstance(second, GenerationResult)
        assert first.tokens == second.tokens
        assert first.logprobs is not None and second.logprobs is not None
        differences = [abs(a - b) for a, b in zip(first.logprobs, second.logprobs, strict=True)]
        assert max(differences) <= RUN_TOLERANCE[weights]


def test_the_served_card_reports_the_weights_and_a_bad_format_fails_the_start(
    wide_dir: Path, make_tiny_checkpoint: TinyCheckpointFactory
) -> None:
    with live_server([wide_dir], options={**BASE_OPTIONS, "weights": "int8"}) as server:
        [card] = httpx.get(server.url("/models")).json()["models"]
        generated = httpx.post(
            server.url("/generate"), json={"prompt": "abc", "max_new_tokens": 4, "temperature": 0}
        )
    assert (card["weights"], card["backend"]) == ("int8", "c")
    assert generated.status_code == 200, generated.text
    narrow = make_tiny_checkpoint("rope", name="tiny-narrow", d_model=48)  # 1.5 int4 groups wide
    command = [sys.executable, "-m", "service", "--port", "0", "--grpc-port", "0", "--weights", "int4"]
    finished = subprocess.run(
        [*command, "--model-dir", str(narrow)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **SERVER_ENV},
    )
    assert finished.returncode == 1, finished.stderr
    lines = [json.loads(line) for line in finished.stderr.splitlines() if line.startswith("{")]
    [error] = [line for line in lines if line["level"] == "error"]
    assert str(narrow) in error["message"] and "layers.0.attn.q_proj has 48" in error["message"]
