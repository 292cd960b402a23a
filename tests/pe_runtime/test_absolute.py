"""Sinusoidal table against DistilBERT's (float64 numpy) and learned-table interpolation."""

from __future__ import annotations

import pytest
import torch
from transformers.models.distilbert.modeling_distilbert import create_sinusoidal_embeddings

from pe_runtime import PEConfigError, interpolate_learned, sinusoidal_table


@pytest.mark.parametrize("dim", [8, 64, 33])
def test_sinusoidal_matches_distilbert(dim: int) -> None:
    expected = torch.empty(512, dim)
    create_sinusoidal_embeddings(512, dim, expected)
    table = sinusoidal_table(512, dim)
    assert table.dtype == torch.float32 and table.shape == (512, dim)
    torch.testing.assert_close(table, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("factor", [2.0, 4.0, 2.5])
def test_sinusoidal_interpolation_is_exact_at_fractional_positions(factor: float) -> None:
    stretched = sinusoidal_table(40, 16, factor=factor)
    if factor.is_integer():  # every factor-th row is an original integer position
        step = int(factor)
        torch.testing.assert_close(stretched[::step], sinusoidal_table(40 // step, 16), rtol=0, atol=1e-6)
    angles = torch.arange(40, dtype=torch.float64)[:, None] / factor
    inv_freq = torch.exp(torch.arange(0, 16, 2, dtype=torch.float64) * (-torch.log(torch.tensor(1e4)) / 16))
    torch.testing.assert_close(stretched[:, 0::2].double(), (angles * inv_freq).sin(), rtol=0, atol=1e-5)
    torch.testing.assert_close(stretched[:, 1::2].double(), (angles * inv_freq).cos(), rtol=0, atol=1e-5)


def test_sinusoidal_on_meta_device_has_the_shape_only() -> None:
    table = sinusoidal_table(10, 16, device="meta")
    assert table.device.type == "meta" and table.shape == (10, 16)


def test_interpolation_by_one_is_the_identity() -> None:
    table = torch.randn(7, 4)
    assert torch.equal(interpolate_learned(table, 1.0), table)


def test_interpolation_reads_the_table_at_position_over_factor() -> None:
    table = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    stretched = interpolate_learned(table, 2.0)
    assert stretched.shape == (12, 2)
    assert torch.equal(stretched[0::2], table)
    torch.testing.assert_close(stretched[1:-1:2], (table[:-1] + table[1:]) / 2)
    assert torch.equal(stretched[-1], table[-1])  # past the last trained row: held, not extrapolated


def test_interpolation_keeps_the_dtype() -> None:
    table = torch.randn(16, 8).to(torch.bfloat16)
    assert interpolate_learned(table, 1.5).dtype == torch.bfloat16


@pytest.mark.parametrize("factor", [0.5, float("nan")])
def test_bad_factor_names_the_field(factor: float) -> None:
    with pytest.raises(PEConfigError) as raised:
        interpolate_learned(torch.zeros(4, 2), factor)
    assert raised.value.field == "factor"
