"""The block description (`service.model.spec`): every config field accounted for, backends as
allow-lists, and the C pass running every block the config expresses as the eager model does."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from service.model.backend import Backend
from service.model.config import ModelConfig
from service.model.fast_decode import FastDecoder
from service.model.kernels import batch_pass
from service.model.quantized import quantize_weights
from service.model.spec import C_SUPPORT, NEUTRAL_FIELDS, TORCH_STEP_SUPPORT, BlockSpec, Support
from service.model.transformer import Transformer
from tests.conftest import TINY_CONFIG, tiny_transformer
from tests.kernels import require_kernel, torch_threads
from tests.service.test_fast_decode import LINEAR, NONE, TOLERANCE, WIDE_HEAD, decode_and_compare, pool_for

# Blocks of the families beyond Llama's, on the schemes their families use.
BLOCK_CASES: dict[str, dict[str, Any]] = {
    "neox-parallel-two-norms": {
        "norm": "layer",
        "gated_mlp": False,
        "activation": "gelu",
        "qkv_bias": True,
        "attn_out_bias": True,
        "mlp_bias": True,
        "residual": "parallel_two_norms",
        "rotary_fraction": 0.5,
    },
    "gptj-parallel-interleaved": {
        "norm": "layer",
        "gated_mlp": False,
        "activation": "gelu_tanh",
        "mlp_bias": True,
        "lm_head_bias": True,
        "residual": "parallel",
        "rope_layout": "gptj",
        "rotary_fraction": 0.25,
    },
    "gpt2-learned": {
        "pe": "learned",
        "native_context": 128,
        "norm": "layer",
        "gated_mlp": False,
        "activation": "gelu_tanh",
        "qkv_bias": True,
        "attn_out_bias": True,
        "mlp_bias": True,
    },
    "bloom-alibi-embedding-norm": {
        "pe": "alibi",
        "norm": "layer",
        "gated_mlp": False,
        "activation": "gelu_tanh",
        "qkv_bias": True,
        "attn_out_bias": True,
        "mlp_bias": True,
        "embedding_norm": True,
    },
    "mpt-alibi-no-norm-bias": {
        "pe": "alibi",
        "norm": "layer",
        "norm_bias": False,
        "gated_mlp": False,
        "activation": "gelu",
    },
    "qwen3-qk-norm": {"qk_norm": True},
    "stablelm-layer-norm-gated": {"norm": "layer", "qkv_bias": True},
}


def test_every_config_field_is_read_by_the_block_or_neutral() -> None:
    fields = {field.name for field in dataclasses.fields(ModelConfig)}
    read, neutral = BlockSpec.config_fields(), set(NEUTRAL_FIELDS)
    assert not read & neutral, f"both read and neutral: {sorted(read & neutral)}"
    assert fields == read | neutral, (
        f"neither read by BlockSpec.of nor neutral: {sorted(fields - read - neutral)}; "
        f"not config fields: {sorted((read | neutral) - fields)}"
    )


def test_every_backend_declares_every_feature() -> None:
    features = {field.name for field in dataclasses.fields(BlockSpec)}
    for support in (C_SUPPORT, TORCH_STEP_SUPPORT):
        assert set(support.allowed) == features, support.backend


def test_a_feature_a_backend_does_not_declare_is_refused() -> None:
    spec = BlockSpec.of(ModelConfig())
    undeclared = Support(
        "partial", {name: value for name, value in C_SUPPORT.allowed.items() if name != "qk_norm"}
    )
    reason = undeclared.refuses(spec)
    assert reason is not None and "qk_norm" in reason
    assert C_SUPPORT.refuses(spec) is None


@pytest.mark.parametrize("support", [C_SUPPORT, TORCH_STEP_SUPPORT], ids=lambda support: support.backend)
def test_the_fast_backends_run_every_block_but_name_the_relative_schemes(support: Support) -> None:
    for overrides in BLOCK_CASES.values():
        assert support.refuses(BlockSpec.of(ModelConfig.from_dict(TINY_CONFIG | overrides))) is None
    reason = support.refuses(BlockSpec.of(ModelConfig(pe="shaw")))
    assert reason is not None and "pe='shaw'" in reason


def perturbed(model: Transformer) -> Transformer:
    """Every norm weight and bias moved off its initial one or zero, so a misread one shows."""
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    return model


@pytest.mark.parametrize("path", ["torch", "c", "c-2-threads"])
@pytest.mark.parametrize("overrides", list(BLOCK_CASES.values()), ids=list(BLOCK_CASES))
def test_the_fast_steps_run_every_block_as_the_eager_model(overrides: dict[str, Any], path: str) -> None:
    """The torch step (the model's own layers over the pool) and the C pass, on one and two threads."""
    if path.startswith("c"):
        require_kernel(batch_pass.available, "batch step")
    overrides = dict(overrides)
    native = overrides.pop("native_context", 16)
    model = perturbed(tiny_transformer(native_context=native, head_dim_override=WIDE_HEAD, **overrides))
    backend = Backend.COMPILED if path == "torch" else Backend.C
    decoder = FastDecoder(model, pool_for(model), backend, max_window=128, inductor=False)
    threads = 2 if path == "c-2-threads" else 1
    scalings = [NONE, LINEAR] if model.config.pe in ("rope", "learned") else [NONE]
    with torch_threads(threads):
        assert decode_and_compare(model, decoder, scalings) < TOLERANCE


# Both passes round each activation to int8 before its product, so a float sum that differs in its
# last bit before the rounding (our norms against torch's, whose vector width follows the CPU) can
# move one code by a step: qwen3-qk-norm in int4 then differed by 1.3e-3 on one Xeon of this kind
# where the other cases agree to 2e-7. The eager pass alone moves as much: its embeddings scaled
# by 1 + 2e-7 noise, 19 of 60 draws moved qwen3-qk-norm int4 by more than 1e-4 (at most 1.1e-3),
# 14 of 60 moved neox-parallel-two-norms by up to 2.6e-3. Reading the codes wrongly is far larger:
# the same C pass against the eager model packed as int8 instead of int4 differs by 5e-2 to 8e-2.
PACKED_TOLERANCE = 1e-2


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("case", ["neox-parallel-two-norms", "gpt2-learned", "qwen3-qk-norm"])
def test_the_c_step_runs_packed_blocks_as_the_eager_model(case: str, weights: str) -> None:
    """Packed projections with their biases: the C pass reads the codes, the eager pass the
    layers' own widened weights, over activations rounded alike."""
    require_kernel(batch_pass.available, "batch step")
    overrides = dict(BLOCK_CASES[case])
    native = overrides.pop("native_context", 16)
    widths = {"d_model": 64, "ffn_hidden": 128, "n_heads": 4, "n_kv_heads": 2}
    model = perturbed(tiny_transformer(native_context=native, **widths, **overrides))
    model = quantize_weights(model, weights)
    decoder = FastDecoder(model, pool_for(model), Backend.C, max_window=128, inductor=False)
    assert decode_and_compare(model, decoder, [NONE]) < PACKED_TOLERANCE
