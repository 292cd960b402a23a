"""The C product kernel against `F.linear` on the unpacked weight.

Row counts cover a lone row, every remainder of the kernel's 8-row tiles and more than one tile;
output widths cover whole panels of 32 and a last partial one (a zoo vocabulary of 258); inputs
are strided rows (slices of a wider tensor), as the step's projections hand over.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from service.model.kernels import packed_linear as kernel
from service.model.kernels.packed_linear import pack_weight, packed_linear
from tests.kernels import require_kernel, torch_threads


@pytest.fixture(autouse=True)
def _kernel() -> None:
    require_kernel(kernel.available, "packed linear")


SHAPES = [(576, 192), (258, 192), (7, 5), (33, 512)]  # (out_features, in_features)


def weights(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    return weight, torch.randn(out_features, generator=generator)


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_packing_round_trips(out_features: int, in_features: int) -> None:
    weight, _ = weights(out_features, in_features)
    packed = pack_weight(weight)
    assert packed.shape == (-(-out_features // 32), in_features, 32)
    columns = packed.transpose(1, 2).reshape(-1, in_features)  # the panels' rows, back in order
    assert torch.equal(columns[:out_features], weight)
    assert not columns[out_features:].any()  # zero padding


@pytest.mark.parametrize("threads", [1, 2], ids=["1-thread", "2-threads"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16, 64])
def test_the_kernel_equals_f_linear(
    rows: int, out_features: int, in_features: int, with_bias: bool, threads: int
) -> None:
    weight, bias = weights(out_features, in_features, seed=rows)
    wide = torch.randn(rows, in_features + 9)
    x = wide[:, 4 : 4 + in_features]  # strided rows
    used_bias = bias if with_bias else None
    with torch_threads(threads):
        out = packed_linear(x, pack_weight(weight), used_bias, out_features)
    assert out.shape == (rows, out_features) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, used_bias), atol=1e-4, rtol=1e-4)


def test_a_weight_that_was_not_packed_is_refused() -> None:
    weight, _ = weights(64, 32)
    with pytest.raises(ValueError, match="pack_weight"):
        packed_linear(torch.randn(2, 32), weight, None, 64)
    with pytest.raises(ValueError, match="features"):
        packed_linear(torch.randn(2, 31), pack_weight(weight), None, 64)
