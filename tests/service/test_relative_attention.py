"""Each new scheme's attention against a naive per-(i, j) loop written from its paper's equations.

The loops below read only the layer's projections and parameters; every table, shift, gather
and interpolation of the model's own path is recomputed here from the formulas, in float64 on
small random sizes, and the model's attention output must match it to 1e-5.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from pe_runtime import RopeScaling, alibi_slopes
from service.model.relative_attention import RelativeAttention
from service.model.transformer import Attention, Transformer
from tests.conftest import tiny_transformer

LENGTH = 9
BATCH = 2
TOLERANCE = 1e-5
SETTINGS: dict[str, dict[str, Any]] = {
    "shaw": {"shaw_max_distance": 3},
    "transformer_xl": {},
    "cope": {"cope_npos_max": 4},
    "rope_alibi": {},
}


def model_attention(model: Transformer, x: Tensor, scaling: RopeScaling) -> Tensor:
    """The first layer's attention output [B, T, d_model] for hidden states `x`, no cache."""
    positions = model.positions(
        x.shape[1], [0] * x.shape[0], [scaling] * x.shape[0], device=x.device, dtype=x.dtype
    )
    output: Tensor = first_attention(model)(x, positions, None, 0)
    return output


def first_attention(model: Transformer) -> Attention:
    attn = model.layers[0].attn
    assert isinstance(attn, Attention)
    return attn


def projections(attn: Attention, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, T, H, hd], k and v [B, T, Hkv, hd] in float64."""
    config = attn.config
    batch, length, _ = x.shape

    def split(linear: torch.nn.Linear, heads: int) -> Tensor:
        projected: Tensor = linear(x).double()
        return projected.view(batch, length, heads, config.head_dim)

    return (
        split(attn.q_proj, config.n_heads),
        split(attn.k_proj, config.n_kv_heads),
        split(attn.v_proj, config.n_kv_heads),
    )


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(value - top) for value in logits]
    return [value / sum(exps) for value in exps]


def naive_attention(attn: Attention, x: Tensor, logit: Any, value_extra: Any = None) -> Tensor:
    """sum_j softmax_j(logit(b, h, i, j, q_i, k_j)) (v_j + value_extra(i, j)) over j <= i, pair by pair."""
    config = attn.config
    queries, keys, values = projections(attn, x)
    batch, length, heads, head_dim = queries.shape
    group = config.n_heads // config.n_kv_heads
    out = torch.zeros(batch, length, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            kv = h // group
            for i in range(length):
                logits = [logit(b, h, i, j, queries[b, i, h], keys[b, j, kv]) for j in range(i + 1)]
                weights = softmax(logits)
                for j, weight in enumerate(weights):
                    extra = 0.0 if value_extra is None else value_extra(i, j)
                    out[b, i, h] += weight * (values[b, j, kv] + extra)
    merged = out.view(batch, length, heads * head_dim).to(attn.o_proj.weight.dtype)
    result: Tensor = attn.o_proj(merged)
    return result


def shaw_reference(attn: Any, x: Tensor) -> Tensor:
    k = attn.config.shaw_max_distance
    a_key = attn.relative.key_table.double()
    a_value = attn.relative.value_table.double()
    scale = math.sqrt(attn.config.head_dim)

    def row(i: int, j: int) -> int:
        return int(-max(-k, min(k, j - i)))  # clip(j - i, -k, k), causal: distances -k .. 0

    def logit(b: int, h: int, i: int, j: int, q: Tensor, key: Tensor) -> float:
        return float(q @ (key + a_key[row(i, j)])) / scale

    return naive_attention(attn, x, logit, lambda i, j: a_value[row(i, j)])


def transformer_xl_reference(attn: Any, x: Tensor, factor: float = 1.0) -> Tensor:
    config = attn.config
    layer = attn.relative
    w_r = layer.r_proj.weight.double()  # [H * hd, d_model]
    u, v = layer.u.double(), layer.v.double()
    scale = math.sqrt(config.head_dim)

    def encoding(distance: float) -> Tensor:
        half = config.d_model // 2
        freqs = [10000.0 ** (-2 * m / config.d_model) for m in range(half)]
        sines = [math.sin(distance * freq) for freq in freqs]
        cosines = [math.cos(distance * freq) for freq in freqs]
        return torch.tensor(sines + cosines, dtype=torch.float64)

    def logit(b: int, h: int, i: int, j: int, q: Tensor, key: Tensor) -> float:
        projected = (w_r @ encoding((i - j) / factor)).view(config.n_heads, config.head_dim)[h]
        a_term, c_term = q @ key, u[h] @ key
        b_term, d_term = q @ projected, v[h] @ projected
        return float(a_term + b_term + c_term + d_term) / scale

    return naive_attention(attn, x, logit)


def cope_reference(attn: Any, x: Tensor) -> Tensor:
    config = attn.config
    table = attn.relative.position_table.double()
    queries, keys, _ = projections(attn, x)
    group = config.n_heads // config.n_kv_heads
    scale = math.sqrt(config.head_dim)

    def gate(b: int, h: int, i: int, t: int) -> float:
        return 1.0 / (1.0 + math.exp(-float(queries[b, i, h] @ keys[b, t, h // group]) / scale))

    def logit(b: int, h: int, i: int, j: int, q: Tensor, key: Tensor) -> float:
        p = min(sum(gate(b, h, i, t) for t in range(j, i + 1)), float(config.cope_npos_max))
        low, high = math.floor(p), math.ceil(p)
        z = (p - low) * float(q @ table[high]) + (1 - (p - low)) * float(q @ table[low])
        return float(q @ key) / scale + z

    return naive_attention(attn, x, logit)


def rope_alibi_reference(attn: Any, x: Tensor) -> Tensor:
    config = attn.config
    slopes = alibi_slopes(config.n_heads).double()
    half = config.head_dim // 2
    scale = math.sqrt(config.head_dim)

    def rotate(vector: Tensor, position: int) -> Tensor:
        """NeoX layout: channel m pairs with m + hd/2, turned by position * base^(-2m/hd)."""
        out = vector.clone()
        for m in range(half):
            angle = position * config.rope_base ** (-2 * m / config.head_dim)
            first, second = vector[m], vector[m + half]
            out[m] = first * math.cos(angle) - second * math.sin(angle)
            out[m + half] = second * math.cos(angle) + first * math.sin(angle)
        return out

    def logit(b: int, h: int, i: int, j: int, q: Tensor, key: Tensor) -> float:
        return float(rotate(q, i) @ rotate(key, j)) / scale + float(slopes[h]) * (j - i)

    return naive_attention(attn, x, logit)


REFERENCES = {
    "shaw": shaw_reference,
    "transformer_xl": transformer_xl_reference,
    "cope": cope_reference,
    "rope_alibi": rope_alibi_reference,
}


@pytest.mark.parametrize("scheme", list(SETTINGS))
@torch.inference_mode()
def test_attention_equals_the_naive_loop_from_the_equations(scheme: str) -> None:
    model = tiny_transformer(pe=scheme, n_heads=4, n_kv_heads=2, **SETTINGS[scheme])
    _randomise_relative_parameters(model)
    x = torch.randn(BATCH, LENGTH, model.config.d_model, generator=torch.Generator().manual_seed(5))
    expected = REFERENCES[scheme](first_attention(model), x)
    actual = model_attention(model, x, RopeScaling())
    assert (actual - expected).abs().max().item() <= TOLERANCE


@torch.inference_mode()
def test_transformer_xl_linear_scaling_interpolates_relative_positions() -> None:
    model = tiny_transformer(pe="transformer_xl")
    _randomise_relative_parameters(model)
    x = torch.randn(BATCH, LENGTH, model.config.d_model, generator=torch.Generator().manual_seed(6))
    expected = transformer_xl_reference(first_attention(model), x, factor=2.5)
    actual = model_attention(model, x, RopeScaling(type="linear", factor=2.5))
    assert (actual - expected).abs().max().item() <= TOLERANCE


def _randomise_relative_parameters(model: Transformer) -> None:
    """XL's u and v start at zero and the tables near it: make every term weigh in the comparison."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RelativeAttention):
                for parameter in module.parameters():
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
