"""The decode pass's matrix products for a batch of rows on a CPU, as a C kernel over packed weights.

At a batch of 2 to 64 rows, the BLAS call behind `F.linear` repacks the weight on every call;
with a model's weights in L3 rather than L2 (a whole step's worth), a zoo model's products took
1.7 ms of a batch of 16's step where the arithmetic needs about 0.6 (side by side on two cores).
Here the weight is packed once (`pack_weight`, or `pack_int8` for int8 codes and their group
scales) into panels of 32 output columns that the kernel reads front to back (`packed_linear.c`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from service.model.kernels.build import kernel_function, use_threads

_SOURCE = Path(__file__).with_name("packed_linear.c")
PANEL = 32
GROUP = 32  # inputs sharing one int8 scale (GGUF's Q8_0 block), `GROUP` in the C source
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
_ARGUMENTS = (_POINTER, _SIZE, _POINTER, _POINTER, _POINTER, _POINTER, _SIZE, _SIZE, _SIZE)


class Panels(NamedTuple):
    """A [N, K] matrix as the kernel reads it: `values` [ceil(N / 32), K, 32], float32 weights, or
    int8 codes with `scales` [ceil(N / 32), ceil(K / GROUP), 32] float32, W[n, k] = code * scale
    of (n, k's group). Columns past N are zero."""

    values: Tensor
    scales: Tensor | None

    @property
    def in_features(self) -> int:
        return int(self.values.shape[1])

    @property
    def max_out_features(self) -> int:
        return int(self.values.shape[0]) * PANEL


def available() -> bool:
    """Whether the kernel is built and loaded in this process (built now if it was not)."""
    return _kernel() is not None


def _kernel() -> Any:
    return kernel_function(_SOURCE, "packed_linear", _ARGUMENTS)


def pack_weight(weight: Tensor) -> Panels:
    """Float32 panels of a [N, K] weight: 32 output columns each, zero past N."""
    return Panels(_panels(weight.detach().float()), None)


def pack_int8(codes: Tensor, scales: Tensor) -> Panels:
    """Int8 panels of `codes` [N, K] int8 with `scales` [N, ceil(K / GROUP)] (W = code * scale)."""
    out_features, in_features = codes.shape
    if codes.dtype != torch.int8 or scales.shape != (out_features, -(-in_features // GROUP)):
        raise ValueError(f"int8 codes [N, K] need scales [N, ceil(K / {GROUP})], not {tuple(scales.shape)}")
    return Panels(_panels(codes), _panels(scales.float()))


def _panels(matrix: Tensor) -> Tensor:
    """[ceil(N / 32), K, 32] from [N, K]: column n of panel p is row 32 p + n, zero past N."""
    rows, width = matrix.shape
    panels = -(-rows // PANEL)
    padded = F.pad(matrix, (0, 0, 0, panels * PANEL - rows))
    return padded.view(panels, PANEL, width).transpose(1, 2).contiguous()


def check_panels(panels: Panels, name: str) -> None:
    """Refuse what the kernel cannot read: a wrong dtype, a non-contiguous tensor, missing scales."""
    values, scales = panels
    if values.dim() != 3 or values.shape[2] != PANEL or not values.is_contiguous():
        raise ValueError(f"{name} must be panels from pack_weight or pack_int8")
    groups = -(-values.shape[1] // GROUP)
    if values.dtype == torch.float32 and scales is None:
        return
    expected = (values.shape[0], groups, PANEL)
    if values.dtype == torch.int8 and scales is not None and _is_float32(scales) and scales.shape == expected:
        return
    raise ValueError(f"{name} must be float32 panels, or int8 panels with float32 scales per group")


def _is_float32(tensor: Tensor) -> bool:
    return tensor.dtype == torch.float32 and tensor.is_contiguous()


def packed_linear(input: Tensor, packed_weight: Panels, bias: Tensor | None, out_features: int) -> Tensor:
    """float32 [..., N]: `F.linear(input, weight, bias)` with the weight as `pack_weight` or
    `pack_int8` packed it. CPU only; `available()` says whether it can run. The batch step
    (`batch_pass.c`) calls the same C function; this binding is the kernel's own, for its tests."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the packed linear kernel is not available on this machine")
    if not isinstance(packed_weight, Panels):
        raise ValueError("packed_weight must come from pack_weight or pack_int8")
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
    values, scales = packed_weight
    out = torch.empty((rows.shape[0], out_features), dtype=torch.float32)
    use_threads(_SOURCE, torch.get_num_threads())
    kernel(
        rows.data_ptr(),
        rows.stride(0),
        values.data_ptr(),
        scales.data_ptr() if scales is not None else None,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        rows.shape[0],
        in_features,
        out_features,
    )
    return out.view(*input.shape[:-1], out_features)
