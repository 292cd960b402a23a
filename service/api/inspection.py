"""What pe_runtime computes for a scheme and scaling, as plain lists for `POST /inspect`.

Everything comes from pe_runtime's public API (`PECache` for the tables the model reads,
`rope_inv_freq` for the frequencies, `alibi_bias` for the bias matrix), so the page shows the
numbers the engine uses rather than a re-derivation. The cache is this module's own, with its
counters kept private: the tables served here must not show up in the engine's cache metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from pe_runtime import PECache, RopeScaling, alibi_bias, rope_inv_freq, rope_seq_len_key
from service.api.schemas.inspect import (
    MAX_CELLS,
    AlibiInspection,
    InspectRequest,
    InspectResponse,
    RopeInspection,
    SinusoidalInspection,
    T5Inspection,
)
from service.model.positional import check_supported_scaling
from service.requests.errors import ErrorKind, RequestError

_DEVICE = "cpu"
_CACHE = PECache(16 << 20, length_dependent_budget_bytes_per_device=4 << 20, registry=None)

Table = RopeInspection | AlibiInspection | T5Inspection | SinusoidalInspection


def inspect_tables(body: InspectRequest) -> InspectResponse:
    """The tables of `body.pe` under `body.pe_scaling`; raises RequestError / PEConfigError (422)."""
    inspector = _INSPECTORS.get(body.pe)
    if inspector is None:
        schemes = ", ".join(_INSPECTORS)
        message = f"Scheme {body.pe!r} has no table pe_runtime computes (its positions are weights or none); "
        raise RequestError(ErrorKind.INVALID, message + f"inspectable: {schemes}.", param="pe")
    scaling = _scaling(body)
    attention_factor, table = inspector(body, scaling)
    return InspectResponse.model_validate(
        {
            "pe": body.pe,
            "length": body.length,
            "scaling": scaling.to_dict() if scaling is not None else None,
            "attention_factor": attention_factor,
            body.pe: table,
        }
    )


def _scaling(body: InspectRequest) -> RopeScaling | None:
    requested = body.pe_scaling
    if requested is None:
        return None
    check_supported_scaling(body.pe, requested.type)  # PEConfigError naming pe_scaling.type
    return RopeScaling.from_hf(requested.to_hf(), max_position_embeddings=body.native_context)


def _check_cells(cells: int, what: str) -> None:
    """422 naming `length` when the answer's tables would hold more than MAX_CELLS numbers."""
    if cells > MAX_CELLS:
        message = f"length: the {what} would hold {cells} numbers, over the limit of {MAX_CELLS}."
        raise RequestError(ErrorKind.INVALID, message, param="length")


def _rope(body: InspectRequest, scaling: RopeScaling | None) -> tuple[float, Table]:
    frequencies = body.head_dim // 2
    _check_cells(2 * body.length * frequencies, f"cos and sin tables (2 x {body.length} x {frequencies})")
    seq_len = body.seq_len or body.length
    tables = _CACHE.rope(
        body.head_dim,
        body.rope_base,
        scaling,
        body.length,
        device=_DEVICE,
        dtype=torch.float32,
        layout="neox",
        seq_len=seq_len,
    )
    inv_freq, _ = rope_inv_freq(body.head_dim, body.rope_base, scaling, rope_seq_len_key(scaling, seq_len))
    unscaled, _ = rope_inv_freq(body.head_dim, body.rope_base, None)
    rope = RopeInspection(
        head_dim=body.head_dim,
        base=body.rope_base,
        seq_len=seq_len,
        inv_freq=inv_freq.tolist(),
        inv_freq_unscaled=unscaled.tolist(),
        # The neox layout repeats the frequencies in its second half: one column per frequency.
        cos=tables.cos[:, :frequencies].tolist(),
        sin=tables.sin[:, :frequencies].tolist(),
    )
    return tables.attention_factor, rope


def _alibi(body: InspectRequest, scaling: RopeScaling | None) -> tuple[float, Table]:
    _check_cells(body.num_heads * body.length**2, f"bias ({body.num_heads} x {body.length} x {body.length})")
    slopes = _CACHE.alibi_slopes(body.num_heads, device=_DEVICE, dtype=torch.float32)
    positions = torch.arange(body.length)
    bias = alibi_bias(slopes, positions, positions)
    return 1.0, AlibiInspection(slopes=slopes.tolist(), bias=bias.tolist())


def _t5(body: InspectRequest, scaling: RopeScaling | None) -> tuple[float, Table]:
    _check_cells(body.length**2, f"bucket matrix ({body.length} x {body.length})")
    buckets = _CACHE.t5_buckets(
        body.length,
        bidirectional=body.t5_bidirectional,
        num_buckets=body.t5_num_buckets,
        max_distance=body.t5_max_distance,
        device=_DEVICE,
    )
    # buckets[k - q + length - 1] is the bucket of query q and key k.
    positions = torch.arange(body.length)
    matrix = buckets[positions[None, :] - positions[:, None] + body.length - 1]
    t5 = T5Inspection(
        num_buckets=body.t5_num_buckets,
        max_distance=body.t5_max_distance,
        bidirectional=body.t5_bidirectional,
        buckets=matrix.tolist(),
    )
    return 1.0, t5


def _sinusoidal(body: InspectRequest, scaling: RopeScaling | None) -> tuple[float, Table]:
    _check_cells(body.length * body.head_dim, f"table ({body.length} x {body.head_dim})")
    factor = scaling.factor if scaling is not None and scaling.type == "linear" else 1.0
    table = _CACHE.sinusoidal(body.length, body.head_dim, device=_DEVICE, dtype=torch.float32, factor=factor)
    sinusoidal = SinusoidalInspection(dim=body.head_dim, factor=factor, table=table.tolist())
    return 1.0, sinusoidal


Builder = Callable[[InspectRequest, RopeScaling | None], tuple[float, Table]]

# Per scheme: its tables, and the scalings they take: RoPE's frequencies every type, the
# sinusoidal table a linear stretch of its positions, the relative biases none.
_INSPECTORS: Mapping[str, Builder] = {
    "rope": _rope,
    "sinusoidal": _sinusoidal,
    "alibi": _alibi,
    "t5_bias": _t5,
}
