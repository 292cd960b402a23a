"""ALiBi slopes against BLOOM's, for every head count, and the causal bias built from them."""

from __future__ import annotations

import pytest
import torch

from pe_runtime import PEConfigError, alibi_bias, alibi_slopes
from tests.pe_runtime.hf_oracle import bloom_alibi_slopes


@pytest.mark.parametrize("num_heads", range(1, 65))
def test_slopes_equal_blooms(num_heads: int) -> None:
    slopes = alibi_slopes(num_heads)
    assert slopes.dtype == torch.float32 and slopes.shape == (num_heads,)
    torch.testing.assert_close(slopes, bloom_alibi_slopes(num_heads), rtol=1e-6, atol=0)


def test_power_of_two_slopes_are_the_papers_geometric_sequence() -> None:
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0**-k for k in range(1, 9)]), rtol=0, atol=0)


def test_bias_is_slope_times_key_minus_query() -> None:
    slopes = alibi_slopes(4)
    bias = alibi_bias(slopes, torch.arange(3), torch.arange(3))
    assert bias.shape == (4, 3, 3)
    assert torch.equal(bias[:, 2, 0], -2 * slopes) and torch.equal(
        bias.diagonal(dim1=1, dim2=2), torch.zeros(4, 3)
    )


def test_decode_step_bias_uses_absolute_positions() -> None:
    slopes = alibi_slopes(2)
    full = alibi_bias(slopes, torch.arange(10), torch.arange(10))
    step = alibi_bias(slopes, torch.tensor([9]), torch.arange(10))
    assert torch.equal(step[:, 0], full[:, 9])


@pytest.mark.parametrize("num_heads", [0, -3])
def test_bad_head_count_names_the_field(num_heads: int) -> None:
    with pytest.raises(PEConfigError) as raised:
        alibi_slopes(num_heads)
    assert raised.value.field == "num_heads"
