"""cos/sin tables and their application to queries and keys, in the two channel layouts in use.

`neox` ("rotate half", Llama, GPT-NeoX) pairs channel i with i + d/2; `gptj` (interleaved, GPT-J,
original RoFormer) pairs 2i with 2i + 1. Angles are always formed in float32 and the table is cast
once at the end: forming them in bfloat16 would put a 256-position rounding step on positions near
60k and scramble every rotation there.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from pe_runtime.errors import PEConfigError

RopeLayout = Literal["neox", "gptj"]
ROPE_LAYOUTS: tuple[str, ...] = get_args(RopeLayout)


def rope_cos_sin(
    inv_freq: torch.Tensor,
    attention_factor: float,
    length: int,
    *,
    layout: RopeLayout = "neox",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0 .. length-1, each [length, rotary_dim], scaled by attention_factor."""
    positions = torch.arange(length, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq.to(device=positions.device, dtype=torch.float32))
    # angles: [length, rotary_dim // 2] -> tables [length, rotary_dim]
    return (
        _spread((angles.cos() * attention_factor).to(dtype), layout),
        _spread((angles.sin() * attention_factor).to(dtype), layout),
    )


def rope_cos_sin_at(
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    *,
    layout: RopeLayout = "neox",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit cos and sin [N, rotary_dim] at arbitrary, possibly fractional `positions` [N].

    Angles are formed in the positions' dtype (pass float64 to keep a fractional position far
    out exact): this turns vectors already rotated by a table to other positions, which is how an
    attention rule moves a cached key without recomputing it.
    """
    angles = positions[:, None] * inv_freq.to(device=positions.device, dtype=positions.dtype)[None, :]
    return _spread(angles.cos().to(dtype), layout), _spread(angles.sin().to(dtype), layout)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, layout: RopeLayout = "neox"
) -> torch.Tensor:
    """Rotate x[..., :rotary_dim] by the tables and pass the remaining channels through.

    cos and sin must broadcast against x[..., :rotary_dim]: e.g. x [batch, heads, seq, head_dim]
    with tables [seq, rotary_dim], or x [tokens, heads, head_dim] with tables[positions][:, None].
    """
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    out = (rotated * cos + _quarter_turn(rotated, layout) * sin).to(x.dtype)
    return torch.cat((out, passed), dim=-1) if passed.shape[-1] else out


def _spread(half: torch.Tensor, layout: RopeLayout) -> torch.Tensor:
    """[..., d/2] per-pair values -> [..., d] per-channel values in the layout's pairing."""
    if layout == "neox":
        return torch.cat((half, half), dim=-1)
    if layout == "gptj":
        return half.repeat_interleave(2, dim=-1)
    raise _unknown_layout(layout)


def _quarter_turn(x: torch.Tensor, layout: RopeLayout) -> torch.Tensor:
    """Each channel pair (a, b) -> (-b, a): the 90-degree rotation that sin multiplies."""
    if layout == "neox":
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    if layout == "gptj":
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    raise _unknown_layout(layout)


def _unknown_layout(layout: str) -> PEConfigError:
    return PEConfigError(
        f"rope layout must be one of {', '.join(ROPE_LAYOUTS)}, got {layout!r}", field="layout"
    )
