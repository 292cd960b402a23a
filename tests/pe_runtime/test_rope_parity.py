"""Parity of every scaling type with transformers' ROPE_INIT_FUNCTIONS over a grid of configs.

Each case goes through `RopeScaling.from_hf` with the same dict transformers reads, so the defaults
are checked along with the formulas.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

from pe_runtime import RopeScaling, rope_inv_freq
from tests.pe_runtime.hf_oracle import hf_inv_freq, phi3_longrope_inv_freq

HEAD_DIMS = (16, 32, 64, 128)
BASES = (10000.0, 500000.0, 1000000.0)
FACTORS = (1.0, 2.0, 4.0, 8.0, 32.0)
ORIGINAL_LENGTHS = (256, 2048, 8192)


def _lengths_around(original: int) -> tuple[int | None, ...]:
    return (None, original // 2, original, original + 1, 4 * original)


def _assert_parity(
    head_dim: int,
    base: float,
    params: Mapping[str, Any],
    max_position_embeddings: int,
    seq_len: int | None = None,
) -> None:
    expected, expected_factor = hf_inv_freq(head_dim, base, dict(params), max_position_embeddings, seq_len)
    scaling = RopeScaling.from_hf(params, max_position_embeddings=max_position_embeddings)
    actual, actual_factor = rope_inv_freq(head_dim, base, scaling, seq_len)
    assert actual.dtype == torch.float32 and actual.shape == (head_dim // 2,)
    relative = ((actual - expected).abs() / expected.abs()).max().item()
    assert relative <= 1e-6, (params, seq_len, relative)
    assert actual_factor == pytest.approx(expected_factor, abs=1e-6), (params, seq_len)


def _yarn_cases() -> Iterator[dict[str, Any]]:
    attention_variants: tuple[dict[str, Any], ...] = (
        {},
        {"mscale": 1.0, "mscale_all_dim": 1.0},
        {"mscale": 0.707, "mscale_all_dim": 1.0},
        {"mscale": 1.0, "mscale_all_dim": 0.0},
        {"attention_factor": 1.25},
    )
    beta_variants: tuple[dict[str, Any], ...] = ({}, {"beta_fast": 16.0, "beta_slow": 2.0}, {"beta_fast": 64})
    for factor, original, betas, attention, truncate in itertools.product(
        FACTORS, (256, 4096), beta_variants, attention_variants, (None, True, False)
    ):
        case = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        case |= betas | attention | ({} if truncate is None else {"truncate": truncate})
        yield case


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_none_matches_llama_default(head_dim: int) -> None:
    for base in BASES:
        _assert_parity(head_dim, base, {"rope_type": "default"}, 2048)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_linear(head_dim: int) -> None:
    for base, factor in itertools.product(BASES, FACTORS):
        _assert_parity(head_dim, base, {"rope_type": "linear", "factor": factor}, 2048)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_dynamic_below_and_above_the_original_length(head_dim: int) -> None:
    for base, factor, original in itertools.product(BASES, FACTORS, ORIGINAL_LENGTHS):
        for seq_len in _lengths_around(original):
            _assert_parity(head_dim, base, {"rope_type": "dynamic", "factor": factor}, original, seq_len)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_ntk_is_dynamic_frozen_at_factor_times_the_original_length(head_dim: int) -> None:
    """transformers has no static NTK: its dynamic rule with factor 1 at seq_len = factor * original
    changes the base by exactly factor^(d/(d-2)), which is our ntk."""
    original = 2048
    for base, factor in itertools.product(BASES, FACTORS):
        expected, _ = hf_inv_freq(
            head_dim, base, {"rope_type": "dynamic", "factor": 1.0}, original, int(factor * original)
        )
        actual, attention_factor = rope_inv_freq(head_dim, base, RopeScaling(type="ntk", factor=factor))
        closed_form = 1.0 / (base * factor ** (head_dim / (head_dim - 2))) ** (
            torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        )
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(actual.double(), closed_form, rtol=1e-6, atol=0)
        assert attention_factor == 1.0


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_yarn(head_dim: int) -> None:
    for base in BASES[:2]:
        for case in _yarn_cases():
            _assert_parity(head_dim, base, case, 4 * case["original_max_position_embeddings"])


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_yarn_factor_derived_from_lengths(head_dim: int) -> None:
    for original, max_length in ((256, 4096), (2048, 2048), (4096, 163840)):
        case = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": original}
        _assert_parity(head_dim, 10000.0, case, max_length)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_llama3(head_dim: int) -> None:
    frequency_bands = ((1.0, 4.0), (0.5, 2.0), (2.0, 8.0))
    for base, factor, original, (low, high) in itertools.product(
        BASES, FACTORS, ORIGINAL_LENGTHS, frequency_bands
    ):
        case = {
            "rope_type": "llama3",
            "factor": factor,
            "original_max_position_embeddings": original,
            "low_freq_factor": low,
            "high_freq_factor": high,
        }
        _assert_parity(head_dim, base, case, 4 * original)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_longrope_short_and_long_factors(head_dim: int) -> None:
    rng = random.Random(head_dim)
    for base, original in itertools.product(BASES, ORIGINAL_LENGTHS):
        short = [rng.uniform(1.0, 4.0) for _ in range(head_dim // 2)]
        long = [rng.uniform(1.0, 64.0) for _ in range(head_dim // 2)]
        for explicit in ({"factor": 8.0}, {"factor": None}, {"factor": 4.0, "attention_factor": 1.3}):
            case = {
                "rope_type": "longrope",
                "short_factor": short,
                "long_factor": long,
                "original_max_position_embeddings": original,
            } | explicit
            for seq_len in _lengths_around(original):
                _assert_parity(head_dim, base, case, 16 * original, seq_len)


def test_longrope_with_phi3s_top_level_original_length() -> None:
    rng = random.Random(0)
    rope_scaling = {
        "type": "longrope",
        "short_factor": [rng.uniform(1.0, 2.0) for _ in range(16)],
        "long_factor": [rng.uniform(1.0, 32.0) for _ in range(16)],
        "original_max_position_embeddings": 2048,  # the top-level value overrides this one
    }
    scaling = RopeScaling.from_hf(
        rope_scaling, max_position_embeddings=131072, original_max_position_embeddings=4096
    )
    assert scaling.original_max_position_embeddings == 4096 and scaling.factor == 32.0
    for seq_len in (100, 4096, 4097, 131072):
        expected, expected_factor = phi3_longrope_inv_freq(32, rope_scaling, 131072, 4096, seq_len)
        actual, actual_factor = rope_inv_freq(32, 10000.0, scaling, seq_len)
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
        assert actual_factor == pytest.approx(expected_factor, abs=1e-6)


def test_longrope_attention_factor_is_the_papers_formula() -> None:
    scaling = RopeScaling(
        type="longrope",
        factor=16.0,
        original_max_position_embeddings=4096,
        short_factor=(1.0,) * 8,
        long_factor=(2.0,) * 8,
    )
    _, attention_factor = rope_inv_freq(16, 10000.0, scaling)
    assert attention_factor == pytest.approx(math.sqrt(1 + math.log(16.0) / math.log(4096)), abs=1e-12)
