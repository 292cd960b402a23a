"""The decode pass's matrix products for a batch of rows on a CPU, as a C kernel over packed weights.

At a batch of 2 to 64 rows, the BLAS call behind `F.linear` repacks the weight on every call;
with a model's weights in L3 rather than L2 (a whole step's worth), a zoo model's products took
1.7 ms of a batch of 16's step where the arithmetic needs about 0.6 (side by side on two cores).
Here the weight is packed once (`pack_weight`) into panels of 32 output columns that the kernel
reads front to back (`packed_linear.c`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from service.model.kernels.build import kernel_function, use_threads

_SOURCE = Path(__file__).with_name("packed_linear.c")
PANEL = 32
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
_ARGUMENTS = (_POINTER, _SIZE, _POINTER, _POINTER, _POINTER, _SIZE, _SIZE, _SIZE)


def available() -> bool:
    """Whether the kernel is built and loaded in this process (built now if it was not)."""
    return _kernel() is not None


def _kernel() -> Any:
    return kernel_function(_SOURCE, "packed_linear", _ARGUMENTS)


def pack_weight(weight: Tensor) -> Tensor:
    """float32 [ceil(N / 32), K, 32] from a [N, K] weight: panels of 32 output columns, zero past N."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = F.pad(weight.detach().float(), (0, 0, 0, panels * PANEL - out_features))
    return padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous()


def packed_linear(input: Tensor, packed_weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """float32 [..., N]: `F.linear(input, weight, bias)` with the weight as `pack_weight` packed it.
    CPU only; `available()` says whether it can run. The batch step (`batch_pass.c`) calls the same
    C function; this binding is the kernel's own, for its tests."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the packed linear kernel is not available on this machine")
    if packed_weight.dim() != 3 or packed_weight.shape[2] != PANEL or packed_weight.dtype != torch.float32:
        raise ValueError("packed_weight must come from pack_weight")
    panels, in_features, _ = packed_weight.shape
    if panels * PANEL < out_features:
        raise ValueError(f"packed_weight has {panels * PANEL} outputs at most, not {out_features}")
    if input.shape[-1] != in_features:
        raise ValueError(f"input has {input.shape[-1]} features, the weight takes {in_features}")
    rows = input.reshape(-1, in_features).float()
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    bias = bias.float().contiguous() if bias is not None else None
    packed_weight = packed_weight.contiguous()
    out = torch.empty((rows.shape[0], out_features), dtype=torch.float32)
    use_threads(_SOURCE, torch.get_num_threads())
    kernel(
        rows.data_ptr(),
        rows.stride(0),
        packed_weight.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        rows.shape[0],
        in_features,
        out_features,
    )
    return out.view(*input.shape[:-1], out_features)
