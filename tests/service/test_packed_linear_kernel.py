"""The C product kernel against `F.linear` on the unpacked weight, in each panel format.

Row counts cover a lone row, every remainder of the kernel's 8-row (float) and 4-row (dot) tiles
and more than one tile; output widths cover whole panels of 32 and a last partial one (a zoo
vocabulary of 258); input widths cover whole groups of 32 and a last partial one (int8; int4 takes
whole groups only); inputs are strided rows (slices of a wider tensor), as the step's projections
hand over. Packed panels are checked against `F.linear` on the weight their codes stand for
(`dequantized`) over the rounded activations (`quantized_activations`), so the kernel's own error
is float rounding, whatever the quantization costs. Both code layouts run where the CPU has dot
products: the widening one is every other CPU's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from service.model.kernels import packed_linear as kernel
from service.model.kernels.packed_linear import (
    PanelFormat,
    Panels,
    dot_products,
    pack_int4,
    pack_int8,
    pack_weight,
    packed_linear,
)
from service.model.quantized import Int4Linear, Int8Linear, quantized_activations
from tests.kernels import require_kernel, torch_threads


@pytest.fixture(autouse=True)
def _kernel() -> None:
    require_kernel(kernel.available, "packed linear")


SHAPES = [(576, 192), (258, 192), (7, 5), (33, 512), (52, 64)]  # (out_features, in_features)
# Each code format in both layouts where this CPU has dot products, else the widening one.
FORMATS = ["float32", "int8", "int4"] + (["int8-dots", "int4-dots"] if dot_products() else [])
# 4-bit panels take whole groups of 32 inputs only.
FORMAT_SHAPES = [
    (fmt, *shape) for fmt in FORMATS for shape in SHAPES if not fmt.startswith("int4") or shape[1] % 32 == 0
]


def weights(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    return weight, torch.randn(out_features, generator=generator)


def linear(weight: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


def int8_layer(weight: torch.Tensor) -> Int8Linear:
    return Int8Linear.quantize(linear(weight))


def packed(weight: torch.Tensor, fmt: str) -> tuple[Panels, torch.Tensor]:
    """The panels in format `fmt` and the float weight they stand for."""
    if fmt == "float32":
        return pack_weight(weight), weight
    dots = fmt.endswith("-dots")
    if fmt.startswith("int8"):
        layer = int8_layer(weight)
        return pack_int8(layer.codes, layer.scales, dots=dots), layer.dequantized()
    int4 = Int4Linear.quantize(linear(weight))
    return pack_int4(int4.codes(), int4.scales, int4.minimums, dots=dots), int4.dequantized()


def unpanel(panels: torch.Tensor, rows: int) -> torch.Tensor:
    width = panels.shape[1]
    return panels.transpose(1, 2).reshape(-1, width)[:rows]  # the panels' rows, back in order


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_packing_round_trips(out_features: int, in_features: int) -> None:
    weight, _ = weights(out_features, in_features)
    values, scales = pack_weight(weight).tensors()
    assert values.shape == (-(-out_features // 32), in_features, 32) and scales is None
    columns = values.transpose(1, 2).reshape(-1, in_features)
    assert torch.equal(columns[:out_features], weight)
    assert not columns[out_features:].any()  # zero padding


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_int8_packing_keeps_the_codes_and_their_group_scales(out_features: int, in_features: int) -> None:
    weight, _ = weights(out_features, in_features)
    layer = int8_layer(weight)
    values, scales = pack_int8(layer.codes, layer.scales, dots=False).tensors()
    groups = -(-in_features // 32)
    assert values.dtype == torch.int8 and values.shape == (-(-out_features // 32), in_features, 32)
    assert scales is not None and scales.shape == (values.shape[0], groups, 32)
    assert torch.equal(unpanel(values, out_features), layer.codes)
    assert torch.equal(unpanel(scales, out_features), layer.scales)
    # Symmetric codes on each group's own scale: within half a step of the weight.
    steps = layer.scales.repeat_interleave(32, dim=1)[:, :in_features]
    assert ((layer.dequantized() - weight).abs() <= steps / 2 + 1e-6).all()


@pytest.mark.parametrize("threads", [1, 2], ids=["1-thread", "2-threads"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize(("fmt", "out_features", "in_features"), FORMAT_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13, 16, 21, 64])
def test_the_kernel_equals_f_linear(
    rows: int, out_features: int, in_features: int, with_bias: bool, threads: int, fmt: str
) -> None:
    weight, bias = weights(out_features, in_features, seed=rows)
    panels, meant = packed(weight, fmt)
    wide = torch.randn(rows, in_features + 9)
    wide[0, 4:13] = 0.0  # a group of zeros (with int8's partial last group, a whole one at K = 5)
    x = wide[:, 4 : 4 + in_features]  # strided rows
    used_bias = bias if with_bias else None
    with torch_threads(threads):
        out = packed_linear(x, panels, used_bias, out_features)
    assert out.shape == (rows, out_features) and out.is_contiguous()
    read = x if fmt == "float32" else quantized_activations(x)
    torch.testing.assert_close(out, F.linear(read, meant, used_bias), atol=1e-4, rtol=1e-4)


def test_activations_round_per_group_of_32_to_int8_steps() -> None:
    x = torch.randn(3, 70) * torch.linspace(0.1, 10.0, 70)  # groups of unlike magnitudes
    x[1, 32:64] = 0.0
    rounded = quantized_activations(x)
    for start in (0, 32, 64):
        group, out = x[:, start : start + 32], rounded[:, start : start + 32]
        step = group.abs().amax(dim=1, keepdim=True) / 127.0
        codes = torch.where(step > 0, out / step, torch.zeros_like(out))
        assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.abs().max() <= 127 + 1e-3
        assert ((out - group).abs() <= step / 2 + 1e-6).all()  # within half a step
    assert not rounded[1, 32:64].any()


@pytest.mark.skipif(not dot_products(), reason="this CPU has no integer dot products (AVX-512 VNNI)")
@pytest.mark.parametrize(("out_features", "in_features"), [(52, 64), (33, 40)])
def test_dot_layouts_hold_the_codes_four_inputs_a_column(out_features: int, in_features: int) -> None:
    weight, _ = weights(out_features, in_features)
    layer = int8_layer(weight)
    panels = pack_int8(layer.codes, layer.scales, dots=True)
    assert panels.format is PanelFormat.INT8_DOTS
    padded = -(-in_features // 32) * 32
    codes = panels.values.transpose(2, 3).reshape(panels.values.shape[0], padded, 32)  # [P, Kp, 32]
    assert torch.equal(unpanel(codes, out_features)[:, :in_features].int() - 128, layer.codes.int())
    assert panels.scales is not None
    assert torch.equal(panels.scales[:, :, 1], -128.0 * panels.scales[:, :, 0])
    if in_features % 32 == 0:
        int4 = Int4Linear.quantize(linear(weight))
        nibbles = pack_int4(int4.codes(), int4.scales, int4.minimums, dots=True).values  # [P, K / 8, 32, 4]
        eights = torch.stack([nibbles & 15, nibbles >> 4], dim=2)  # [P, K / 8, 2, 32, 4]
        codes = eights.transpose(3, 4).reshape(nibbles.shape[0], in_features, 32)
        assert torch.equal(unpanel(codes, out_features), int4.codes())


def test_a_weight_that_was_not_packed_is_refused() -> None:
    weight, _ = weights(64, 32)
    with pytest.raises(ValueError, match="pack_weight"):
        packed_linear(torch.randn(2, 32), weight, None, 64)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="features"):
        packed_linear(torch.randn(2, 31), pack_weight(weight), None, 64)


@pytest.mark.parametrize(("out_features", "in_features"), [(576, 192), (33, 512)])
def test_int4_packing_puts_two_panel_columns_in_a_byte(out_features: int, in_features: int) -> None:
    weight, _ = weights(out_features, in_features)
    layer = Int4Linear.quantize(linear(weight))
    values, scales = pack_int4(layer.codes(), layer.scales, layer.minimums, dots=False).tensors()
    assert values.dtype == torch.uint8 and values.shape == (-(-out_features // 32), in_features, 16)
    codes = torch.cat([values & 15, values >> 4], dim=2)  # [P, K, 32]: columns 0..15, then 16..31
    assert torch.equal(unpanel(codes, out_features), layer.codes())
    assert scales is not None and scales.shape == (values.shape[0], in_features // 32, 2, 32)
    assert torch.equal(unpanel(scales[:, :, 0], out_features), layer.scales)
    assert torch.equal(unpanel(scales[:, :, 1], out_features), layer.minimums)


def test_int8_panels_without_their_scales_are_refused() -> None:
    weight, _ = weights(64, 32)
    panels = packed(weight, "int8")[0]
    assert panels.scales is not None
    with pytest.raises(ValueError, match="need float32 scales"):
        packed_linear(torch.randn(2, 32), panels._replace(scales=None), None, 64)
    with pytest.raises(ValueError, match="need float32 scales"):
        packed_linear(torch.randn(2, 32), panels._replace(scales=panels.scales[:, :0]), None, 64)
    with pytest.raises(ValueError, match="pack_weight"):
        packed_linear(torch.randn(2, 32), panels._replace(format=PanelFormat.INT4), None, 64)
