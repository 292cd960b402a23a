"""The decode pass's matrix products for a batch of rows on a CPU, as a C kernel over packed weights.

At a batch of 2 to 64 rows, the BLAS call behind `F.linear` repacks the weight on every call;
with a model's weights in L3 rather than L2 (a whole step's worth), a zoo model's products took
1.7 ms of a batch of 16's step where the arithmetic needs about 0.6 (side by side on two cores).
Here the weight is packed once (`pack_weight`; `pack_int8` and `pack_int4` for codes and their
group scales) into panels of 32 output columns that the kernel reads front to back
(`packed_linear.c`). Codes are laid out for the CPU's integer dot products where the kernel has
them (`dot_products`), else as rows the kernel widens to floats; either way the product is over
the activations `service.model.quantized.quantized_activations` rounds.
"""

from __future__ import annotations

from enum import IntEnum
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from service.model.kernels.build import kernel_function, use_threads

_SOURCE = Path(__file__).with_name("packed_linear.c")
PANEL = 32
GROUP = 32  # inputs sharing one scale (and minimum), as in GGUF's blocks; `GROUP` in the C source


class PanelFormat(IntEnum):
    """The C source's panel formats (its `enum`)."""

    FLOAT = 0
    INT8 = 1
    INT4 = 2
    INT8_DOTS = 3
    INT4_DOTS = 4
    ROUNDED_FLOAT = 5


class Panels(NamedTuple):
    """A [N, K] matrix as the kernel reads it, columns past N zero (G = ceil(K / GROUP)):

    - FLOAT: `values` float32 [ceil(N / 32), K, 32], `scales` None; ROUNDED_FLOAT the same over
      rounded activations, as the packed formats read them;
    - INT8: int8 codes [ceil(N / 32), K, 32], `scales` [ceil(N / 32), G, 32]:
      W[n, k] = code * scale of (n, k's group);
    - INT4: uint8 [ceil(N / 32), K, 16], two 4-bit codes a byte (columns c and c + 16 of the
      panel in the low and high nibble of byte c), `scales` [ceil(N / 32), G, 2, 32] (scales,
      then minimums): W[n, k] = code * scale + minimum;
    - INT8_DOTS, INT4_DOTS: the same codes for integer dot products, uint8 [ceil(N / 32), G * 8
      or G * 4, 32, 4], `scales` [ceil(N / 32), G, 2, 32] (factors, then offsets), as the layout
      comment of `packed_linear.c` says.
    """

    values: Tensor
    scales: Tensor | None
    format: PanelFormat
    in_features: int

    @property
    def max_out_features(self) -> int:
        return int(self.values.shape[0]) * PANEL

    def tensors(self) -> tuple[Tensor, Tensor | None]:
        """What the C step's table points at: the values and the scales."""
        return self.values, self.scales


def available() -> bool:
    """Whether the kernel is built and loaded in this process (built now if it was not)."""
    return _kernel() is not None


def _kernel() -> Any:
    return kernel_function(_SOURCE, "packed_linear")


@cache
def dot_products() -> bool:
    """Whether this CPU's build multiplies int8 and int4 codes as integers (AVX-512 VNNI)."""
    function = kernel_function(_SOURCE, "packed_dot_products")
    return function is not None and bool(function())


def pack_weight(weight: Tensor, *, rounded: bool = False) -> Panels:
    """Float32 panels of a [N, K] weight: 32 output columns each, zero past N; multiplying the
    activations as the packed formats round them when `rounded` (packed layers' weights)."""
    fmt = PanelFormat.ROUNDED_FLOAT if rounded else PanelFormat.FLOAT
    return Panels(_panels(weight.detach().float()), None, fmt, int(weight.shape[1]))


def pack_int8(codes: Tensor, scales: Tensor, *, dots: bool | None = None) -> Panels:
    """Int8 panels of `codes` [N, K] int8 with `scales` [N, ceil(K / GROUP)] (W = code * scale),
    laid out for dot products when `dots` (by default where the kernel has them)."""
    out_features, in_features = codes.shape
    groups = -(-in_features // GROUP)
    if codes.dtype != torch.int8 or scales.shape != (out_features, groups):
        raise ValueError(f"int8 codes [N, K] need scales [N, ceil(K / {GROUP})], not {tuple(scales.shape)}")
    factors = _panels(scales.float())  # [P, G, 32]
    if not _use_dots(dots):
        return Panels(_panels(codes), factors, PanelFormat.INT8, in_features)
    padding = (0, groups * GROUP - in_features)
    unsigned = F.pad(codes.to(torch.int16) + 128, padding, value=128).to(torch.uint8)
    panels = _panels(unsigned)  # [P, Kp, 32]
    quads = panels.view(panels.shape[0], -1, 4, PANEL).transpose(2, 3)  # [P, Kp / 4, 32, 4]
    per_group = torch.stack([factors, -128.0 * factors], dim=2)  # u = code + 128
    return Panels(quads.contiguous(), per_group.contiguous(), PanelFormat.INT8_DOTS, in_features)


def pack_int4(codes: Tensor, scales: Tensor, minimums: Tensor, *, dots: bool | None = None) -> Panels:
    """4-bit panels of `codes` [N, K] (0..15, uint8) with `scales` and `minimums` [N, K / GROUP],
    laid out for dot products when `dots` (by default where the kernel has them)."""
    out_features, in_features = codes.shape
    groups = (out_features, in_features // GROUP)
    if in_features % GROUP or scales.shape != groups or minimums.shape != groups:
        raise ValueError(f"4-bit codes [N, K] need K a multiple of {GROUP} and [N, K / {GROUP}] scales")
    values = _panels(codes.to(torch.uint8))  # [P, K, 32]
    per_group = torch.stack([_panels(scales.float()), _panels(minimums.float())], dim=2)  # [P, G, 2, 32]
    if not _use_dots(dots):
        nibbles = values[..., :16] | (values[..., 16:] << 4)  # [P, K, 16]
        return Panels(nibbles.contiguous(), per_group.contiguous(), PanelFormat.INT4, in_features)
    eights = values.view(values.shape[0], -1, 2, 4, PANEL)  # [P, K / 8, low/high nibble, 4, 32]
    nibbles = (eights[:, :, 0] | (eights[:, :, 1] << 4)).transpose(2, 3)  # [P, K / 8, 32, 4]
    return Panels(nibbles.contiguous(), per_group.contiguous(), PanelFormat.INT4_DOTS, in_features)


def _use_dots(dots: bool | None) -> bool:
    if dots and not dot_products():
        raise ValueError("this CPU's kernel has no integer dot products (AVX-512 VNNI)")
    return dot_products() if dots is None else dots


def _panels(matrix: Tensor) -> Tensor:
    """[ceil(N / 32), K, 32] from [N, K]: column n of panel p is row 32 p + n, zero past N."""
    rows, width = matrix.shape
    panels = -(-rows // PANEL)
    padded = F.pad(matrix, (0, 0, 0, panels * PANEL - rows))
    return padded.view(panels, PANEL, width).transpose(1, 2).contiguous()


def _expected_shapes(panels: Panels) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...] | None]:
    """The dtype and shape of `values`, and the shape of float32 `scales`, that `panels`' format
    and sizes call for."""
    count, k = int(panels.values.shape[0]), panels.in_features
    groups = -(-k // GROUP)
    return {
        PanelFormat.FLOAT: (torch.float32, (count, k, PANEL), None),
        PanelFormat.ROUNDED_FLOAT: (torch.float32, (count, k, PANEL), None),
        PanelFormat.INT8: (torch.int8, (count, k, PANEL), (count, groups, PANEL)),
        PanelFormat.INT4: (torch.uint8, (count, k, PANEL // 2), (count, groups, 2, PANEL)),
        PanelFormat.INT8_DOTS: (torch.uint8, (count, groups * 8, PANEL, 4), (count, groups, 2, PANEL)),
        PanelFormat.INT4_DOTS: (torch.uint8, (count, groups * 4, PANEL, 4), (count, groups, 2, PANEL)),
    }[panels.format]


def check_panels(panels: Panels, name: str) -> None:
    """Refuse what the kernel cannot read: a wrong dtype or shape, a non-contiguous tensor, a
    dot layout on a CPU without dot products."""
    if not isinstance(panels, Panels) or panels.format not in set(PanelFormat):
        raise ValueError(f"{name} must be panels from pack_weight, pack_int8 or pack_int4")
    dtype, shape, scales_shape = _expected_shapes(panels)
    values, scales = panels.tensors()
    if values.dtype != dtype or tuple(values.shape) != shape or not values.is_contiguous():
        raise ValueError(f"{name} must be panels from pack_weight, pack_int8 or pack_int4")
    if panels.format in (PanelFormat.INT4, PanelFormat.INT4_DOTS) and panels.in_features % GROUP:
        raise ValueError(f"{name}: 4-bit panels need whole groups of {GROUP} inputs")
    if panels.format in (PanelFormat.INT8_DOTS, PanelFormat.INT4_DOTS) and not dot_products():
        raise ValueError(f"{name}: dot-product panels on a CPU without them (AVX-512 VNNI)")
    found = tuple(scales.shape) if scales is not None and _is_float32(scales) else None
    if found != scales_shape:
        fmt = panels.format.name
        raise ValueError(f"{name}: {fmt} panels need float32 scales of {scales_shape}, not {found}")


def _is_float32(tensor: Tensor) -> bool:
    return tensor.dtype == torch.float32 and tensor.is_contiguous()


def packed_linear(input: Tensor, packed_weight: Panels, bias: Tensor | None, out_features: int) -> Tensor:
    """float32 [..., N]: `F.linear(input, weight, bias)` with the weight as `pack_weight`,
    `pack_int8` or `pack_int4` packed it (the packed formats over `quantized_activations(input)`).
    CPU only; `available()` says whether it can run. The batch step (`batch_pass.c`) calls the
    same C function; this binding is the kernel's own, for its tests and for a prompt chunk's
    output layer (`BatchPass.output_layer`)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the packed linear kernel is not available on this machine")
    if not isinstance(packed_weight, Panels):
        raise ValueError("packed_weight must come from pack_weight, pack_int8 or pack_int4")
    check_panels(packed_weight, "packed_weight")
    in_features = packed_weight.in_features
    if packed_weight.max_out_features < out_features:
        raise ValueError(
            f"packed_weight has {packed_weight.max_out_features} outputs at most, not {out_features}"
        )
    if input.shape[-1] != in_features:
        raise ValueError(f"input has {input.shape[-1]} features, the weight takes {in_features}")
    rows = input.reshape(-1, in_features).float()
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    bias = bias.float().contiguous() if bias is not None else None
    values, scales = packed_weight.tensors()
    out = torch.empty((rows.shape[0], out_features), dtype=torch.float32)
    threads = torch.get_num_threads()
    widened = torch.empty((threads, in_features, PANEL), dtype=torch.float32)  # each thread's panel
    activation_floats = kernel_function(_SOURCE, "packed_activation_floats")(rows.shape[0], in_features)
    activations = torch.empty(activation_floats, dtype=torch.float32)  # the quantized rows
    use_threads(_SOURCE, threads)
    kernel(
        rows.data_ptr(),
        rows.stride(0),
        values.data_ptr(),
        scales.data_ptr() if scales is not None else None,
        int(packed_weight.format),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        rows.shape[0],
        in_features,
        out_features,
        widened.data_ptr(),
        activations.data_ptr(),
    )
    return out.view(*input.shape[:-1], out_features)
