"""T5 relative-position buckets against transformers' T5Attention, both directions."""

from __future__ import annotations

import itertools

import pytest
import torch

from pe_runtime import PEConfigError, t5_relative_position_bucket
from tests.pe_runtime.hf_oracle import t5_buckets


@pytest.mark.parametrize("bidirectional", [True, False])
def test_buckets_equal_t5s(bidirectional: bool) -> None:
    relative = torch.arange(-1000, 1001)
    for num_buckets, max_distance in itertools.product((8, 32, 64), (16, 128, 512)):
        exact_range = num_buckets // 4 if bidirectional else num_buckets // 2
        if max_distance <= exact_range:  # no room for logarithmic buckets: rejected, tested below
            continue
        ours = t5_relative_position_bucket(
            relative, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
        )
        assert torch.equal(ours, t5_buckets(relative, bidirectional, num_buckets, max_distance)), (
            num_buckets,
            max_distance,
        )


def test_matrix_input_keeps_its_shape() -> None:
    relative = torch.arange(6)[None, :] - torch.arange(4)[:, None]  # [q, k]
    buckets = t5_relative_position_bucket(relative, bidirectional=True, num_buckets=32, max_distance=128)
    assert buckets.shape == (4, 6) and buckets.dtype == torch.long


@pytest.mark.parametrize(
    ("num_buckets", "max_distance", "field"), [(2, 128, "num_buckets"), (32, 4, "max_distance")]
)
def test_degenerate_bucketing_names_the_field(num_buckets: int, max_distance: int, field: str) -> None:
    with pytest.raises(PEConfigError) as raised:
        t5_relative_position_bucket(
            torch.arange(4), bidirectional=True, num_buckets=num_buckets, max_distance=max_distance
        )
    assert raised.value.field == field
