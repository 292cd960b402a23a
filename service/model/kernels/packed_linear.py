"""The decode pass's matrix products for a batch of rows on a CPU, as a C kernel over packed weights.

At a batch of 2 to 64 rows, the BLAS call behind `F.linear` repacks the weight on every call;
with a model's weights in L3 rather than L2 (a whole step's worth), a zoo model's products took
1.7 ms of a batch of 16's step where the arithmetic needs about 0.6 (side by side on two cores).
Here the weight is packed once (`pack_weight`; `pack_int8` and `pack_int4` for codes and their
group scales) into panels of 32 output columns that the kernel reads front to back
(`packed_linear.c`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from service.model.kernels.build import kernel_function, use_threads

_SOURCE = Path(__file__).with_name("packed_linear.c")
PANEL = 32
GROUP = 32  # inputs sharing one scale (and minimum), as in GGUF's blocks; `GROUP` in the C source
# The C source's panel formats (`FLOAT_PANELS`, `INT8_PANELS`, `INT4_PANELS`), by the values' dtype.
FORMATS = {torch.float32: 0, torch.int8: 1, torch.uint8: 2}


class Panels(NamedTuple):
    """A [N, K] matrix as the kernel reads it, columns past N zero, in one of three formats:

    - `values` float32 [ceil(N / 32), K, 32], `scales` None;
    - `values` int8 codes [ceil(N / 32), K, 32], `scales` [ceil(N / 32), ceil(K / GROUP), 32]:
      W[n, k] = code * scale of (n, k's group);
    - `values` uint8 [ceil(N / 32), K, 16], two 4-bit codes a byte (columns c and c + 16 of the
      panel in the low and high nibble of byte c), `scales` [ceil(N / 32), K / GROUP, 2, 32]
      (scales, then minimums): W[n, k] = code * scale + minimum.
    """

    values: Tensor
    scales: Tensor | None

    @property
    def format(self) -> int:
        return FORMATS[self.values.dtype]

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
    return kernel_function(_SOURCE, "packed_linear")


def pack_weight(weight: Tensor) -> Panels:
    """Float32 panels of a [N, K] weight: 32 output columns each, zero past N."""
    return Panels(_panels(weight.detach().float()), None)


def pack_int8(codes: Tensor, scales: Tensor) -> Panels:
    """Int8 panels of `codes` [N, K] int8 with `scales` [N, ceil(K / GROUP)] (W = code * scale)."""
    out_features, in_features = codes.shape
    if codes.dtype != torch.int8 or scales.shape != (out_features, -(-in_features // GROUP)):
        raise ValueError(f"int8 codes [N, K] need scales [N, ceil(K / {GROUP})], not {tuple(scales.shape)}")
    return Panels(_panels(codes), _panels(scales.float()))


def pack_int4(codes: Tensor, scales: Tensor, minimums: Tensor) -> Panels:
    """4-bit panels of `codes` [N, K] (0..15, uint8) with `scales` and `minimums` [N, K / GROUP]."""
    out_features, in_features = codes.shape
    groups = (out_features, in_features // GROUP)
    if in_features % GROUP or scales.shape != groups or minimums.shape != groups:
        raise ValueError(f"4-bit codes [N, K] need K a multiple of {GROUP} and [N, K / {GROUP}] scales")
    values = _panels(codes.to(torch.uint8))  # [P, K, 32]
    nibbles = values[..., :16] | (values[..., 16:] << 4)  # [P, K, 16]
    per_group = torch.stack([_panels(scales.float()), _panels(minimums.float())], dim=2)  # [P, G, 2, 32]
    return Panels(nibbles.contiguous(), per_group.contiguous())


def _panels(matrix: Tensor) -> Tensor:
    """[ceil(N / 32), K, 32] from [N, K]: column n of panel p is row 32 p + n, zero past N."""
    rows, width = matrix.shape
    panels = -(-rows // PANEL)
    padded = F.pad(matrix, (0, 0, 0, panels * PANEL - rows))
    return padded.view(panels, PANEL, width).transpose(1, 2).contiguous()


def check_panels(panels: Panels, name: str) -> None:
    """Refuse what the kernel cannot read: a wrong dtype or shape, a non-contiguous tensor."""
    values, scales = panels
    width = 16 if values.dtype == torch.uint8 else PANEL
    if (
        values.dtype not in FORMATS
        or values.dim() != 3
        or values.shape[2] != width
        or not values.is_contiguous()
    ):
        raise ValueError(f"{name} must be panels from pack_weight, pack_int8 or pack_int4")
    panel_count, in_features = values.shape[:2]
    expected = {
        torch.float32: None,
        torch.int8: (panel_count, -(-in_features // GROUP), PANEL),
        torch.uint8: (panel_count, in_features // GROUP, 2, PANEL) if in_features % GROUP == 0 else (),
    }[values.dtype]
    found = tuple(scales.shape) if scales is not None and _is_float32(scales) else None
    if found != expected:
        raise ValueError(f"{name}: {values.dtype} panels need float32 scales of {expected}, not {found}")


def _is_float32(tensor: Tensor) -> bool:
    return tensor.dtype == torch.float32 and tensor.is_contiguous()


def packed_linear(input: Tensor, packed_weight: Panels, bias: Tensor | None, out_features: int) -> Tensor:
    """float32 [..., N]: `F.linear(input, weight, bias)` with the weight as `pack_weight`,
    `pack_int8` or `pack_int4` packed it. CPU only; `available()` says whether it can run. The batch step
    (`batch_pass.c`) calls the same C function; this binding is the kernel's own, for its tests."""
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
    values, scales = packed_weight
    out = torch.empty((rows.shape[0], out_features), dtype=torch.float32)
    threads = torch.get_num_threads()
    widened = torch.empty((threads, in_features, PANEL), dtype=torch.float32)  # each thread's panel
    use_threads(_SOURCE, threads)
    kernel(
        rows.data_ptr(),
        rows.stride(0),
        values.data_ptr(),
        scales.data_ptr() if scales is not None else None,
        packed_weight.format,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        rows.shape[0],
        in_features,
        out_features,
        widened.data_ptr(),
    )
    return out.view(*input.shape[:-1], out_features)
