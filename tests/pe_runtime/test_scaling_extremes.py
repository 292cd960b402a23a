"""Extreme but accepted field values (subnormal, huge, pairs whose ratios overflow) give every scaling
type either finite tables or a `PEConfigError` naming one of its fields: never an OverflowError, a
ZeroDivisionError or a table of infinities (the HTTP layer would answer 500 for those)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

from pe_runtime import PEConfigError, RopeScaling, rope_inv_freq

EXTREMES = (5e-324, 1e-310, 1e-39, 1e-6, 1.0, 1.5, 32.0, 1e6, 1e300)
ORIGINALS = (1, 256, 1 << 22)
LENGTHS = (None, 100, 1 << 22)
ROTARY_DIM = 32
FREQUENCIES = ROTARY_DIM // 2
FIELDS = {
    "linear": ("factor",),
    "ntk": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("factor", "attention_factor", "short_factor", "long_factor"),
}
LISTS = ("short_factor", "long_factor")


def _config(scaling_type: str, original: int, values: dict[str, float]) -> dict[str, Any]:
    config: dict[str, Any] = {"type": scaling_type}
    if scaling_type not in ("linear", "ntk"):
        config["original_max_position_embeddings"] = original
    if scaling_type == "longrope":
        config |= {"short_factor": [1.0] * FREQUENCIES, "long_factor": [4.0] * FREQUENCIES}
    for name, value in values.items():
        config[name] = [value] * FREQUENCIES if name in LISTS else value
    return config


def _cases(scaling_type: str) -> list[dict[str, Any]]:
    pairs = itertools.combinations_with_replacement(FIELDS[scaling_type], 2)
    return [
        _config(scaling_type, original, {first: a, second: b})
        for (first, second), a, b, original in itertools.product(pairs, EXTREMES, EXTREMES, ORIGINALS)
    ]


@pytest.mark.parametrize("scaling_type", FIELDS)
def test_extreme_values_give_finite_tables_or_a_named_error(scaling_type: str) -> None:
    allowed = {*FIELDS[scaling_type], "original_max_position_embeddings"}
    for config in _cases(scaling_type):
        try:
            scaling = RopeScaling.from_hf(config, max_position_embeddings=256)
        except PEConfigError:
            continue
        for length in LENGTHS:
            try:
                inv_freq, attention_factor = rope_inv_freq(ROTARY_DIM, 10000.0, scaling, seq_len=length)
            except PEConfigError as error:
                assert error.field in allowed, (config, error.field)
                continue
            assert torch.isfinite(inv_freq).all() and (inv_freq >= 0).all(), (config, length, inv_freq)
            assert math.isfinite(attention_factor) and attention_factor >= 2.0**-149, (config, length)


def test_a_subnormal_beta_slow_names_beta_slow() -> None:
    """Found by schemathesis: the correction range was infinite and math.ceil raised OverflowError."""
    scaling = RopeScaling(type="yarn", factor=1.0, original_max_position_embeddings=256, beta_slow=5e-324)
    with pytest.raises(PEConfigError) as caught:
        rope_inv_freq(ROTARY_DIM, 10000.0, scaling)
    assert caught.value.field == "beta_slow"


def test_longrope_checks_the_long_factors_while_the_sequence_is_short() -> None:
    """A sequence that starts short moves to the long factors as it grows; both must be usable."""
    scaling = RopeScaling(
        type="longrope",
        original_max_position_embeddings=256,
        short_factor=(1.0,) * FREQUENCIES,
        long_factor=(5e-324,) * FREQUENCIES,
    )
    with pytest.raises(PEConfigError) as caught:
        rope_inv_freq(ROTARY_DIM, 10000.0, scaling, seq_len=10)
    assert caught.value.field == "long_factor"
